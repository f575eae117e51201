"""Exact split of L layers into S contiguous stages that minimises the bottleneck stage.

The recurrence, in the style of PipeDream's optimizer: with ``A[t][j][d]`` the best bottleneck
of layers [0, j) cut into stages 0..t that use d devices,

    A[-1][0][0] = 0
    A[t][j][d]  = min over i < j, r >= 1, memory_t(i, j) <= cap_t, cut j allowed of
                  max(A[t-1][i][d - r], cost_t(i, j, r))
    answer      = min over d <= D of A[S-1][L][d]

with ``cost_t`` and ``memory_t`` from :mod:`partitioner.costs` (stage compute on r replicas, its
outgoing link, its memory with the schedule's micro-batches in flight). Without replication
(D = S) r is always 1 and d = t + 1.

It is evaluated as its decision form: "is there a split whose stages all cost <= T?" is one
vectorised sweep over the stages, where stage t can end at j iff some reachable start i lies in
[lo_T(j), j) (compute is a prefix-sum difference, so the starts cheap enough form a window) and
the window holds an i with memory_t(i, j) = H_t[j] + g_t[i] <= cap (a range minimum of g over the
reachable starts, by a sparse table). A[S-1][L] is the smallest T whose answer is yes, found by
bisection to 2^-20 relative, then exactly among the stage and link costs left in that
interval. Ties break toward the smaller peak memory: a second search finds the least memory cap
(integer bytes) that still reaches that bottleneck. Cost per probe: O(S L log L) numpy work,
O(S D^2 L log L) with replication; about 60 probes in all.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import numpy as np

from partitioner.costs import (
    Problem,
    StageCost,
    compute_prefix,
    evaluate,
    held_weight_bytes,
    link_time,
    make_problem,
    memory_terms,
)
from partitioner.errors import InfeasibleError
from partitioner.units import format_bytes

_BIG = np.int64(2**62)  # "no reachable start" in the range-minimum table
_CAP_CEILING = 2**61  # caps above this (2 EiB) change nothing and keep H + _BIG > cap
_NARROW = 2.0**-20  # bisect the bottleneck to this relative width, then list what is inside
_MAX_CANDIDATES = 1 << 22
_FEW_CANDIDATES = 1 << 14  # this few costs in the first interval are searched without bisecting

_T = TypeVar("_T")
States = list[dict[int, np.ndarray]]  # per stage boundary: devices used -> reachable positions


@dataclass(frozen=True)
class Split:
    """A split of the layers into stages and what it costs."""

    bounds: tuple[int, ...]  # stage t holds layers [bounds[t], bounds[t + 1])
    replicas: tuple[int, ...]
    bottleneck: float  # seconds per micro-batch of the slowest stage or link
    peak_memory: int  # bytes on the fullest device
    stages: tuple[StageCost, ...]

    @property
    def balance(self) -> list[int]:
        """Layers per stage."""
        return [b - a for a, b in zip(self.bounds, self.bounds[1:], strict=False)]

    @property
    def recompute(self) -> list[bool]:
        """Per stage, whether it recomputes its forward in backward."""
        return [stage.recompute for stage in self.stages]


def split_of(problem: Problem, bounds: Sequence[int], replicas: Sequence[int]) -> Split:
    """Evaluate a given split (used by every solver, so they report alike)."""
    stages = evaluate(problem, bounds, replicas)
    return Split(
        bounds=tuple(bounds),
        replicas=tuple(replicas),
        bottleneck=max(s.cost for s in stages),
        peak_memory=max(s.memory for s in stages),
        stages=tuple(stages),
    )


class _Window:
    """For one prefix Q and limit T: lo[j] = first i with Q[j] - Q[i] <= T, and the two
    sparse-table cells whose minimum covers [lo[j], j)."""

    def __init__(self, prefix: np.ndarray, limit: float, floor_log2: np.ndarray) -> None:
        pos = np.arange(len(prefix))
        lo = np.minimum(np.searchsorted(prefix, prefix - limit, side="left"), pos)
        while True:  # searchsorted worked on Q[j] - T; make it exact for Q[j] - Q[i] <= T
            down = (lo > 0) & (prefix - prefix[np.maximum(lo - 1, 0)] <= limit)
            if not down.any():
                break
            lo = lo - down
        while True:
            up = (lo < pos) & (prefix - prefix[lo] > limit)
            if not up.any():
                break
            lo = lo + up
        width = pos - lo
        self.lo = lo
        self.nonempty = width > 0
        level = floor_log2[width]
        right = np.where(self.nonempty, pos - (1 << level), 0)
        n = len(prefix)
        self.left_cell = level * n + lo  # flat indices into a (levels, n) sparse table
        self.right_cell = level * n + right
        self.top = int(level.max())


def _merge(reached: dict[int, np.ndarray], used: int, ok: np.ndarray) -> None:
    """Record positions reachable with ``used`` devices."""
    if ok.any():
        reached[used] = reached[used] | ok if used in reached else ok


class _Sweep:
    """The decision procedure: which positions each stage can reach under limits (T, M).

    Under ``checkpoint="auto"`` each stage may keep its activations or recompute them; a stage
    reaches a position if either mode does, since each stage's time and memory are its own."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        layers, stages = problem.layers, problem.stages
        self.floor_log2 = np.zeros(layers + 2, dtype=np.int64)
        self.floor_log2[1:] = np.floor(np.log2(np.arange(1, layers + 2))).astype(np.int64)
        # by (stage, mode, replicas): replicas divide what problem.zero shards
        self.memory: dict[tuple[int, bool, int], tuple[np.ndarray, np.ndarray]] = {}
        # the most memory any single stage t could need (on one replica, which divides
        # nothing): a cap at or above it never binds
        self.worst = {
            (t, mode): int((head[1:] + np.maximum.accumulate(tail[:-1])).max())
            for t, mode in itertools.product(range(stages), problem.modes)
            for head, tail in [self._memory(t, mode, 1)]
        }
        self.links = [link_time(problem, t) for t in range(stages)]
        self.prefix: dict[tuple[float, int, bool], np.ndarray] = {}
        pos = np.arange(layers + 1)
        self.ends = []
        for t in range(stages):
            end = problem.allowed & (pos >= t + 1) & (pos <= layers - (stages - 1 - t))
            if t == stages - 1:
                end = pos == layers
            self.ends.append(end)
        self.start = np.zeros(layers + 1, dtype=bool)
        self.start[0] = True
        self.buffer = np.empty((int(self.floor_log2[layers + 1]) + 1, layers + 1), dtype=np.int64)
        # what the last probed time's probes share: its windows and each stage's ends
        self.at_time = math.nan
        self.at_windows: dict[tuple[float, int, bool], _Window] = {}
        self.at_ends: dict[int, np.ndarray] = {}

    def _prefix(self, stage: int, replicas: int, recompute: bool) -> np.ndarray:
        key = (self.problem.speed[stage], replicas, recompute)
        if key not in self.prefix:
            self.prefix[key] = compute_prefix(self.problem, stage, replicas, recompute)
        return self.prefix[key]

    def _memory(self, stage: int, recompute: bool, replicas: int) -> tuple[np.ndarray, np.ndarray]:
        """memory_terms of ``stage`` on ``replicas`` replicas (one pair for every replica
        count when nothing is sharded; stages of one in-flight count share it)."""
        key = (self.problem.inflight[stage], recompute, replicas if self.problem.zero else 1)
        if key not in self.memory:
            self.memory[key] = memory_terms(self.problem, stage, recompute, key[2])
        return self.memory[key]

    def _cap(self, stage: int, limit: int | None, device_caps: bool) -> int | None:
        device_cap = self.problem.memory[stage] if device_caps else None
        caps = [c for c in (limit, device_cap) if c is not None]
        return min(*caps, _CAP_CEILING) if caps else None

    def probe(self, time: float, memory: int | None, device_caps: bool = True) -> States | None:
        """Reachable positions per stage boundary if some split has every stage cost <= time
        and memory <= min(memory, the device's cap), else None."""
        problem = self.problem
        if time != self.at_time:  # the memory search probes one time many times
            self.at_time, self.at_windows, self.at_ends = time, {}, {}
        windows = self.at_windows
        states: States = [{0: self.start}]
        for t in range(problem.stages):
            end = self.at_ends.get(t)
            if end is None:
                end = self.at_ends[t] = self.ends[t] if t == problem.stages - 1 else (
                    self.ends[t] & (self.links[t] <= time))
            reached: dict[int, np.ndarray] = {}
            for mode in problem.modes:
                key = (t, mode)
                cap = self._cap(t, memory, device_caps)
                if cap is not None and cap >= self.worst[key]:
                    cap = None
                options = [
                    self._windows(windows, t, r, mode, time)
                    for r in range(1, problem.devices - problem.stages + 2)
                ]
                self._advance(
                    states[-1], t, end, partial(self._memory, t, mode), cap, options, reached
                )
            if not reached:
                return None
            states.append(reached)
        return states

    def _windows(
        self, windows: dict[tuple[float, int, bool], _Window], stage: int, replicas: int,
        recompute: bool, time: float,
    ) -> _Window:
        """The window of starts cheap enough for ``stage`` on ``replicas`` (cached per time)."""
        key = (self.problem.speed[stage], replicas, recompute)
        if key not in windows:
            windows[key] = _Window(self._prefix(stage, replicas, recompute), time, self.floor_log2)
        return windows[key]

    def _advance(
        self, before: dict[int, np.ndarray], stage: int, end: np.ndarray,
        memory: Callable[[int], tuple[np.ndarray, np.ndarray]], cap: int | None,
        options: list[_Window], reached: dict[int, np.ndarray],
    ) -> None:
        """Merge into ``reached`` the positions ``stage`` can end at from the positions
        ``before`` reached, with ``options[r - 1]`` its window and ``memory(r)`` its
        memory_terms on r replicas."""
        for used, here in before.items():
            most = self.problem.devices - used - (self.problem.stages - 1 - stage)
            if cap is None:
                count = np.concatenate(([0], np.cumsum(here)))
                for r, window in enumerate(options[:most], 1):
                    _merge(reached, used + r, end & (count[:-1] > count[window.lo]))
                continue
            top = max(window.top for window in options[:most])
            built = None
            for r, window in enumerate(options[:most], 1):
                head, tail = memory(r)
                if built is not tail:  # a new table only where replicas divide the weights
                    table, built = self._table(np.where(here, tail, _BIG), top), tail
                least = np.minimum(table.take(window.left_cell), table.take(window.right_cell))
                ok = head + least <= cap  # _BIG (no reachable start) never fits
                ok &= window.nonempty
                ok &= end
                _merge(reached, used + r, ok)

    def _table(self, values: np.ndarray, top: int) -> np.ndarray:
        """Sparse table: row k, column i holds min(values[i : i + 2**k]) for i <= n - 2**k
        (the rest of a row is stale and never read)."""
        n = len(values)
        table = self.buffer
        table[0] = values
        for k in range(1, top + 1):
            half, span = 1 << (k - 1), n - (1 << k) + 1
            np.minimum(table[k - 1, :span], table[k - 1, half : half + span], out=table[k, :span])
        return table

    def costs_between(self, lo: float, hi: float, most: int = _MAX_CANDIDATES) -> np.ndarray | None:
        """Every stage or link cost in (lo, hi], sorted and distinct; None if there are more
        than ``most``."""
        problem = self.problem
        found = [link[(link > lo) & (link <= hi)] for link in self.links[:-1]]
        pos = np.arange(problem.layers + 1)
        listed = 0
        stage_of_speed = {problem.speed[t]: t for t in range(problem.stages)}
        for t, r, mode in itertools.product(
            stage_of_speed.values(), range(1, problem.devices - problem.stages + 2), problem.modes
        ):
            prefix = self._prefix(t, r, mode)
            # starts i with lo < prefix[j] - prefix[i] <= hi, widened by one for rounding
            first = np.maximum(np.searchsorted(prefix, prefix - hi, side="left") - 1, 0)
            stop = np.minimum(np.searchsorted(prefix, prefix - lo, side="left") + 1, pos)
            counts = np.maximum(stop - first, 0)
            listed += int(counts.sum())
            if listed > most:
                return None
            ends = np.repeat(pos, counts)
            offsets = np.arange(len(ends)) - np.repeat(np.cumsum(counts) - counts, counts)
            values = prefix[ends] - prefix[np.repeat(first, counts) + offsets]
            found.append(values[(values > lo) & (values <= hi)])
        return np.unique(np.concatenate(found))

    def memories_between(self, time: float, lo: int, hi: int) -> np.ndarray | None:
        """Every memory in (lo, hi] of a stage whose compute fits ``time``, sorted and
        distinct: the least cap at which a split has every stage cost <= ``time`` is the
        memory of one of its stages, so it is among them. None if there are more than
        _MAX_CANDIDATES stages to list."""
        problem = self.problem
        pos = np.arange(problem.layers + 1)
        found, listed = [], 0
        alike = {(problem.inflight[t], problem.speed[t]): t for t in range(problem.stages)}
        for t, r, mode in itertools.product(
            alike.values(), range(1, problem.devices - problem.stages + 2), problem.modes
        ):
            first = _Window(self._prefix(t, r, mode), time, self.floor_log2).lo
            counts = pos - first  # the starts first[j] .. j - 1 of a stage ending at j
            listed += int(counts.sum())
            if listed > _MAX_CANDIDATES:
                return None
            ends = np.repeat(pos, counts)
            offsets = np.arange(len(ends)) - np.repeat(np.cumsum(counts) - counts, counts)
            head, tail = self._memory(t, mode, r)
            values = head[ends] + tail[np.repeat(first, counts) + offsets]
            found.append(values[(values > lo) & (values <= hi)])
        return np.unique(np.concatenate(found))

    def trace(
        self, states: States, time: float, memory: int | None, device_caps: bool = True
    ) -> Split:
        """A split behind a successful probe, read back from the last stage to the first."""
        problem = self.problem
        j = problem.layers
        used = min(d for d, here in states[-1].items() if here[j])
        bounds, replicas = [j], []
        for t in range(problem.stages - 1, -1, -1):
            cap = self._cap(t, memory, device_caps)
            for r, mode in itertools.product(range(1, used + 1), problem.modes):
                here = states[t].get(used - r)
                if here is None:
                    continue
                head, tail = self._memory(t, mode, r)
                prefix = self._prefix(t, r, mode)
                starts = np.arange(j)
                ok = here[:j] & (prefix[j] - prefix[:j] <= time)
                if cap is not None:
                    ok &= head[j] + tail[:j] <= cap
                if ok.any():
                    j, used = int(starts[ok][-1]), used - r
                    bounds.append(j)
                    replicas.append(r)
                    break
            else:  # unreachable after a successful probe
                raise RuntimeError("could not trace the split back")
        return split_of(problem, bounds[::-1], replicas[::-1])


