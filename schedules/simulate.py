"""Time a schedule from per-stage costs: step time, bubble fraction, activation memory.

The model is the runtime's: a rank runs its actions in order, one at a time; a send leaves as
soon as the compute that produced its tensor ends; a receive waits until the message has crossed
its link (``transfer`` seconds after it left). Besides its own cost every action takes
``overhead`` seconds of its rank's time (the runtime's bookkeeping: posting messages, picking the
next action; zero by default), which is neither compute nor waiting. A hand-off between two
stages on the same rank is no message and costs nothing: the list order already puts the
producer first. Ranks may share processors (``cores``): while more ranks run than there are
cores, each runs proportionally slower (processor sharing), as stage processes do on a CPU with
fewer cores than ranks; ranks pinned to separate processors share only within their group. A
message may also cost processor time (``copy``): on one host a message is a memory copy out of
the sender and one into the receiver, done by their transport threads alongside compute, so on
shared cores the copies slow compute down and compute slows them. Ranks may enter the step at
different times (``start``), as they leave a barrier or their previous step one by one. Single
actions may take their own time (``durations``) instead of their stage's cost, as when a traced
step's action times are drawn from each stage's measured spread.

Memory is counted in micro-batches per rank (a micro-batch on a stage counts once; with several
stages on a rank, each counts separately). A forward stores a micro-batch's activations. Without
W actions its B frees them. With W, B (input gradient) frees all but what W needs, and W frees
the rest (Qi et al. 2023, Table 1), so two counts are kept: ``peak_inflight`` counts micro-batches
forwarded whose activations are not all freed yet (not yet W'd; not yet B'd without W) and is
the safe bound; ``peak_full`` counts those still holding all their activations (not yet B'd).
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

from schedules.action import COMPUTE, RECVS, SENDS, TIMED, Action, Kind, Schedule
from schedules.asynchronous import unroll
from schedules.timeline import Span
from schedules.validate import validate

Cores = int | Mapping[tuple[int, ...], int] | None
"""Who shares processors: None, each rank has its own; n, all ranks share n; a mapping, each
group of ranks (a tuple of ranks) shares that many processors and ranks in no group have
their own (ranks pinned to processors, pipetrain.runtime.distributed.pin_to_cores)."""


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
    reduce: float | Sequence[float] = 0.0,
    agree: float | Sequence[float] = 0.0,
) -> dict[Kind, list[float]]:
    """Per-stage cost of each timed kind. ``backward`` + ``weight`` is a stage's whole
    backward: a schedule with W spends them in B and W; one without spends their sum in B
    (except where it lists an early W: see :meth:`_Run._cost`)."""
    p = schedule.stages
    fwd = _per_stage(forward, p, "forward")
    bwd = _per_stage(backward, p, "backward")
    step = _per_stage(optimizer_step, p, "optimizer_step")
    sums = _per_stage(reduce, p, "reduce")
    agreement = _per_stage(agree, p, "agree")
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
    return {
        Kind.FORWARD: fwd, Kind.BACKWARD: bwd, Kind.WEIGHT: wgt, Kind.STEP: step,
        Kind.REDUCE: sums, Kind.AGREE: agreement,
    }


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
    cores: Cores = None,
    copy: float | Sequence[float] = 0.0,
    start: float | Sequence[float] = 0.0,
    durations: Mapping[Action, float] | None = None,
    calls: int = 1,
    flush: bool = True,
    reduce: float | Sequence[float] = 0.0,
    agree: float | Sequence[float] = 0.0,
    validated: bool = False,
) -> Simulation:
    """Simulate one mini-batch. ``forward``/``backward``/``weight``/``optimizer_step`` are
    per-stage times for one micro-batch (a scalar applies to every stage); ``transfer`` is the
    time one message takes across the boundary from stage s to s+1, per boundary (stages-1
    values; ignored where both stages share a rank) or one scalar.

    ``overhead`` is the runtime's own time per action, per rank (a scalar for every rank).

    ``weight`` is the W (weight-gradient) time, required for schedules with W actions, where
    ``backward`` is the B (input-gradient) time. For a schedule without W it may still be given
    (B then costs backward + weight), so that one set of costs times both kinds of schedule.

    ``cores``: the ranks share that many processors (None: each rank has its own). While k
    ranks run (compute, step or overhead; a rank waiting for a message needs no processor),
    each runs at min(1, cores / k) of full speed: processor sharing, as when more stage
    processes than cores share a CPU. The costs are then full-speed times. A mapping
    ``{(0, 2): 1, (1, 3): 1}`` shares per group instead: ranks 0 and 2 share one processor,
    ranks 1 and 3 another (four ranks pinned round robin to two cores).

    ``copy``: per boundary (or one scalar), the processor time each end of a message spends
    copying it, sender and receiver at once (a transfer over loopback TCP). The message leaves
    when both copies are done, then takes ``transfer`` more. Without ``cores`` this only delays
    it; with ``cores`` the two copies are running work like compute and share the processors
    (the sender's copy those of the sender, the receiver's copy those of the receiver).

    ``start``: when each rank enters the step (a scalar for every rank; all at 0 by default).

    ``durations``: the time of single compute or step actions (full-speed seconds, like the
    costs), overriding their stage's cost; the others keep it. A measured step's actions vary
    around their stage's mean (on shared cores by a third to a half of it), and the step
    follows its slow ones, which the mean hides; times drawn from that spread keep them.

    An asynchronous schedule is simulated over ``calls`` consecutive train_steps followed by
    the flush (unless ``flush=False``), as ``schedules.asynchronous.unroll`` writes them; its
    steady-state cost per train_step is ``steady_state``'s.

    ``reduce`` and ``agree``: per stage, the time of its REDUCE (gradients summed across
    replicas and tied stages) and of the AGREE its rank's lowest stage names (the step's
    agreement), 0 by default. Neither takes the per-action ``overhead``, and AGREE's wait for
    the other ranks is not modelled: each rank's step time is its own work's.

    ``validated=True``: the caller has validated ``schedule`` already (one kept validated, as
    ``partitioner.costs.pipeline_schedule`` keeps them), so it is not checked again.
    """
    if not validated:
        validate(schedule)
    if schedule.asynchronous:
        schedule = unroll(schedule, calls, flush)
    costs = _compute_costs(schedule, forward, backward, weight, optimizer_step, reduce, agree)
    return _Run(schedule, costs, _per_stage(backward, schedule.stages, "backward"), transfer,
                overhead, cores, copy, start, durations or {}).result()


@dataclass
class _Pool:
    """Processors that some threads share: while k of them run, each runs at
    min(1, capacity / k) of full speed. Work is counted in full-speed seconds on a virtual clock
    that runs at that speed, so every running piece advances alike and they end in the order of
    their virtual end times. An unlimited pool (math.inf) always runs at full speed; its virtual
    clock is the clock, to the last bit."""

    capacity: float
    threads: int = 0
    virtual: float = 0.0
    running: list[tuple[float, int, int | tuple[Action, int]]] = field(default_factory=list)

    @property
    def unlimited(self) -> bool:
        return self.capacity == math.inf

    def speed(self) -> float:
        return min(1.0, self.capacity / max(self.threads, 1))

    def start(self, work: float, order: int, key: int | tuple[Action, int]) -> None:
        self.threads += 1
        heapq.heappush(self.running, (self.virtual + work, order, key))

    def next_end(self, now: float) -> float:
        """When its first running piece ends at the current speed (inf: none runs)."""
        if not self.running:
            return math.inf
        if self.unlimited:
            return self.running[0][0]
        return now + (self.running[0][0] - self.virtual) / self.speed()

    def advance(self, now: float, to: float) -> list[tuple[int, int | tuple[Action, int]]]:
        """Run from ``now`` to ``to``; return the pieces that ended, as (order, key)."""
        if self.unlimited:
            self.virtual = to
        elif self.running and self.next_end(now) <= to:
            self.virtual = self.running[0][0]
        else:
            self.virtual += (to - now) * self.speed()
        ended = []
        while self.running and self.running[0][0] <= self.virtual:
            _, order, key = heapq.heappop(self.running)
            self.threads -= 1
            ended.append((order, key))
        return ended


def _durations(schedule: Schedule, durations: Mapping[Action, float]) -> dict[Action, float]:
    """``durations`` checked against the schedule: its timed actions, none negative."""
    timed = {a for ops in schedule.actions.values() for a in ops if a.kind in TIMED}
    for a, seconds in durations.items():
        if a not in timed:
            raise ValueError(
                f"durations: {a} is no compute or step action of {schedule.name!r}; give times "
                "only for the actions the schedule runs (a trace of another schedule?)"
            )
        if seconds < 0:
            raise ValueError(f"durations: {a} takes {seconds} s; durations must be at least 0")
    return {a: float(seconds) for a, seconds in durations.items()}


def _pools(cores: Cores, ranks: int) -> list[_Pool]:
    """Each rank's pool: ranks sharing processors share the object, and ranks with their own
    processors share one unlimited pool (full speed whatever runs)."""
    own = _Pool(math.inf)
    if cores is None:
        return [own] * ranks
    if isinstance(cores, numbers.Integral):
        if cores < 1:
            raise ValueError(f"cores must be at least 1, got {cores}")
        return [_Pool(float(cores))] * ranks
    pools: list[_Pool | None] = [None] * ranks
    for group, count in cast(Mapping[tuple[int, ...], int], cores).items():
        if count < 1:
            raise ValueError(f"cores must be at least 1, got {count} for ranks {group}")
        pool = _Pool(float(count))
        for r in group:
            if not 0 <= r < ranks or pools[r] is not None:
                raise ValueError(
                    f"cores: rank {r} of group {group} is not one of ranks 0..{ranks - 1} or is "
                    "in two groups; give each rank at most one group"
                )
            pools[r] = pool
    return [pool or own for pool in pools]


class _Run:
    """The event-driven simulation behind ``simulate``. A rank is free (taking its next
    action), waiting for a message or its start, or running a piece of work in its pool of
    processors (:class:`_Pool`): a compute or step action, or its overhead after an action. A
    message being copied is two pieces of work, its sender's copy and its receiver's, each in
    its own rank's pool; it leaves when both are done."""

    def __init__(  # type: ignore[no-untyped-def]
        self, schedule: Schedule, cost: dict[Kind, list[float]], input_only: list[float],
        transfer, overhead, cores: Cores, copy, start, durations: Mapping[Action, float],
    ):
        self.schedule = schedule
        self.cost, self.input_only = cost, input_only  # input_only: B when its W is listed
        self.early = schedule.early_weights
        self.durations = _durations(schedule, durations)
        ranks = schedule.ranks
        self.link = _per_stage(transfer, max(schedule.stages - 1, 0), "transfer")
        copies = _per_stage(copy, max(schedule.stages - 1, 0), "copy")
        self.extra = _per_stage(overhead, ranks, "overhead")
        self.start = _per_stage(start, ranks, "start")
        if min(self.start, default=0.0) < 0:
            raise ValueError(f"start times must be at least 0, got {self.start}")
        self.pool = _pools(cores, ranks)
        self.pools = list({id(pool): pool for pool in self.pool}.values())
        self.now = 0.0
        self.cursor = [0] * ranks
        self.free_since = list(self.start)  # when the rank last became free (a wait starts there)
        self.in_overhead = [False] * ranks  # the running piece is the overhead of the action
        self.started = [0.0] * ranks
        self.order = itertools.count(ranks)  # ties: ranks first, then copies in order
        self.copying: dict[Action, list[float]] = {}  # receive -> [copies left, transfer after]
        self.waiting: dict[Action, int] = {}  # receive -> the rank blocked on it
        # heap: (time, tie-break, a receive whose message lands or a rank that enters the step)
        self.arrivals: list[tuple[float, int, Action | int]] = []
        self.arrival: dict[Action, float] = {}
        # compute -> its messages: (receive, transfer, copy)
        self.sends: dict[Action, list[tuple[Action, float, float]]] = {}
        for ops in schedule.actions.values():
            for a in ops:
                if a.kind in SENDS:
                    source = Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD
                    boundary = min(a.stage, a.peer or 0)
                    self.sends.setdefault(Action(source, a.stage, a.microbatch), []).append(
                        (a.matching(), self.link[boundary], copies[boundary])
                    )
        self.busy = [0.0] * ranks
        self.held, self.full = [0] * ranks, [0] * ranks
        self.peak, self.peak_full = [0] * ranks, [0] * ranks
        self.spans: list[Span] = []

    def result(self) -> Simulation:
        ready = []
        for r, at in enumerate(self.start):
            if at > 0:
                heapq.heappush(self.arrivals, (at, -1 - r, r))
            else:
                ready.append(r)
        while True:
            for r in ready:
                self._advance(r)
            if not self._running() and not self.arrivals:
                break
            ready = self._next_event()
        if any(c < len(self.schedule.actions[r]) for r, c in enumerate(self.cursor)):
            raise RuntimeError(f"simulation of {self.schedule.name!r} made no progress")
        finish = tuple(self.free_since)
        return Simulation(
            step_time=max(finish, default=0.0), busy=tuple(self.busy),
            peak_inflight=tuple(self.peak), finish=finish, timeline=tuple(self.spans),
            peak_full=tuple(self.peak_full),
        )

    def _running(self) -> bool:
        return any(pool.running for pool in self.pools)

    def _span(self, action: Action, start: float, r: int) -> None:
        self.spans.append(
            Span(action, start, self.now, None if self.schedule.one_stage_per_rank else r)
        )

    def _run(self, r: int, work: float, overhead: bool) -> bool:
        """Start a piece of ``work`` full-speed seconds on rank r; False if it takes none."""
        if work <= 0:
            return False
        self.in_overhead[r], self.started[r] = overhead, self.now
        self.pool[r].start(work, r, r)
        return True

    def _split(self, a: Action) -> bool:
        """Whether B ``a`` computes input gradients only (a W of its own is listed)."""
        return self.schedule.splits_backward or self.early.get(a.stage) == a.microbatch

    def _cost(self, a: Action) -> float:
        """Full-speed seconds of compute or step action ``a``: an early W's B costs
        ``backward`` alone, the W ``weight``."""
        if a.kind is Kind.BACKWARD and self.early.get(a.stage) == a.microbatch:
            return self.durations.get(a, self.input_only[a.stage])
        return self.durations.get(a, self.cost[a.kind][a.stage])

    def _overhead(self, r: int, a: Action) -> float:
        """The runtime's own time after action ``a`` (none after REDUCE and AGREE)."""
        return 0.0 if a.kind in (Kind.REDUCE, Kind.AGREE) else self.extra[r]

    def _post(self, receive: Action, hop: float) -> None:
        """The message for ``receive`` leaves now and lands ``hop`` later."""
        self.arrival[receive] = self.now + hop
        heapq.heappush(self.arrivals, (self.now + hop, len(self.arrival), receive))

    def _advance(self, r: int) -> None:
        """Take rank r's actions that need no time, until it runs a piece of work, waits for
        a message or is done."""
        ops = self.schedule.actions[r]
        while self.cursor[r] < len(ops):
            a = ops[self.cursor[r]]
            if a.kind in RECVS:
                if self.arrival.get(a, math.inf) > self.now:
                    self.waiting[a] = r
                    return
                self._span(a, self.free_since[r], r)
            elif a.kind in SENDS:
                pass  # posted when its compute ended (see _done), as the runtime does
            elif self._run(r, self._cost(a), overhead=False):
                return
            else:
                self._done(r, a)
            if self._run(r, self._overhead(r, a), overhead=True):
                return
            self.cursor[r] += 1
            self.free_since[r] = self.now

    def _done(self, r: int, a: Action) -> None:
        """Compute or step action ``a`` of rank r ends now."""
        cost = self._cost(a)
        self._span(a, self.started[r] if cost > 0 else self.now, r)
        if a.kind in COMPUTE:  # at full speed it took its cost (to the last bit)
            self.busy[r] += cost if self.pool[r].unlimited else self.spans[-1].duration
        for receive, hop, copy in self.sends.get(a, ()):
            if copy <= 0:
                self._post(receive, hop)
                continue
            self.copying[receive] = [2, hop]
            for side in (r, self.schedule.rank_of(receive.stage)):
                self.pool[side].start(copy, next(self.order), (receive, side))
        memory = _MEMORY_SPLIT if a.kind is not Kind.BACKWARD or self._split(a) else _MEMORY_WHOLE
        d_held, d_full = memory.get(a.kind, (0, 0))
        self.held[r] += d_held
        self.full[r] += d_full
        self.peak[r] = max(self.peak[r], self.held[r])
        self.peak_full[r] = max(self.peak_full[r], self.full[r])

    def _next_event(self) -> list[int]:
        """Move the clock to the next end of a piece of work, arrival of a message or entry of
        a rank; return the ranks that are free again."""
        ends = min((pool.next_end(self.now) for pool in self.pools), default=math.inf)
        lands = self.arrivals[0][0] if self.arrivals else math.inf
        to = min(ends, lands)
        ended = sorted(piece for pool in self.pools for piece in pool.advance(self.now, to))
        self.now = to
        ready = []
        for _, key in ended:
            if isinstance(key, tuple):  # one copy of a message is done
                receive = key[0]
                left = self.copying[receive]
                left[0] -= 1
                if left[0] == 0:
                    del self.copying[receive]
                    self._post(receive, left[1])
                continue
            r = key
            a = self.schedule.actions[r][self.cursor[r]]
            if not self.in_overhead[r]:
                self._done(r, a)
                if self._run(r, self._overhead(r, a), overhead=True):
                    continue
            self.cursor[r] += 1
            self.free_since[r] = self.now
            ready.append(r)
        while self.arrivals and self.arrivals[0][0] <= self.now:
            _, _, item = heapq.heappop(self.arrivals)
            if isinstance(item, int):  # the rank enters the step
                ready.append(item)
            elif item in self.waiting:
                ready.append(self.waiting.pop(item))
        return ready


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
