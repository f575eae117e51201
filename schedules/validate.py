"""Prove a schedule complete and deadlock-free before anything runs it.

Complete: every stage forwards and backwards each micro-batch exactly once, receives before it
computes, sends after it computes, and ends with one optimizer step. Deadlock-free: executing all
stages with sends that block until their receive is posted (rendezvous) finishes; since the
runtime's sends never block, it cannot hang where this model does not.
"""

from __future__ import annotations

from schedules.action import RECVS, SENDS, Action, Kind, Schedule


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order or would deadlock."""


def _expected(stage: int, stages: int, microbatches: int) -> set[Action]:
    kinds = [Kind.FORWARD, Kind.BACKWARD]
    if stage > 0:
        kinds += [Kind.RECV_ACT, Kind.SEND_GRAD]
    if stage < stages - 1:
        kinds += [Kind.SEND_ACT, Kind.RECV_GRAD]
    return {Action(k, stage, i) for k in kinds for i in range(microbatches)}


# Within one stage, the action on the left must come before the one on the right.
_LOCAL_ORDER = [
    (Kind.RECV_ACT, Kind.FORWARD),
    (Kind.FORWARD, Kind.SEND_ACT),
    (Kind.FORWARD, Kind.BACKWARD),
    (Kind.RECV_GRAD, Kind.BACKWARD),
    (Kind.BACKWARD, Kind.SEND_GRAD),
]


def check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless each stage does each micro-batch's work once, in order."""
    p, m = schedule.stages, schedule.microbatches
    for s in range(p):
        ops = list(schedule.actions[s])
        wrong = [a for a in ops if a.stage != s]
        if wrong:
            raise ScheduleError(f"stage {s} lists actions of another stage: {wrong[0]}")
        steps = [i for i, a in enumerate(ops) if a.kind is Kind.STEP]
        if steps != [len(ops) - 1]:
            raise ScheduleError(f"stage {s} must end with exactly one STEP, found it at {steps}")
        work = ops[:-1]
        seen: set[Action] = set()
        for a in work:
            if a in seen:
                raise ScheduleError(f"stage {s} lists {a} twice")
            seen.add(a)
        expected = _expected(s, p, m)
        if missing := expected - seen:
            first = min(missing, key=lambda a: (a.microbatch, a.kind.value))
            raise ScheduleError(
                f"stage {s} never does {first} (micro-batch {first.microbatch} is skipped)"
            )
        if extra := seen - expected:
            raise ScheduleError(f"stage {s} lists {min(extra, key=str)}, which has no place here")
        position = {a: i for i, a in enumerate(work)}
        for i in range(m):
            for before, after in _LOCAL_ORDER:
                a, b = Action(before, s, i), Action(after, s, i)
                if a in position and b in position and position[a] > position[b]:
                    raise ScheduleError(f"stage {s} does {b} before {a}")


def check_deadlock_free(schedule: Schedule) -> None:
    """Run every stage with blocking (rendezvous) sends; raise ScheduleError if they get stuck."""
    ops = {s: list(schedule.actions[s]) for s in range(schedule.stages)}
    cursor = dict.fromkeys(ops, 0)

    def head(stage: int) -> Action | None:
        return ops[stage][cursor[stage]] if cursor[stage] < len(ops[stage]) else None

    progress = True
    while progress:
        progress = False
        for s in ops:
            a = head(s)
            while a is not None and a.kind not in SENDS | RECVS:
                cursor[s] += 1
                progress = True
                a = head(s)
            if a is None:
                continue
            peer = a.peer
            if peer is None or peer not in ops:
                raise ScheduleError(f"{a} has no peer stage")
            if head(peer) == a.matching():
                cursor[s] += 1
                cursor[peer] += 1
                progress = True
    stuck = {s: head(s) for s in ops if head(s) is not None}
    if stuck:
        waits = ", ".join(
            f"stage {s} waits at {a} (position {cursor[s]})" for s, a in stuck.items()
        )
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: {waits}")


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule is complete and deadlock-free."""
    check_complete(schedule)
    check_deadlock_free(schedule)

