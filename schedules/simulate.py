"""Time a schedule from per-stage costs: step time, bubble fraction, activation memory.

The model is the runtime's: a rank runs its actions in order, one at a time; a send leaves as
soon as the compute that produced its tensor ends; a receive waits until the message has crossed
its link (``transfer`` seconds after it left). Besides its own cost every action takes
``overhead`` seconds of its rank's time (the runtime's bookkeeping: posting messages, picking the
next action; zero by default), which is neither compute nor waiting. A hand-off between two
stages on the same rank is no message and costs nothing: the list order already puts the
producer first.

Memory is counted in micro-batches per rank (a micro-batch on a stage counts once; with several
stages on a rank, each counts separately). A forward stores a micro-batch's activations. Without
W actions its B frees them. With W, B (input gradient) frees all but what W needs, and W frees
the rest (Qi et al. 2023, Table 1), so two counts are kept: ``peak_inflight`` counts micro-batches
forwarded whose activations are not all freed yet (not yet W'd; not yet B'd without W) and is
the safe bound; ``peak_full`` counts those still holding all their activations (not yet B'd).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from schedules.action import Action, Kind, Schedule
from schedules.asynchronous import unroll
from schedules.timeline import Span
from schedules.validate import validate


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs, per rank (= per stage under the identity placement); times in
    the units of the inputs."""

    step_time: float
    busy: tuple[float, ...]  # compute time (F, B, W) of each rank
    peak_inflight: tuple[int, ...]  # most micro-batches whose activations a rank holds at once
    finish: tuple[float, ...]  # when each rank's last action ends
    timeline: tuple[Span, ...] = ()  # every compute, step and receive wait, as it would run
    peak_full: tuple[int, ...] = ()  # most micro-batches holding all their activations (pre-B)

    @property
    def bubble_fraction(self) -> float:
        """Share of rank-time not spent on forward, backward or weight work (optimizer steps
        count as bubble): 1 - sum(busy) / (ranks * step_time)."""
        if self.step_time == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)

    def stage_bubble(self, stage: int) -> float:
        """Share of the step that rank ``stage`` spends outside compute (under the identity
        placement the rank is the stage)."""
        return 1.0 - self.busy[stage] / self.step_time if self.step_time else 0.0


