"""``pipetrain trace FOLDER``: merge a traced run's per-rank traces into a Chrome trace and
draw the measured step beside its simulated twin (pipetrain/observe/trace.py)."""

from __future__ import annotations

import argparse

from pipetrain.observe.trace import report
from pipetrain.tools.cli_common import need_matplotlib


def cmd_trace(args: argparse.Namespace) -> int:
    """Merge a run's per-rank traces; draw the measured step beside its simulated twin."""
    if not args.no_png:
        need_matplotlib("pass --no-png")
    result = report(args.folder, png=not args.no_png, step=args.step)
    print(
        f"{result['ranks']} ranks, {result['steps']} steps traced (0..{result['steps'] - 1}); "
        f"step {result['step']}: measured "
        f"bubble {result['measured_bubble']:.1%}, simulated {result['simulated_bubble']:.1%} "
        "(the simulated twin: the schedule timed with this step's measured compute, runtime "
        "overhead, message latency and the ranks' entry times)"
    )
    overheads = ", ".join(f"{o * 1e3:.3f}" for o in result["overhead"])
    print(f"runtime overhead per action, ms per rank: {overheads} (for `plan --overhead-ms`)")
    print(f"Chrome/Perfetto trace: {result['trace']}")
    if "picture" in result:
        print(f"timeline picture: {result['picture']}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain trace``: its arguments."""
    p = sub.add_parser(
        "trace",
        help="merge a traced run into a Chrome trace and a timeline picture",
        description="FOLDER holds trace-rank*.json from Pipeline(trace=FOLDER) or "
        "PIPETRAIN_TRACE=FOLDER. Writes FOLDER/trace.json (Chrome/Perfetto) and "
        "FOLDER/timeline.png (the measured step above its simulated twin).",
    )
    p.add_argument("folder")
    p.add_argument(
        "--step", type=int, default=-1, help="which traced step to draw, from 0 (-1: the last)"
    )
    p.add_argument("--no-png", action="store_true", help="skip the picture")
    p.set_defaults(run=cmd_trace)
