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
arguments, its ``cmd_<command>`` runs it; what they share is in cli_common.py, and the model
factories of profile and train in cli_models.py); this one builds the parser and reports
errors. Exit status 0 on success and 2 on bad input (a file that is missing or malformed, a
model that cannot be imported, an input shape the model rejects, constraints nothing
satisfies), with a one-line message on stderr instead of a traceback.
Only the module of the command run is imported: planning, simulating and ``schedule`` use the
torch-free ``partitioner`` and ``schedules`` and never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Iterable, Sequence

from pipetrain import __version__
from pipetrain.errors import CheckpointError
from pipetrain.tools.cli_common import PROG, UsageError

COMMANDS = {
    "profile": "measure a model layer by layer",
    "plan": "split a profiled model into pipeline stages, or plan the whole run",
    "simulate": "time a schedule for a plan, or for a profile split by --balance",
    "schedule": "validate and simulate an action list in torch's CSV, or export one",
    "trace": "merge a traced run into a Chrome trace and a timeline picture",
    "consolidate": "turn a pipeline checkpoint into one plain state_dict",
    "train": "train MODULE:FUNCTION's model with a plan, one process per rank",
}
"""Each command, in the order ``pipetrain --help`` lists them, with the line it says of it (the
same as its module, pipetrain/tools/cli_<command>.py, gives its parser)."""


def build_parser(full: Iterable[str] = COMMANDS) -> argparse.ArgumentParser:
    """The parser: the commands of ``full`` with all their arguments (each imports its
    module, and profile, trace, consolidate and train import torch), the others only named,
    so that ``pipetrain --help`` and a planning command never import torch."""
    parser = argparse.ArgumentParser(
        prog=PROG, description="Profile, plan and simulate pipeline-parallel training."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = set(full)
    for name, said in COMMANDS.items():
        if name in wanted:
            importlib.import_module(f"pipetrain.tools.cli_{name}").add_command(sub)
        else:
            sub.add_parser(name, help=said)
    return parser


def _command(argv: Sequence[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (``pipetrain``'s own
    options, --help and --version, take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (default: the process's arguments); return the exit status
    (2 for bad input, with a one-line message on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command = _command(argv)
    parser = build_parser([command] if command in COMMANDS else [])
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error argparse has already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    args.argv = argv  # `train` passes them to torchrun
    try:
        return int(args.run(args))
    except (UsageError, ValueError, OSError, CheckpointError) as error:
        # ValueError covers the planner's ProfileError, PlanFileError and InfeasibleError.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
