"""Prove a schedule complete and deadlock-free before anything runs it.

Complete: every stage forwards and backwards each micro-batch exactly once (and, in a schedule
with W actions, does one W per micro-batch after its B), receives before it computes, sends
after it computes, hands tensors to a stage on its own rank in order (F(s) before F(s+1),
B(s+1) before B(s)), and each rank ends with its step: the REDUCE of each of its stages, its
AGREE and the STEP of each stage (or, in older hand-written lists, the STEPs alone). A schedule
that does not split every backward may list one early W per stage, its last backward's.
Messages exist only between stages on different ranks. Each overlapped pair is a forward and
a backward of two stages of one rank, next to each other in its compute order. Deadlock-free:
executing all ranks with sends that block until their receive is posted (rendezvous)
finishes; since the runtime's sends never block, it cannot hang where this model does not.

Messages name ranks as "stage N" when every rank runs one stage (the common case) and as
"rank N" otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NoReturn

from schedules.action import RECVS, SENDS, STEP_KINDS, Action, Kind, Schedule, step_tail
from schedules.asynchronous import measure_lag, unroll
from schedules.errors import ScheduleError
from schedules.overlap import refusal


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


def _check_steps(schedule: Schedule, rank: int, ops: list[Action]) -> list[Action]:
    """The rank's step actions come in order: its step (:func:`schedules.action.step_tail`:
    REDUCE per stage, AGREE, STEP per stage, ascending) or, as older hand-written lists have
    it, exactly one STEP per stage it runs, ascending. Returns the list without them (that
    they come after it is :func:`_check_last`'s)."""
    own = schedule.stages_on(rank)
    closing = [a for a in ops if a.kind in STEP_KINDS]
    if closing in (step_tail(own), [Action(Kind.STEP, s) for s in own]):
        return [a for a in ops if a.kind not in STEP_KINDS]
    _refuse_steps(schedule, rank, ops)


def _check_last(schedule: Schedule, rank: int, ops: list[Action]) -> None:
    """Nothing follows the first of the rank's step actions but the others."""
    first = next(i for i, a in enumerate(ops) if a.kind in STEP_KINDS)
    if any(a.kind not in STEP_KINDS for a in ops[first:]):
        _refuse_steps(schedule, rank, ops)


def _refuse_steps(schedule: Schedule, rank: int, ops: list[Action]) -> NoReturn:
    own = schedule.stages_on(rank)
    found = ", ".join(f"{a} at {i}" for i, a in enumerate(ops) if a.kind in STEP_KINDS)
    step = (
        f"after its step's {', '.join(map(str, step_tail(own)[: len(own) + 1]))} (or, in an "
        "older list, alone)"
    )
    if schedule.one_stage_per_rank:
        raise ScheduleError(
            f"stage {rank} must end with exactly one STEP, {step}; found {found or 'none'}"
        )
    raise ScheduleError(
        f"rank {rank} must end with one STEP for each of its stages {list(own)} in that order, "
        f"{step}; found {found or 'none'}"
    )


def _early_weights(schedule: Schedule) -> set[Action] | None:
    """The Ws of a schedule that does not split every backward, where they are early weight
    passes (schedules/early.py): at most one per stage, that of its last backward. None for a
    stray W (every W is then required)."""
    found: set[Action] = set()
    for ops in schedule.actions.values():
        for s in {a.stage for a in ops if a.kind is Kind.WEIGHT}:
            weights = [a for a in ops if a.kind is Kind.WEIGHT and a.stage == s]
            backwards = [a.microbatch for a in ops if a.kind is Kind.BACKWARD and a.stage == s]
            if len(weights) > 1 or backwards[-1:] != [weights[0].microbatch]:
                return None
            found.update(weights)
    return found


def check_rank(
    schedule: Schedule,
    rank: int,
    ops: Sequence[Action],
    expected: set[Action],
    *,
    closing_steps: bool,
    context: str = "",
) -> None:
    """Raise ScheduleError unless ``rank``'s list ``ops`` does every action of ``expected`` once,
    nothing else and only for its own stages, each micro-batch's work in dependency order.
    ``closing_steps``: the list ends with one STEP per stage (a synchronous list; the STEPs of
    an asynchronous one are in ``expected``). ``context`` ends the messages (e.g. the name of
    the unrolled run)."""
    who = _who(schedule, rank)
    own = schedule.stages_on(rank)
    wrong = [a for a in ops if a.stage not in own]
    if wrong:
        raise ScheduleError(f"{who} lists actions of another stage: {wrong[0]}{context}")
    work = list(ops)
    if closing_steps:
        work = _check_steps(schedule, rank, work)
    seen: set[Action] = set()
    for a in work:
        if a in seen:
            raise ScheduleError(f"{who} lists {a} twice{context}")
        seen.add(a)
    if missing := expected - seen:
        first = min(missing, key=lambda a: (a.microbatch, a.stage, a.kind.value))
        why = (
            "each micro-batch needs one W per stage once any W is listed"
            if first.kind is Kind.WEIGHT
            else f"micro-batch {first.microbatch} is skipped"
        )
        raise ScheduleError(f"{who} never does {first} ({why}){context}")
    if extra := seen - expected:
        raise ScheduleError(f"{who} lists {min(extra, key=str)}, which has no place here{context}")
    position = {a: i for i, a in enumerate(work)}
    for s in own:
        for i in range(schedule.microbatches):
            for a, b in _order_rules(schedule, s, i):
                if a in position and b in position and position[a] > position[b]:
                    raise ScheduleError(f"{who} does {b} before {a}{context}")
    if closing_steps:
        _check_last(schedule, rank, list(ops))


def check_complete(schedule: Schedule) -> None:
    """Raise ScheduleError unless each stage does each micro-batch's work once, in order."""
    early = None if schedule.splits_backward else _early_weights(schedule)
    weight = early is None  # every W: a zero-bubble schedule, or one with a stray W
    for r in range(schedule.ranks):
        own = schedule.stages_on(r)
        expected = set().union(*(_expected(schedule, s, weight) for s in own))
        expected |= {a for a in early or () if a.stage in own}
        check_rank(schedule, r, schedule.actions[r], expected, closing_steps=True)
    for forward, backward in sorted(schedule.overlaps, key=str):
        if reason := refusal(schedule, forward, backward):
            raise ScheduleError(reason)


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
    (:func:`validate_async`), its declared lag included."""
    if schedule.asynchronous:
        validate_async(schedule)
        return
    check_complete(schedule)
    check_deadlock_free(schedule)


def validate_async(schedule: Schedule, calls: int = 3) -> None:
    """Raise ScheduleError unless ``calls`` consecutive train_steps and the flush, concatenated,
    form a complete, dependency-ordered, deadlock-free run whose updates follow the right
    backwards, and unless the measured steady-state lag of every stage is ``schedule.lag``."""
    if not schedule.one_stage_per_rank:
        raise ScheduleError(f"asynchronous schedule {schedule.name!r} needs one stage per rank")
    m, every = schedule.microbatches, schedule.update_every
    calls = max(calls, schedule.stages // m + 2)  # reach the steady state
    u = unroll(schedule, calls)
    for s in range(u.stages):
        ops = u.actions[s]
        steps = {Action(Kind.STEP, s, g) for g in range(u.microbatches) if (g + 1) % every == 0}
        context = f" in {u.name}"
        check_rank(u, s, ops, _expected(u, s, False) | steps, closing_steps=False, context=context)
        position = {a: i for i, a in enumerate(ops)}
        for step in sorted(steps, key=lambda a: a.microbatch):
            at, after = position[step], position[Action(Kind.BACKWARD, s, step.microbatch)]
            between = [a for a in ops[after + 1 : at] if a.kind is not Kind.SEND_GRAD]
            if at < after or between:
                raise ScheduleError(
                    f"stage {s}: {step} must follow B{step.microbatch} (and its send)"
                )
    check_deadlock_free(u)
    measured = measure_lag(u, every)
    for s, lags in measured.items():
        if max(lags.values(), default=0) != schedule.lag[s]:
            raise ScheduleError(
                f"stage {s} of {schedule.name!r} declares lag {schedule.lag[s]} but its "
                f"micro-batches see up to {max(lags.values(), default=0)} updates in between"
            )
