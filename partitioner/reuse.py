"""What a search over many plans reuses between them: the DP's splits, kept by the cost
problem they solve, the simulated steps, kept by what the simulator was given, and a ceiling on
the step time worth simulating.

Schedules that hold as many micro-batches in flight on each stage pose the same problem (same
costs, same memory), and so do the points of a search that differ only in what the split does
not see; :class:`Splits` solves each once. Points that differ only in what the step's time does
not see (the ZeRO level, where the split comes out the same) simulate the same step: it is
simulated once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import astuple, replace

import numpy as np

from partitioner.costs import Problem, StageCost
from partitioner.dp import Split, least_bottleneck, solve
from partitioner.errors import InfeasibleError
from schedules import Simulation


class Pruned(Exception):  # noqa: N818 (a control-flow signal, not an error)
    """A plan was stopped before its simulation: its step floor (seconds) is over the
    ceiling, so it cannot beat the plan the search holds."""

    def __init__(self, floor: float) -> None:
        super().__init__(f"its step is at least {floor * 1e3:.3f} ms")
        self.floor = floor


def _key(problem: Problem) -> tuple[object, ...]:
    """The problem, hashable: arrays by their bytes."""
    return tuple(
        (v.dtype.str, v.tobytes()) if isinstance(v, np.ndarray) else v for v in astuple(problem)
    )


def _costs_only(problem: Problem) -> Problem:
    """``problem`` with what only its memory depends on made alike: problems alike here have
    the same :func:`partitioner.dp.least_bottleneck`."""
    sharded = problem.sharded_gradients  # a reduce-scatter per micro-batch: more ring passes
    return replace(problem, memory=(None,) * problem.stages, checkpoint="never",
                   inflight=(1,) * problem.stages, zero=2 if sharded else 0,
                   reduce_scatter="microbatch" if sharded else "step")


class Splits:
    """The DP's solutions (or its refusals) kept by problem; ``ceiling``: seconds a plan's
    step floor may reach before :func:`partitioner.plan` stops it (:class:`Pruned`)."""

    def __init__(self) -> None:
        self._found: dict[tuple[object, ...], Split | InfeasibleError] = {}
        self._least: dict[tuple[object, ...], float] = {}  # least_bottleneck by _costs_only
        self.ceiling = math.inf
        self.solved = 0  # DP runs, for the benchmark and --explain
        self._simulated: dict[Hashable, Simulation] = {}

    def solve(self, problem: Problem) -> Split:
        """:func:`partitioner.solve`, once per distinct problem, each started from the least
        bottleneck of the problems of the same costs (computed once for them all)."""
        key = _key(problem)
        found = self._found.get(key)
        if found is None:
            self.solved += 1
            try:
                found = solve(problem, self._least_bottleneck(problem))
            except InfeasibleError as error:
                found = error
            self._found[key] = found
        if isinstance(found, InfeasibleError):
            raise found
        return found  # the problem's own: an equal problem evaluates the split alike

    def _least_bottleneck(self, problem: Problem) -> float:
        key = _key(_costs_only(problem))
        if key not in self._least:
            self._least[key] = least_bottleneck(problem)
        return self._least[key]

    def predicted(self, inputs: Hashable, run: Callable[[], Simulation]) -> Simulation:
        """``run()``, the simulation of ``inputs`` (everything it is given), once per
        distinct ``inputs``."""
        found = self._simulated.get(inputs)
        if found is None:
            found = self._simulated[inputs] = run()
        return found

    def check(self, stages: tuple[StageCost, ...], ranks: list[list[int]], microbatches: int,
              backward_chain: bool) -> None:
        """Raise :class:`Pruned` when the split's :func:`step_floor` is over the ceiling."""
        if self.ceiling < math.inf:
            floor = step_floor(stages, ranks, microbatches, backward_chain)
            if floor > self.ceiling:
                raise Pruned(floor)


def step_floor(stages: tuple[StageCost, ...], ranks: list[list[int]], microbatches: int,
               backward_chain: bool) -> float:
    """A floor under the simulated step of this split under any schedule with this
    placement: no action of stage k or a later one can start before the first micro-batch's
    forward has crossed stages 0..k-1, and stage k's rank runs all of its work on stages >= k
    itself. With ``backward_chain`` (the backward whole, no W apart), all of that work ends by
    stage k's last backward, after which that micro-batch's backward still crosses stages
    k-1..0."""
    floor = 0.0
    before = after = 0.0
    for k, stage in enumerate(stages):
        rank = ranks[k][0]
        own = sum(s.forward + s.backward for s, where in zip(stages[k:], ranks[k:], strict=True)
                  if where[0] == rank)
        floor = max(floor, before + microbatches * own + (after if backward_chain else 0.0))
        before += stage.forward
        after += stage.backward
    return floor