def _float_bits(x: float) -> int:
    return int(np.float64(x).view(np.int64))


def _bits_float(b: int) -> float:
    return float(np.int64(b).view(np.float64))


def _least_float(feasible: Callable[[float], bool], lo: float, hi: float) -> float:
    """Smallest float in (lo, hi] that is feasible, given feasible(hi) and not feasible(lo)."""
    a, b = _float_bits(lo), _float_bits(hi)
    while b - a > 1:
        mid = (a + b) // 2
        if feasible(_bits_float(mid)):
            b = mid
        else:
            a = mid
    return _bits_float(b)


def _least_int(feasible: Callable[[int], bool], lo: int, hi: int) -> int:
    """Smallest integer in (lo, hi] that is feasible, given feasible(hi) and not feasible(lo)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if feasible(mid):
            hi = mid
        else:
            lo = mid
    return hi


def _memory_floor(problem: Problem) -> int:
    """A lower bound on any split's peak memory: the weights spread evenly, or the heaviest
    layer's weights (divided by the most replicas a stage can have, where sharded)."""
    weights = held_weight_bytes(problem, problem.devices - problem.stages + 1)
    spread = problem.devices if problem.zero else problem.stages
    return max(int(weights.sum()) // spread, int(weights.max()))


def smallest_cap(problem: Problem) -> int:
    """The least memory cap (bytes, the same on every device) at which any split fits,
    ignoring time."""
    sweep = _Sweep(problem)
    states = sweep.probe(math.inf, None, device_caps=False)
    if states is None:
        raise _structure_error(problem)
    hi = sweep.trace(states, math.inf, None, device_caps=False).peak_memory
    return _least_int(
        lambda m: sweep.probe(math.inf, m, device_caps=False) is not None,
        _memory_floor(problem) - 1,
        hi,
    )


def _structure_error(problem: Problem) -> InfeasibleError:
    cuts = int(problem.allowed[1:-1].sum())
    return InfeasibleError(
        f"cannot split {problem.layers} layers into {problem.stages} stages: a stage needs at "
        f"least one layer and only {cuts} cut points are allowed; use at most {cuts + 1} stages"
    )


def _least_time(sweep: _Sweep, hi: float, least: float = 0.0) -> float:
    """The least T at which some split has every stage cost <= T; ``hi`` is feasible, no T
    under ``least`` is.

    That T is the cost of one stage or link of the best split, so once bisection has narrowed
    the interval (from the start where few costs lie in it), the stage and link costs inside it
    are listed and searched exactly."""
    problem = sweep.problem

    def fast_enough(limit: float) -> bool:
        return sweep.probe(limit, None) is not None

    if 0.0 < least <= hi and fast_enough(least):
        return least
    lo = float(problem.cost.sum()) / (max(problem.speed) * problem.devices)
    if lo == 0.0 and fast_enough(0.0):
        return 0.0
    if lo >= hi or fast_enough(lo):  # the lower bound is (nearly) reached
        lo, hi = 0.0, min(lo, hi)
    lo = max(lo, min(least, hi))
    values = sweep.costs_between(lo, hi, _FEW_CANDIDATES)
    while values is None and hi - lo > hi * _NARROW:
        mid = lo + (hi - lo) / 2
        if fast_enough(mid):
            hi = mid
        else:
            lo = mid
    if values is None:
        values = sweep.costs_between(lo, hi)
    if values is None:  # degenerate: too many stage costs in the interval to list
        return _least_float(fast_enough, lo, hi)
    return _first_feasible(fast_enough, [*map(float, values), hi])


def _least_memory(sweep: _Sweep, time: float, hi: int) -> int:
    """The least memory cap at which some split has every stage cost <= ``time``; ``hi`` is
    feasible. It is one of its stages' memories: those in range are listed and searched."""
    lo = _memory_floor(sweep.problem) - 1

    def small_enough(cap: int) -> bool:
        return sweep.probe(time, cap) is not None

    values = sweep.memories_between(time, lo, hi)
    if values is None:  # degenerate: too many stages to list
        return _least_int(small_enough, lo, hi)
    return _first_feasible(small_enough, [*map(int, values), hi])


def _first_feasible(feasible: Callable[[_T], bool], candidates: list[_T]) -> _T:
    """The first of ascending ``candidates`` that is feasible, given that the last is."""
    a, b = -1, len(candidates) - 1
    while b - a > 1:
        mid = (a + b) // 2
        if feasible(candidates[mid]):
            b = mid
        else:
            a = mid
    return candidates[b]


def least_bottleneck(problem: Problem) -> float:
    """The least bottleneck of any split of ``problem`` without its memory caps and without
    recomputation: no split :func:`solve` may choose beats it, with them or with any other
    caps and in-flight counts (a search passes it as ``least`` to problems of the same costs)."""
    sweep = _Sweep(replace(problem, checkpoint="never", memory=(None,) * problem.stages))
    states = sweep.probe(math.inf, None)
    if states is None:
        raise _structure_error(problem)
    return _least_time(sweep, sweep.trace(states, math.inf, None).bottleneck)


def solve(problem: Problem, least: float = 0.0) -> Split:
    """The split with the least bottleneck, ties broken toward the least peak memory.

    Under ``checkpoint="auto"`` a split that recomputes nowhere is taken whenever one reaches
    the least bottleneck; otherwise each stage of the chosen split recomputes only if it does
    not fit its memory cap keeping its activations. Raises InfeasibleError (with
    ``smallest_cap``) if no split fits the memory caps. ``least``: a bottleneck known to be
    unbeatable (:func:`least_bottleneck`); where a split reaches it, no bisection is needed."""
    if problem.checkpoint == "auto" and all(cap is None for cap in problem.memory):
        problem = replace(problem, checkpoint="never")  # no cap: recomputing only costs time
    sweep = _Sweep(problem)
    if sweep.probe(math.inf, None, device_caps=False) is None:
        raise _structure_error(problem)
    states = sweep.probe(math.inf, None)
    if states is None:
        need = smallest_cap(problem)
        caps = sorted({c for c in problem.memory if c is not None})
        have = " / ".join(format_bytes(c) for c in caps)
        raise InfeasibleError(
            f"no split into {problem.stages} stages fits in {have} per device: the least memory "
            f"any split needs is {need} bytes ({format_bytes(need)}) on its fullest device",
            smallest_cap=need,
        )
    time = _least_time(sweep, sweep.trace(states, math.inf, None).bottleneck, least)
    if problem.checkpoint == "auto":
        keeping = _Sweep(replace(problem, checkpoint="never"))
        if keeping.probe(time, None) is not None:  # the cap does not need recomputation
            sweep = keeping
    best = sweep.probe(time, None)
    assert best is not None
    top = sweep.trace(best, time, None).peak_memory
    memory = _least_memory(sweep, time, top)
    final = sweep.probe(time, memory)
    assert final is not None
    chosen = sweep.trace(final, time, memory)
    return split_of(problem, chosen.bounds, chosen.replicas)


def balance(times: Sequence[float], stages: int) -> list[int]:
    """Layers per stage for ``stages`` contiguous stages minimising the largest stage sum of
    ``times`` (any non-negative per-layer costs); every stage gets at least one layer."""
    if stages > len(times):
        raise ValueError(f"cannot give {stages} stages a layer each from {len(times)} layers")
    return solve(make_problem(list(times), stages=stages)).balance
