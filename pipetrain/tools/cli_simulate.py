"""``pipetrain simulate SOURCE``: time a schedule for a plan, or for a profile split by hand.

The costs come from partitioner/stage_times.py (a plan's own, or the planner's model of a
``--balance`` split); this module reads the command line and prints the simulated step.
"""

from __future__ import annotations

import argparse

from partitioner import Plan, format_bytes
from partitioner.stage_times import StageTimes, of_plan, of_split
from pipetrain.observe.gantt import draw
from pipetrain.tools.cli_common import (
    UsageError,
    add_planning_options,
    host,
    ints,
    is_plan,
    load_profile,
    ms,
    need_matplotlib,
)
from schedules import DEFAULT_SCHEDULE, Simulation, names


def _plan_times(args: argparse.Namespace) -> StageTimes:
    """A plan's own split, schedule and micro-batches, overridable from the command line."""
    plan = Plan.load(args.source)
    if args.balance is not None:
        raise UsageError("--balance is for a profile; a plan has its own balance")
    return of_plan(plan, args.schedule, args.microbatches, host(args, plan.host))


def _profile_times(args: argparse.Namespace) -> StageTimes:
    """A profile split by --balance, costed by the planner's model."""
    profile = load_profile(args.source, args.batch_size)
    if args.balance is None:
        raise UsageError("simulating a profile needs --balance (layers per stage, e.g. 3,5)")
    balance = ints(args.balance, "--balance")
    if args.microbatches is None:
        raise UsageError("simulating a profile needs --microbatches")
    return of_split(
        profile, balance, microbatches=args.microbatches,
        schedule=args.schedule or DEFAULT_SCHEDULE, microbatch_size=args.microbatch_size,
        checkpoint=args.checkpoint, bandwidth=args.bandwidth,
        virtual_stages=args.virtual_stages, host=host(args),
    )


def _stage_rows(c: StageTimes, result: Simulation) -> list[str]:
    """The header and one row per stage."""
    header = (
        f"{'stage':>5} {'layers':>11} {'forward ms':>10} {'backward ms':>11} {'send ms':>8} "
        f"{'busy ms':>9} {'bubble':>7} {'peak in-flight':>14}"
    )
    if c.memory is not None:
        header += f" {'memory':>11}"
    rows = [header]
    start = 0
    for t, (count, rank) in enumerate(zip(c.balance, c.built.placement, strict=True)):
        row = (
            f"{t:>5} {start:>5}-{start + count - 1:<5} {ms(c.forward[t]):>10} "
            f"{ms(c.backward[t]):>11} {ms(c.transfer[t]) if t < len(c.transfer) else '-':>8} "
            f"{ms(result.busy[rank]):>9} {result.stage_bubble(rank):>7.1%} "
            f"{result.peak_inflight[rank]:>14}"
        )
        if c.memory is not None:
            row += f" {format_bytes(c.memory[t]):>11}"
        rows.append(row)
        start += count
    return rows


def simulation_table(c: StageTimes, result: Simulation) -> list[str]:
    """One row per stage, then the predicted step."""
    rows = _stage_rows(c, result)
    size = c.microbatch_size
    rows.append(
        f"predicted step time {ms(result.step_time)} ms, bubble fraction "
        f"{result.bubble_fraction:.1%}"
        + (
            f", {c.microbatches * size / result.step_time:,.1f} samples/s"
            if size and result.step_time > 0
            else ""
        )
        + c.host.describe()
    )
    ranks = len(result.busy)
    if ranks < len(c.balance):
        rows.append(
            f"busy, bubble and peak in-flight are those of the stage's rank "
            f"({c.built.placement_text()})"
        )
        rows.append(f"peak in-flight micro-batches per rank: {list(result.peak_inflight)}")
    else:
        rows.append(f"peak in-flight micro-batches per stage: {list(result.peak_inflight)}")
    if c.refused_cuts:
        rows.append(
            f"note: the profile does not allow a cut after layer(s) {c.refused_cuts} (too many "
            "tensors cross there); the planner would not choose this split"
        )
    return rows


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.png:
        need_matplotlib("leave out --png")
    c = _plan_times(args) if is_plan(args.source) else _profile_times(args)
    try:
        result = c.predict()
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(
        f"{c.schedule}, {len(c.balance)} stages, balance {c.balance}, {c.microbatches} "
        "micro-batches" + (f" of {c.microbatch_size} samples" if c.microbatch_size else "")
    )
    rows = simulation_table(c, result)
    if args.png:
        picture = draw([(f"simulated {c.schedule}", result.timeline)], args.png)
        rows.append(f"timeline picture: {picture}")
    print("\n".join(rows))
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain simulate``: its arguments."""
    p = sub.add_parser(
        "simulate",
        help="time a schedule for a plan, or for a profile split by --balance",
        description="Predict the step time, bubble fraction and peak in-flight micro-batches "
        "per stage. SOURCE: a plan JSON (its split, schedule and micro-batches, overridable), "
        "or a profile (JSON, graph.txt, pipedream:NAME) with --balance and --microbatches.",
    )
    p.add_argument("source")
    p.add_argument("--balance", help="layers per stage, e.g. 3,5 (for a profile)")
    p.add_argument("--microbatches", type=int)
    p.add_argument("--schedule", choices=names(),
                   help=f"default: the plan's, or {DEFAULT_SCHEDULE}")
    p.add_argument("--png", help="draw the simulated timeline here (needs matplotlib)")
    p.add_argument(
        "--checkpoint",
        default="never",
        choices=["never", "always"],
        help="for a profile: every stage recomputes its activations in backward, or none "
        "(default: never)",
    )
    add_planning_options(p)
    p.set_defaults(run=cmd_simulate)
