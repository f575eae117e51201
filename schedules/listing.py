"""A rank's action list as text, with one action marked: what a failed step prints so that the
failing rank's place in its schedule can be read at a glance (as torch.distributed.pipelining
does), a few actions either side rather than the whole list."""

from __future__ import annotations

from schedules.action import Schedule

CONTEXT = 4  # actions shown before and after the marked one


def excerpt(schedule: Schedule, rank: int, position: int, context: int = CONTEXT) -> str:
    """Rank ``rank``'s actions of ``schedule`` around index ``position``, that one marked."""
    ops = schedule.actions[rank]
    first, last = max(position - context, 0), min(position + context, len(ops) - 1)
    stages = ", ".join(map(str, schedule.stages_on(rank)))
    lines = [
        f"rank {rank} (stage {stages}) of schedule {schedule.name!r}, {schedule.stages} stages, "
        f"{schedule.microbatches} micro-batches: actions {first + 1}-{last + 1} of {len(ops)}"
    ]
    width = len(str(last + 1))
    for i in range(first, last + 1):
        mark = "->" if i == position else "  "
        tail = "  <- failed here" if i == position else ""
        lines.append(f"  {mark} {i + 1:>{width}}  {ops[i]}{tail}")
    return "\n".join(lines)
