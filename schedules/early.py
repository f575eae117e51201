"""The early weight pass: a stage's last backward sends its input gradients before it computes
its weight gradients, as its own W action.

The previous stage (on another rank) waits for those input gradients to run its own last
backward, which the pipeline's drain waits for; computing the weight gradients after sending
takes them off the drain, once per stage boundary. A schedule that splits every backward (zero
bubble) places its W actions itself; elsewhere the runtime names the stages where the split
costs nothing extra (pipetrain/runtime/update.py, ``Update.call_list``) and runs the list this
function writes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from schedules.action import Action, Kind, Schedule


def with_early_weights(schedule: Schedule, stages: Iterable[int]) -> Schedule:
    """``schedule`` with W(s, i) after the last backward B(s, i) of each stage s of ``stages``:
    right after its SEND_GRAD(s, i), or after B(s, i) where no message carries the gradient.
    The validator accepts such a W (one per stage, its last backward's); simulated, B(s, i)
    then costs ``backward`` and the W ``weight``."""
    if schedule.asynchronous or schedule.splits_backward or schedule.weights:
        raise ValueError(
            f"schedule {schedule.name!r} cannot take early weight passes: only a synchronous "
            "schedule without W actions can (a zero-bubble one places its W itself)"
        )
    chosen = set(stages)
    actions = {}
    for rank, ops in schedule.actions.items():
        listed = list(ops)
        for s in sorted(chosen & set(schedule.stages_on(rank))):
            last = [a for a in listed if a.kind is Kind.BACKWARD and a.stage == s][-1]
            send = Action(Kind.SEND_GRAD, s, last.microbatch)
            after = listed.index(send if send in listed else last)
            listed.insert(after + 1, Action(Kind.WEIGHT, s, last.microbatch))
        actions[rank] = tuple(listed)
    return replace(schedule, actions=actions)
