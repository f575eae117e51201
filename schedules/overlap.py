"""Overlapped pairs: one rank's forward of one stage and backward of another, as one unit.

DualPipe (DeepSeek-V3 technical report, 2024) pairs a micro-batch's forward on one of a rank's
stages with another micro-batch's backward on its other stage, so that on a GPU one half's
communication or compute hides behind the other's; torch lists such a pair as one
OVERLAP_F_B action. Here a pair is two ordinary actions, next to each other in their rank's
compute order and named in ``Schedule.overlaps``. The messages between them (the forward's
send, the backward's receive) stay where the lists put them: every send is posted without
waiting, so on a GPU, where kernels are queued rather than waited for, the halves can run at
once, while the lists stay deadlock-free with blocking sends as the validator holds them.
Run in order (as on a CPU, and as the simulator times them) the pair is its forward, then its
backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from schedules.action import Action, Kind, Schedule


def overlapped(schedule: Schedule, pairs: Iterable[tuple[Action, Action]]) -> Schedule:
    """``schedule`` with the (forward, backward) ``pairs`` named overlapped; raises ValueError
    for a pair that is not one (:func:`refusal`)."""
    chosen = frozenset(pairs)
    for forward, backward in chosen:
        if reason := refusal(schedule, forward, backward):
            raise ValueError(reason)
    return replace(schedule, overlaps=chosen)


def refusal(schedule: Schedule, forward: Action, backward: Action) -> str | None:
    """Why ``(forward, backward)`` cannot be an overlapped pair of ``schedule``, or None: it
    must be a forward and a backward of two stages of one rank, next to each other in that
    rank's compute order."""
    why = f"cannot overlap {forward} and {backward}"
    if forward.kind is not Kind.FORWARD or backward.kind is not Kind.BACKWARD:
        return f"{why}: a pair is a forward, then a backward"
    if forward.stage == backward.stage or not schedule.local(forward.stage, backward.stage):
        return f"{why}: a pair's halves are two stages of one rank"
    compute = schedule.compute(schedule.rank_of(forward.stage))
    if forward not in compute or backward not in compute:
        return f"{why}: the rank does not list both"
    if compute.index(backward) != compute.index(forward) + 1:
        return f"{why}: the rank computes something between them"
    return None
