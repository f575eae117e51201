"""Integer program for ordered chains of unlike devices (pulp; its releases: partitioner.solver).

Stage t runs on device t of the chain (its speed, memory and the link to device t + 1 differ per
device). Binary ``e[t, p]`` says that stage t ends at cut position p; every prefix-sum quantity of
a stage is then linear: X[end_t] = sum_p X[p] e[t, p] and X[start_t] = X[end_(t-1)]. The program

    minimise T  subject to  sum_p e[t, p] = 1,  end_(t+1) >= end_t + 1,
                            compute_t <= T,  link_t <= T,  memory_t <= cap_t

uses the cost model of :mod:`partitioner.costs` exactly as the DP does, so on identical devices
both find the same bottleneck. A second program breaks ties toward the least peak memory. The DP
is faster and exact; this exists for device mixes and as an independent check of the DP.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pulp

from partitioner.costs import Problem, compute_prefix, link_time, memory_terms
from partitioner.dp import Split, smallest_cap, split_of
from partitioner.errors import InfeasibleError
from partitioner.solver import constant, solve, variable


def _most_memory(problem: Problem, stage: int) -> int:
    """The most memory ``stage`` could need on any layers (keeping activations)."""
    head, tail = memory_terms(problem, stage)
    return int((head[1:] + np.maximum.accumulate(tail[:-1])).max())


class _Program:
    """The split as an integer program; ``objective`` is "time" or "memory".

    Under ``checkpoint="auto"`` a binary ``c[t]`` says that stage t recomputes. Recomputing is
    never faster and never needs more memory, so the keeping mode's time and the recomputing
    mode's memory bound every stage, and the other two hold only in their mode (big-M)."""

    def __init__(self, problem: Problem, cuts: list[int], objective: str, limit: float) -> None:
        n, s = problem.layers, problem.stages
        self.problem, self.cuts = problem, cuts
        self.model = pulp.LpProblem(objective, pulp.LpMinimize)
        self.e = {
            (t, p): variable(self.model, f"e_{t}_{p}", "Binary")
            for t in range(s - 1)
            for p in cuts
        }
        position = np.arange(n + 1, dtype=float)
        for t in range(s - 1):
            self.model += pulp.lpSum(self.e[t, p] for p in cuts) == 1
            if t > 0:
                self.model += self._end(t, position) >= self._end(t - 1, position) + 1
        modes = problem.modes
        self.time_scale = max(float(compute_prefix(problem, t, 1, True)[-1]) for t in range(s))
        self.time_scale = self.time_scale or 1.0
        mem_scale = float(max(_most_memory(problem, t) for t in range(s))) or 1.0
        bound = variable(self.model, "bound", "Continuous")
        self.model += bound
        time_cap = bound if objective == "time" else limit / self.time_scale
        # scaled times and memories are at most 1: a slack of 2 lifts a mode's bounds
        c = {t: variable(self.model, f"c_{t}", "Binary") for t in range(s) if len(modes) > 1}
        for t in range(s):
            for mode in modes:
                off = 0 if len(modes) == 1 else (1 - c[t] if mode else c[t])
                q = compute_prefix(problem, t, 1, mode) / self.time_scale
                head, tail = (x / mem_scale for x in memory_terms(problem, t, mode))
                memory = self._end(t, head) + self._start(t, tail)
                self.model += self._end(t, q) - self._start(t, q) <= time_cap + 2.0 * off
                cap = problem.memory[t]
                if cap is not None:
                    self.model += memory <= cap / mem_scale + 2.0 * off
                if objective == "memory":
                    self.model += memory <= bound + 2.0 * off
        for t in range(s - 1):
            self.model += self._end(t, link_time(problem, t) / self.time_scale) <= time_cap

    def _end(self, t: int, values: np.ndarray) -> pulp.LpAffineExpression:
        if t == self.problem.stages - 1:
            return constant(float(values[self.problem.layers]))
        return pulp.lpSum(float(values[p]) * self.e[t, p] for p in self.cuts)

    def _start(self, t: int, values: np.ndarray) -> pulp.LpAffineExpression:
        if t == 0:
            return constant(float(values[0]))
        return self._end(t - 1, values)

    def solve(self, time_limit: float | None) -> Split | None:
        """The chosen split, evaluated by the shared cost model, or None if infeasible."""
        if not solve(self.model, time_limit):
            return None
        e, s = self.e, self.problem.stages
        ends = [max(self.cuts, key=lambda p: e[t, p].varValue or 0.0) for t in range(s - 1)]
        return split_of(self.problem, [0, *ends, self.problem.layers], [1] * s)


def solve_ilp(problem: Problem, time_limit: float | None = None) -> Split:
    """The least-bottleneck split of ``problem`` (one device per stage) by integer programming."""
    if problem.devices != problem.stages:
        raise ValueError("the integer program places one device per stage; use the DP to replicate")
    if problem.checkpoint == "auto" and all(cap is None for cap in problem.memory):
        problem = replace(problem, checkpoint="never")  # no cap: recomputing only costs time
    n, s = problem.layers, problem.stages
    cuts = [p for p in range(1, n) if problem.allowed[p]]
    if len(cuts) < s - 1:
        raise InfeasibleError(
            f"cannot split {n} layers into {s} stages: only {len(cuts)} cut points are allowed"
        )
    best = _Program(problem, cuts, "time", math.inf).solve(time_limit)
    if best is None:
        need = smallest_cap(problem)
        raise InfeasibleError(
            f"no split fits the devices' memory: the least memory any split needs is {need} "
            "bytes on its fullest device",
            smallest_cap=need,
        )
    # ties: the least peak memory; under "auto" a split recomputing nowhere first
    variants = [replace(problem, checkpoint="never"), problem]
    for variant in variants if problem.checkpoint == "auto" else [problem]:
        tied = _Program(variant, cuts, "memory", best.bottleneck).solve(time_limit)
        if tied is not None:
            tied = split_of(problem, tied.bounds, tied.replicas)
            if tied.bottleneck <= best.bottleneck:
                return min(best, tied, key=lambda x: (any(x.recompute), x.peak_memory))
    return best
