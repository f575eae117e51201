"""Prove a schedule complete and deadlock-free before anything runs it.

Complete: every stage forwards and backwards each micro-batch exactly once (and, in a schedule
with W actions, does one W per micro-batch after its B), receives before it computes, sends
after it computes, hands tensors to a stage on its own rank in order (F(s) before F(s+1),
B(s+1) before B(s)), and each rank ends with the optimizer STEPs of its stages. Messages exist
only between stages on different ranks. Deadlock-free: executing all ranks with sends that
block until their receive is posted (rendezvous) finishes; since the runtime's sends never
block, it cannot hang where this model does not.

Messages name ranks as "stage N" when every rank runs one stage (the common case) and as
"rank N" otherwise.
"""

from __future__ import annotations

from schedules.action import RECVS, SENDS, Action, Kind, Schedule


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order or would deadlock."""


def _who(schedule: Schedule, rank: int) -> str:
    return f"stage {rank}" if schedule.one_stage_per_rank else f"rank {rank}"


def _expected(schedule: Schedule, stage: int, weight: bool) -> set[Action]:
    """Every action stage ``stage`` must do once (its STEP aside)."""
    kinds = [Kind.FORWARD, Kind.BACKWARD] + ([Kind.WEIGHT] if weight else [])
    if stage > 0 and not schedule.local(stage, stage - 1):
        kinds += [Kind.RECV_ACT, Kind.SEND_GRAD]
    if stage < schedule.stages - 1 and not schedule.local(stage, stage + 1):
        kinds += [Kind.SEND_ACT, Kind.RECV_GRAD]
    return {Action(k, stage, i) for k in kinds for i in range(schedule.microbatches)}


# Within one stage, the action on the left must come before the one on the right.
_LOCAL_ORDER = [
    (Kind.RECV_ACT, Kind.FORWARD),
    (Kind.FORWARD, Kind.SEND_ACT),
    (Kind.FORWARD, Kind.BACKWARD),
    (Kind.RECV_GRAD, Kind.BACKWARD),
    (Kind.BACKWARD, Kind.SEND_GRAD),
    (Kind.BACKWARD, Kind.WEIGHT),
]


def _order_rules(schedule: Schedule, stage: int, mb: int) -> list[tuple[Action, Action]]:
    """(before, after) pairs for one stage and micro-batch, including in-memory hand-offs to
    the next stage when it runs on the same rank."""
    rules = [(Action(x, stage, mb), Action(y, stage, mb)) for x, y in _LOCAL_ORDER]
    nxt = stage + 1
    if nxt < schedule.stages and schedule.local(stage, nxt):
        rules.append((Action(Kind.FORWARD, stage, mb), Action(Kind.FORWARD, nxt, mb)))
        rules.append((Action(Kind.BACKWARD, nxt, mb), Action(Kind.BACKWARD, stage, mb)))
    return rules


def _check_steps(schedule: Schedule, rank: int, ops: list[Action]) -> None:
    """The rank's list ends with exactly one STEP per stage it runs, ascending."""
    own = schedule.stages_on(rank)
    steps = [i for i, a in enumerate(ops) if a.kind is Kind.STEP]
    tail = ops[len(ops) - len(own) :]
    if steps == [len(ops) - len(own) + k for k in range(len(own))] and tail == [
        Action(Kind.STEP, s) for s in own
    ]:
        return
    if schedule.one_stage_per_rank:
        raise ScheduleError(f"stage {rank} must end with exactly one STEP, found it at {steps}")
    raise ScheduleError(
        f"rank {rank} must end with one STEP for each of its stages {list(own)} in that order, "
        f"found STEPs at {steps}"
    )


def check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless each stage does each micro-batch's work once, in order."""
    weight = schedule.splits_backward
    for r in range(schedule.ranks):
        who = _who(schedule, r)
        own = schedule.stages_on(r)
        ops = list(schedule.actions[r])
        wrong = [a for a in ops if a.stage not in own]
        if wrong:
            raise ScheduleError(f"{who} lists actions of another stage: {wrong[0]}")
        _check_steps(schedule, r, ops)
        work = ops[: len(ops) - len(own)]
        seen: set[Action] = set()
        for a in work:
            if a in seen:
                raise ScheduleError(f"{who} lists {a} twice")
            seen.add(a)
        expected = set().union(*(_expected(schedule, s, weight) for s in own))
        if missing := expected - seen:
            first = min(missing, key=lambda a: (a.microbatch, a.stage, a.kind.value))
            why = (
                "each micro-batch needs one W per stage once any W is listed"
                if first.kind is Kind.WEIGHT
                else f"micro-batch {first.microbatch} is skipped"
            )
            raise ScheduleError(f"{who} never does {first} ({why})")
        if extra := seen - expected:
            raise ScheduleError(f"{who} lists {min(extra, key=str)}, which has no place here")
        position = {a: i for i, a in enumerate(work)}
        for s in own:
            for i in range(schedule.microbatches):
                for a, b in _order_rules(schedule, s, i):
                    if a in position and b in position and position[a] > position[b]:
                        raise ScheduleError(f"{who} does {b} before {a}")


def check_deadlock_free(schedule: Schedule) -> None:
    """Run every rank with blocking (rendezvous) sends; raise ScheduleError if they get stuck."""
    ops = {r: list(schedule.actions[r]) for r in range(schedule.ranks)}
    cursor = dict.fromkeys(ops, 0)

    def head(rank: int) -> Action | None:
        return ops[rank][cursor[rank]] if cursor[rank] < len(ops[rank]) else None

    progress = True
    while progress:
        progress = False
        for r in ops:
            a = head(r)
            while a is not None and a.kind not in SENDS | RECVS:
                cursor[r] += 1
                progress = True
                a = head(r)
            if a is None:
                continue
            peer = a.peer
            if peer is None or not 0 <= peer < schedule.stages:
                raise ScheduleError(f"{a} has no peer stage")
            other = schedule.rank_of(peer)
            if other == r:
                raise ScheduleError(f"{a} sends to a stage on its own rank")
            if head(other) == a.matching():
                cursor[r] += 1
                cursor[other] += 1
                progress = True
    stuck = {r: head(r) for r in ops if head(r) is not None}
    if stuck:
        waits = ", ".join(
            f"{_who(schedule, r)} waits at {a} (position {cursor[r]})" for r, a in stuck.items()
        )
        raise ScheduleError(f"schedule {schedule.name!r} deadlocks: {waits}")


def validate(schedule: Schedule) -> None:
    """Raise ScheduleError unless the schedule is complete and deadlock-free. An asynchronous
    schedule is checked over several consecutive train_steps and the flush
    (``schedules.asynchronous.validate_async``), its declared lag included."""
    if schedule.asynchronous:
        from schedules.asynchronous import validate_async

        validate_async(schedule)
        return
    check_complete(schedule)
    check_deadlock_free(schedule)
