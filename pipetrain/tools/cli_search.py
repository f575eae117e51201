"""``pipetrain plan PROFILE --devices N --batch-size B [--memory CAP]``: plan the whole run.

Without ``--stages`` or ``--microbatches`` the plan command searches (``partitioner.search``)
the pipeline ranks x data-parallel copies, the schedule, the micro-batch count and the ZeRO
level, honouring whichever of them the user fixed, and prints the chosen plan as a plain plan
is printed, each other schedule's best, and what binds the choice.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

from partitioner import Plan, Profile, format_bytes
from partitioner.search import (
    WITHIN,
    Candidate,
    Settings,
    best_per_schedule,
    candidates,
    frontier,
    peak_memory,
    space,
    why_empty,
)
from pipetrain.tools.cli_common import UsageError, host, ms, save


def _fixed(args: argparse.Namespace) -> dict[str, Any]:
    """The choices the user fixed, as the one-entry lists the search narrows to."""
    return {key: None if value is None else [value] for key, value in (
        ("schedules", args.schedule), ("stages", args.stages),
        ("microbatches", args.microbatches), ("zero", args.zero))}


def search_from_args(profile: Profile, args: argparse.Namespace) -> tuple[list[Candidate], float]:
    """Every candidate the command line's space holds, planned or pruned, and the seconds
    the search took; a UsageError naming the constraint when the space is empty."""
    if args.devices is None or args.batch_size is None:
        raise UsageError("planning the whole run needs --devices N and --batch-size B (the "
                         "mini-batch over all devices); or fix the split with --stages and "
                         "--microbatches")
    fixed = _fixed(args)
    if next(space(profile, devices=args.devices, batch_size=args.batch_size,
                  virtual_stages=args.virtual_stages, **fixed), None) is None:
        raise UsageError("infeasible: " + why_empty(
            profile, devices=args.devices, batch_size=args.batch_size, stages=fixed["stages"],
            microbatches=fixed["microbatches"]))
    settings = Settings(memory=args.memory, bandwidth=args.bandwidth, checkpoint=args.checkpoint,
                        host=host(args), reduce_scatter=args.reduce_scatter)
    start = time.perf_counter()
    found = candidates(profile, devices=args.devices, batch_size=args.batch_size,
                       virtual_stages=args.virtual_stages, settings=settings, **fixed)
    return found, time.perf_counter() - start


def refusal(found: Sequence[Candidate], args: argparse.Namespace) -> str:
    """Why nothing fits, with the flags that would: a larger cap (the least any point needs)
    or the other ways the points' own refusals name."""
    needs = [c for c in found if c.need is not None]
    if needs and args.memory is not None:
        least = min(needs, key=lambda c: c.need or 0)
        assert least.need is not None
        # --checkpoint auto already recomputes wherever the cap needs it
        recompute = ", or --checkpoint auto" if args.checkpoint == "never" else ""
        return (f"infeasible: no point of the search fits the memory cap of "
                f"{format_bytes(args.memory)} per device on {args.devices} devices; the least "
                f"any needs is {format_bytes(least.need)} ({least.point.describe()}): pass "
                f"--memory {math.ceil(least.need / 2**20)}MiB or more, more --devices"
                f"{recompute}")
    first = found[0].reason if found else "no point to plan"
    return f"infeasible: no point of the search could be planned; e.g. {first}"


def summary(found: Sequence[Candidate], seconds: float, args: argparse.Namespace) -> str:
    """One line: how much was searched and what became of it."""
    planned = sum(c.plan is not None for c in found)
    pruned = sum(c.pruned for c in found)
    refused = len(found) - planned - pruned
    return (f"searched {len(found):,} points ({args.devices} devices, batch "
            f"{args.batch_size}) in {seconds:.1f} s: {planned:,} planned, {pruned:,} pruned by "
            f"their step floors, {refused:,} refused")


def chosen_lines(best: Candidate) -> list[str]:
    """The chosen point and how to run it."""
    assert best.plan is not None
    p = best.point
    ranks = best.plan.pipeline_ranks
    run = f"pipetrain train ... --plan PLAN.json starts {ranks * p.data_parallel} processes"
    if p.data_parallel > 1:
        run += f" ({ranks} pipeline rank{'s' * (ranks != 1)} x {p.data_parallel} copies)"
    return [f"chosen: {p.describe()}: step {ms(best.plan.step_time)} ms, peak "
            f"{format_bytes(peak_memory(best.plan))} per rank", run]


