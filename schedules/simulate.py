"""Time a schedule from per-stage costs: step time, bubble fraction, activation memory.

The model is the runtime's: a stage runs its actions in order; a send costs the sender nothing and
leaves as soon as the compute that produced its tensor ends; a receive waits until the message
has crossed its link (``transfer`` seconds after it left).
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

from schedules.action import Action, Kind, Schedule
from schedules.timeline import Span
from schedules.validate import validate


@dataclass(frozen=True)
class Simulation:
    """What a schedule costs: times in the units of the inputs."""

    step_time: float
    busy: tuple[float, ...]  # compute time of each stage
    peak_inflight: tuple[int, ...]  # most micro-batches whose activations a stage holds at once
    finish: tuple[float, ...]  # when each stage's last action ends
    timeline: tuple[Span, ...] = ()  # every compute, step and receive wait, as it would run

    @property
    def bubble_fraction(self) -> float:
        """Share of stage-time not spent on forward or backward work (optimizer steps count
        as bubble): 1 - sum(busy) / (stages * step_time)."""
        if self.step_time == 0:
            return 0.0
        return 1.0 - sum(self.busy) / (len(self.busy) * self.step_time)

    def stage_bubble(self, stage: int) -> float:
        """Share of the step that ``stage`` spends outside forward and backward work."""
        return 1.0 - self.busy[stage] / self.step_time if self.step_time else 0.0


def _per_stage(value: float | Sequence[float], n: int, what: str) -> list[float]:
    if isinstance(value, numbers.Real):
        return [float(value)] * n
    values = [float(v) for v in cast(Sequence[float], value)]
    if len(values) != n:
        raise ValueError(f"{what} needs {n} values (one per stage or link), got {len(values)}")
    return values


def simulate(
    schedule: Schedule,
    forward: float | Sequence[float],
    backward: float | Sequence[float],
    transfer: float | Sequence[float] = 0.0,
    optimizer_step: float | Sequence[float] = 0.0,
) -> Simulation:
    """Simulate one mini-batch. ``forward``/``backward``/``optimizer_step`` are per-stage times
    for one micro-batch (a scalar applies to every stage); ``transfer`` is the time one message
    takes across the link from stage s to s+1, per link (p-1 values) or one scalar."""
    p = schedule.stages
    fwd = _per_stage(forward, p, "forward")
    bwd = _per_stage(backward, p, "backward")
    step = _per_stage(optimizer_step, p, "optimizer_step")
    link = _per_stage(transfer, max(p - 1, 0), "transfer")
    validate(schedule)

    clock = [0.0] * p
    cursor = [0] * p
    produced: dict[Action, float] = {}  # compute action -> end time
    arrival: dict[Action, float] = {}  # receive action -> when its message is there
    inflight = [0] * p
    peak = [0] * p
    busy = [0.0] * p
    spans: list[Span] = []
    pending = sum(len(v) for v in schedule.actions.values())
    while pending:
        moved = False
        for s in range(p):
            ops = schedule.actions[s]
            while cursor[s] < len(ops):
                a = ops[cursor[s]]
                if a.kind in (Kind.RECV_ACT, Kind.RECV_GRAD):
                    if a not in arrival:
                        break
                    spans.append(Span(a, clock[s], max(clock[s], arrival[a])))
                    clock[s] = spans[-1].end
                elif a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                    source = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
                    hop = link[min(s, a.peer or 0)]
                    arrival[a.matching()] = produced[Action(source, s, a.microbatch)] + hop
                else:
                    cost = {Kind.FORWARD: fwd, Kind.BACKWARD: bwd, Kind.STEP: step}[a.kind][s]
                    spans.append(Span(a, clock[s], clock[s] + cost))
                    clock[s] += cost
                    busy[s] += cost if a.kind is not Kind.STEP else 0.0
                    produced[a] = clock[s]
                    inflight[s] += {Kind.FORWARD: 1, Kind.BACKWARD: -1}.get(a.kind, 0)
                    peak[s] = max(peak[s], inflight[s])
                cursor[s] += 1
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
    )