def _per_stage(value: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(value, numbers.Real):
        return [float(value)] * n
    values = [float(v) for v in cast(Sequence[float], value)]
    if len(values) != n:
        raise ValueError(f"{what} needs {n} values (one per stage or link), got {len(values)}")
    return values


def _compute_costs(
    schedule: Schedule,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    weight: float | Sequence[float] | None,
    optimizer_step: float | Sequence[float],
) -> dict[Kind, list[float]]:
    """Per-stage cost of each compute kind. ``backward`` + ``weight`` is a stage's whole
    backward: a schedule with W spends them in B and W; one without spends their sum in B."""
    p = schedule.stages
    fwd = _per_stage(forward, p, "forward")
    bwd = _per_stage(backward, p, "backward")
    step = _per_stage(optimizer_step, p, "optimizer_step")
    if weight is None:
        if schedule.splits_backward:
            raise ValueError(
                f"schedule {schedule.name!r} splits the backward into B (input gradient) and W "
                "(weight gradient): pass weight= (the W time per stage); backward= is then "
                "the B time only"
            )
        wgt = [0.0] * p
    else:
        wgt = _per_stage(weight, p, "weight")
    if not schedule.splits_backward:
        bwd = [b + w for b, w in zip(bwd, wgt, strict=True)]
    return {Kind.FORWARD: fwd, Kind.BACKWARD: bwd, Kind.WEIGHT: wgt, Kind.STEP: step}


# how each compute changes (micro-batches held, micro-batches holding everything)
_MEMORY_SPLIT = {Kind.FORWARD: (1, 1), Kind.BACKWARD: (0, -1), Kind.WEIGHT: (-1, 0)}
_MEMORY_WHOLE = {Kind.FORWARD: (1, 1), Kind.BACKWARD: (-1, -1)}


def simulate(
    schedule: Schedule,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    transfer: float | Sequence[float] = 0.0,
    optimizer_step: float | Sequence[float] = 0.0,
    *,
    weight: float | Sequence[float] | None = None,
    overhead: float | Sequence[float] = 0.0,
    calls: int = 1,
    flush: bool = True,
) -> Simulation:
    """Simulate one mini-batch. ``forward``/``backward``/``weight``/``optimizer_step`` are
    per-stage times for one micro-batch (a scalar applies to every stage); ``transfer`` is the
    time one message takes across the boundary from stage s to s+1, per boundary (stages-1
    values; ignored where both stages share a rank) or one scalar.

    ``overhead`` is the runtime's own time per action, per rank (a scalar for every rank).

    ``weight`` is the W (weight-gradient) time, required for schedules with W actions, where
    ``backward`` is the B (input-gradient) time. For a schedule without W it may still be given
    (B then costs backward + weight), so that one set of costs times both kinds of schedule.

    An asynchronous schedule is simulated over ``calls`` consecutive train_steps followed by
    the flush (unless ``flush=False``), as ``schedules.asynchronous.unroll`` writes them; its
    steady-state cost per train_step is ``steady_state``'s.
    """
    validate(schedule)
    if schedule.asynchronous:
        schedule = unroll(schedule, calls, flush)
    p, ranks = schedule.stages, schedule.ranks
    cost = _compute_costs(schedule, forward, backward, weight, optimizer_step)
    link = _per_stage(transfer, max(p - 1, 0), "transfer")
    extra = _per_stage(overhead, ranks, "overhead")
    memory = _MEMORY_SPLIT if schedule.splits_backward else _MEMORY_WHOLE
    identity = schedule.one_stage_per_rank  # then spans need no rank: it is their stage

    clock = [0.0] * ranks
    cursor = [0] * ranks
    produced: dict[Action, float] = {}  # compute action -> end time
    arrival: dict[Action, float] = {}  # receive action -> when its message is there
    held, full = [0] * ranks, [0] * ranks
    peak, peak_full = [0] * ranks, [0] * ranks
    busy = [0.0] * ranks
    spans: list[Span] = []
    pending = sum(len(v) for v in schedule.actions.values())
    while pending:
        moved = False
        for r in range(ranks):
            ops = schedule.actions[r]
            where = None if identity else r
            while cursor[r] < len(ops):
                a = ops[cursor[r]]
                if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                    if a not in arrival:
                        break
                    spans.append(Span(a, clock[r], max(clock[r], arrival[a]), where))
                    clock[r] = spans[-1].end
                elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                    source = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
                    hop = link[min(a.stage, a.peer or 0)]
                    arrival[a.matching()] = produced[Action(source, a.stage, a.microbatch)] + hop
                else:
                    took = cost[a.kind][a.stage]
                    spans.append(Span(a, clock[r], clock[r] + took, where))
                    clock[r] += took
                    busy[r] += took if a.kind is not Kind.STEP else 0.0
                    produced[a] = clock[r]
                    d_held, d_full = memory.get(a.kind, (0, 0))
                    held[r] += d_held
                    full[r] += d_full
                    peak[r] = max(peak[r], held[r])
                    peak_full[r] = max(peak_full[r], full[r])
                clock[r] += extra[r]
                cursor[r] += 1
                pending -= 1
                moved = True
        if not moved:  # unreachable for a deadlock-free schedule; kept as a guard
            raise RuntimeError(f"simulation of {schedule.name!r} made no progress")
    return Simulation(
        step_time=max(clock) if clock else 0.0,
        busy=tuple(busy),
        peak_inflight=tuple(peak),
        finish=tuple(clock),
        timeline=tuple(spans),
        peak_full=tuple(peak_full),
    )


def steady_state(
    schedule: Schedule,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    transfer: float | Sequence[float] = 0.0,
    optimizer_step: float | Sequence[float] = 0.0,
    calls: int = 8,
) -> tuple[float, float]:
    """(time per train_step, bubble fraction) of an asynchronous schedule in the steady state:
    the growth of the unflushed run's time from ``calls - 1`` to ``calls`` train_steps, and the
    share of that time each rank spends outside forward and backward work (optimizer updates
    count as bubble). With uniform stages, no transfer and free updates the bubble is zero."""
    if not schedule.asynchronous:
        raise ValueError(f"{schedule.name!r} is synchronous: simulate() gives its step time")
    before, after = (
        simulate(schedule, forward, backward, transfer, optimizer_step, calls=n, flush=False)
        for n in (calls - 1, calls)
    )
    call_time = after.step_time - before.step_time
    busy = sum(a - b for a, b in zip(after.busy, before.busy, strict=True))
    return call_time, (1.0 - busy / (schedule.ranks * call_time) if call_time else 0.0)