def runner_up_table(found: Sequence[Candidate], chosen: Candidate) -> list[str]:
    """Each other schedule's best plan (step time, peak memory per rank; exact where within
    WITHIN of the chosen step, else the best its unpruned points gave), and the schedules that
    had none."""
    best = best_per_schedule(found)
    rows = [f"{'schedule':<15}{'ranks':>6}{'copies':>7}{'micro-batches':>14}{'zero':>5}"
            f"{'step ms':>11}{'vs chosen':>10}{'peak/rank':>12}"]
    assert chosen.plan is not None
    for name, c in best.items():
        if name == chosen.schedule or c.plan is None:
            continue
        rows.append(f"{name:<15}{c.stages:>6}{c.point.data_parallel:>7}{c.microbatches:>14}"
                    f"{c.zero:>5}{ms(c.plan.step_time):>11}"
                    f"{c.plan.step_time / chosen.plan.step_time:>9.2f}x"
                    f"{format_bytes(peak_memory(c.plan)):>12}")
    searched = {c.schedule for c in found}
    missing = sorted(searched - set(best))
    if missing:
        rows.append(f"no plan: {', '.join(missing)} (no point fits, or none can come within "
                    f"{WITHIN:.2f}x of the chosen step: pruned by their floors)")
    return ["the best of each other schedule:", *rows] if len(rows) > 1 else []


def binding(found: Sequence[Candidate], chosen: Candidate, args: argparse.Namespace) -> list[str]:
    """What binds the choice: the memory cap, the devices, the batch's divisibility."""
    assert chosen.plan is not None
    step = chosen.plan.step_time
    lines = []
    blocked = [c for c in found if c.need is not None and c.floor < step]
    if args.memory is None:
        lines.append("memory: no cap given (--memory CAP to plan under one)")
    elif blocked:
        least = min(c.floor for c in blocked)
        lines.append(f"memory: binds: {len(blocked):,} points that might be faster (floor "
                     f"from {ms(least)} ms) do not fit in {format_bytes(args.memory)}")
    else:
        lines.append(f"memory: does not bind (the chosen plan peaks at "
                     f"{format_bytes(peak_memory(chosen.plan))} of "
                     f"{format_bytes(args.memory)})")
    floor = min(c.floor for c in found)
    lines.append(f"devices: {args.devices} in use; no point's step can be under {ms(floor)} ms "
                 f"on them (the chosen step is {step / floor:.2f}x that: bubble, "
                 "communication and imbalance)")
    p = chosen.point
    share = args.batch_size // p.data_parallel
    if p.microbatch_size == 1 and args.microbatches is None:
        lines.append(f"batch: binds: {p.microbatches} micro-batches of 1 sample are the most "
                     f"a copy's {share} samples allow; a larger --batch-size would allow more")
    else:
        lines.append(f"batch: {args.batch_size} = {p.data_parallel} copies x "
                     f"{p.microbatches} micro-batches x {p.microbatch_size} samples; copies and "
                     "micro-batch counts that do not divide it were not searched")
    return lines


def explain(found: Sequence[Candidate]) -> list[str]:
    """The time-vs-memory frontier of the planned points, fastest first."""
    rows = ["frontier (no other planned point is both faster and lighter):",
            f"{'step ms':>11}{'peak/rank':>12}  point"]
    for c in frontier(found):
        assert c.plan is not None
        rows.append(f"{ms(c.plan.step_time):>11}{format_bytes(peak_memory(c.plan)):>12}  "
                    f"{c.point.describe()}")
    return rows


def cmd_search(profile: Profile, args: argparse.Namespace, describe: Callable[[Plan], str]) -> int:
    """The search, printed; ``describe`` prints a plan as ``pipetrain plan`` does."""
    found, seconds = search_from_args(profile, args)
    best = best_per_schedule(found)
    if not best:
        raise UsageError(refusal(found, args))
    chosen = next(iter(best.values()))
    assert chosen.plan is not None
    print(summary(found, seconds, args))
    print("\n".join(chosen_lines(chosen)))
    print(describe(chosen.plan))
    for part in (runner_up_table(found, chosen), binding(found, chosen, args),
                 explain(found) if args.explain else []):
        if part:
            print("\n".join(part))
    if args.output:
        save(chosen.plan.to_json(), args.output)
        print(f"wrote {args.output}")
    return 0
