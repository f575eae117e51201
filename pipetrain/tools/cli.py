"""The ``pipetrain`` command: profile a model, plan its pipeline, simulate a schedule, train.

    pipetrain profile examples.models:resnet_like --input-shape 64,3,32,32 -o profile.json
    pipetrain plan profile.json --stages 4 --microbatches 8 --memory 16GiB \\
        --bandwidth 25GB/s -o plan.json
    pipetrain plan pipedream:vgg16 --stages 4 --microbatches 8
    pipetrain simulate plan.json
    pipetrain simulate profile.json --balance 3,14 --microbatches 8 --schedule gpipe
    pipetrain schedule zbv --stages 8 --ranks 4 --microbatches 16 --to-csv zbv.csv
    pipetrain schedule --from-csv zbv.csv
    pipetrain train mymodule:task --plan plan.json --steps 100

One module per command (pipetrain/tools/cli_<command>.py: its ``add_command`` declares its
arguments, its ``cmd_<command>`` runs it; what they share is in cli_common.py); this one builds
the parser and reports errors. Exit status 0 on success and 2 on bad input (a file that is
missing or malformed, a model that cannot be imported, an input shape the model rejects,
constraints nothing satisfies), with a one-line message on stderr instead of a traceback.
Planning and simulating use the torch-free ``partitioner`` and ``schedules``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pipetrain import __version__
from pipetrain.errors import CheckpointError
from pipetrain.tools import (
    cli_consolidate,
    cli_plan,
    cli_profile,
    cli_schedule,
    cli_simulate,
    cli_trace,
    cli_train,
)
from pipetrain.tools.cli_common import PROG, UsageError

COMMANDS = (
    cli_profile, cli_plan, cli_simulate, cli_schedule, cli_trace, cli_consolidate, cli_train,
)
"""The commands' modules, in the order ``pipetrain --help`` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Profile, plan and simulate pipeline-parallel training."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (default: the process's arguments); return the exit status
    (2 for bad input, with a one-line message on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error argparse has already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train` passes them to torchrun
    try:
        return int(args.run(args))
    except (UsageError, ValueError, OSError, CheckpointError) as error:
        # ValueError covers the planner's ProfileError, PlanFileError and InfeasibleError.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
