"""``pipetrain schedule``: an action list in torch.distributed.pipelining's CSV format,
validated and simulated (``--from-csv FILE``), or a registered schedule written as one
(``--to-csv FILE``) for torch's ``_PipelineScheduleRuntime`` or an editor."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipetrain.tools.cli_common import UsageError
from schedules import build, from_csv, lookup, names, simulate, to_csv


def cmd_schedule(args: argparse.Namespace) -> int:
    """Validate and simulate a CSV list, or export a registered schedule."""
    if (args.from_csv is None) == (args.name is None):
        raise UsageError("give --from-csv FILE, or a schedule NAME with --stages and "
                         "--microbatches (and --to-csv FILE)")
    if args.from_csv is not None:
        schedule = from_csv(Path(args.from_csv).read_text(), Path(args.from_csv).stem)
    else:
        several = lookup(args.name).multi_stage_per_rank
        schedule = build(args.name, args.stages, args.microbatches,
                         ranks=args.ranks if several else None)
    split = schedule.splits_backward
    sim = simulate(schedule, args.forward, args.backward / 2 if split else args.backward,
                   weight=args.backward / 2 if split else None)
    print(f"{schedule.name}: {schedule.stages} stages on {schedule.ranks} ranks "
          f"({schedule.placement_text()}), {schedule.microbatches} micro-batches: valid")
    print(f"simulated with forward {args.forward:g} and backward {args.backward:g} per stage"
          f"{' (split evenly into B and W)' if split else ''}: step {sim.step_time:g}, "
          f"bubble {sim.bubble_fraction:.1%}, peak in-flight per rank {list(sim.peak_inflight)}")
    if args.to_csv:
        Path(args.to_csv).write_text(to_csv(schedule, communication=args.communication))
        print(f"wrote {args.to_csv}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain schedule``: its arguments."""
    p = sub.add_parser(
        "schedule", help="validate and simulate an action list in torch's CSV, or export one",
        description="Each CSV row is a rank's actions, cells as torch writes them: "
        "{stage}{F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B}{micro-batch}, e.g. 0F1.",
    )
    p.add_argument("name", nargs="?", choices=names(asynchronous=False), metavar="NAME",
                   help="a registered synchronous schedule to export")
    p.add_argument("--from-csv", metavar="FILE", help="the list to validate and simulate")
    p.add_argument("--to-csv", metavar="FILE", help="write the schedule as torch's CSV")
    p.add_argument("--communication", action="store_true",
                   help="write the sends and receives too (torch's compute_comms form)")
    p.add_argument("--stages", type=int, default=4)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--ranks", type=int, default=2,
                   help="for schedules with several stages per rank")
    p.add_argument("--forward", type=float, default=1.0, help="a stage's forward time")
    p.add_argument("--backward", type=float, default=2.0, help="a stage's backward time")
    p.set_defaults(run=cmd_schedule)
