"""``pipetrain consolidate FOLDER -o OUTPUT``: a pipeline checkpoint as one plain state_dict
(safetensors, torch.save, or with ``--hf`` a Hugging Face checkpoint directory)."""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from pipetrain.checkpoints.checkpointing import consolidate, consolidate_safetensors
from pipetrain.hf.save import save
from pipetrain.tools.cli_common import PROG, UsageError


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Save the newest checkpoint in a folder as one plain state_dict of the whole model:
    safetensors (written a stage at a time) for a .safetensors output, else torch.save."""
    output = Path(args.output)
    if not output.parent.is_dir():
        raise UsageError(f"{output.parent} does not exist; create it or write elsewhere (-o)")
    with warnings.catch_warnings(record=True) as fell_back:
        warnings.simplefilter("always")
        if args.hf is not None:
            save(args.folder, args.hf, output, args.max_shard_size)
            count = len(list(output.glob("*.safetensors")))
            print(f"Hugging Face checkpoint ({count} safetensors file(s)) written to {output}")
            return 0
        if output.suffix == ".safetensors":
            count = consolidate_safetensors(args.folder, output)
        else:
            state = consolidate(args.folder)
            torch.save(state, output)
            count = len(state)
    for warning in fell_back:  # e.g. a bad `latest`: say which checkpoint was read, on one line
        print(f"{PROG} consolidate: warning: {warning.message}", file=sys.stderr)
    print(f"{count} tensors of the whole model written to {args.output}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain consolidate``: its arguments."""
    p = sub.add_parser(
        "consolidate",
        help="turn a pipeline checkpoint into one plain state_dict",
        description="Read the newest checkpoint in FOLDER (from Pipeline.save or "
        "checkpoint_dir=...) and save the whole model's state_dict, loadable into the original "
        "nn.Sequential (or by Pipeline(weights=...), each rank reading its own stage). A "
        ".safetensors output is written one stage at a time, never the whole model in memory.",
    )
    p.add_argument("folder")
    p.add_argument(
        "-o", "--output", required=True,
        help="FILE.safetensors (safetensors, stage by stage) or any other name (torch.save); "
        "with --hf, a new directory",
    )
    p.add_argument(
        "--hf", metavar="CONFIG_DIR",
        help="write a Hugging Face checkpoint directory (config.json and the tokenizer files "
        "of CONFIG_DIR, safetensors shards, tied weights once) that "
        "AutoModelForCausalLM.from_pretrained loads; needs pipetrain[hf]",
    )
    p.add_argument("--max-shard-size", default="5GB", help="with --hf: bytes per shard")
    p.set_defaults(run=cmd_consolidate)
