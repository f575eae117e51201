"""What the ``pipetrain`` commands share: the one-line usage error, argument readers, a profile
named on the command line, and writing an output file. Torch-free, as the planning commands
that import it are (the model factories of profile and train are in cli_models.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from partitioner import Host, Profile, load_pipedream, parse_bytes
from pipetrain.observe.gantt import pyplot

PROG = "pipetrain"
PIPEDREAM_PREFIX = "pipedream:"
HF_PREFIX = "hf:"


class UsageError(Exception):
    """Bad input from the command line: reported in one line, exit status 2."""


def ints(text: str, what: str) -> list[int]:
    """``"64,3,32,32"`` (or ``64x3x32x32``) as positive integers."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{what} must be positive integers separated by commas, got {text!r}")
    return values


def json_kwargs(text: str) -> dict[str, Any]:
    """``--kwargs``: a JSON object of keyword arguments; a ValueError naming what is wrong."""
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--kwargs is not valid JSON: {error}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--kwargs must be a JSON object, got {text!r}")
    return kwargs


def bytes_arg(text: str) -> int:
    """An argparse type: ``16GiB`` as bytes."""
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def load_profile(source: str, batch_size: int | None) -> Profile:
    """A profile JSON, a PipeDream graph.txt (by path or ``pipedream:NAME``)."""
    if source.startswith(HF_PREFIX):
        raise UsageError(
            f"plan reads a profile; make one of {source} first: pipetrain profile {source} "
            "--meta --input-shape BATCH,SEQ --input-dtype int64 --input-high VOCAB "
            "-o profile.json"
        )
    if source.startswith(PIPEDREAM_PREFIX) or source.endswith(".txt"):
        name = source.removeprefix(PIPEDREAM_PREFIX)
        try:
            return load_pipedream(name, batch_size)
        except FileNotFoundError as error:
            raise UsageError(str(error).strip('"')) from None
    path = Path(source)
    if not path.is_file():
        raise UsageError(
            f"no such file: {source} (give a profile JSON from `pipetrain profile`, a PipeDream "
            "graph.txt or pipedream:NAME)"
        )
    if is_plan(source):
        raise UsageError(f"{source} is a plan; give the profile it was made from")
    return Profile.load(path)


def is_plan(source: str) -> bool:
    """Whether ``source`` names a plan JSON (from ``pipetrain plan``)."""
    path = Path(source)
    if source.startswith(PIPEDREAM_PREFIX) or not path.is_file():
        return False
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(data, dict) and data.get("format") == "pipetrain-plan"


def need_matplotlib(instead: str) -> None:
    """Fail before any work when a picture is asked for but matplotlib is missing."""
    try:
        pyplot()
    except ImportError as error:
        raise UsageError(f"{error} (or {instead})") from None


def save(text: str, path: str) -> None:
    try:
        Path(path).write_text(text + "\n")
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from None


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def add_planning_options(p: argparse.ArgumentParser) -> None:
    """The options ``plan`` and ``simulate`` share: sizes, the link and the host."""
    p.add_argument(
        "--batch-size",
        type=int,
        help="samples per step: in `plan`'s search the mini-batch over all devices; the "
        "mini-batch size of a PipeDream graph.txt (inferred for image models)",
    )
    p.add_argument(
        "--microbatch-size",
        type=int,
        help="samples per micro-batch; times scale linearly from the profile's batch "
        "(default: the profile's batch size)",
    )
    p.add_argument("--bandwidth", help="between consecutive stages, e.g. 25GB/s or 100Gbit/s")
    p.add_argument(
        "--cores",
        type=int,
        help="the stages are processes sharing this many cores of one host (a CPU machine): "
        "predict with processor sharing, messages as copies at --bandwidth",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        help="under --schedule interleaved: stages per rank, so ranks = stages / this "
        "(default 2)",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        help="the runtime's own time per action, as `pipetrain trace` reports it (default 0)",
    )


def host(args: argparse.Namespace, default: Host | None = None) -> Host:
    """The --cores / --overhead-ms a prediction assumes (each defaulting to ``default``'s)."""
    default = default or Host()
    try:
        return Host(
            default.cores if args.cores is None else args.cores,
            default.overhead if args.overhead_ms is None else args.overhead_ms / 1e3,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
