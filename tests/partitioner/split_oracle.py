"""Brute force for the partitioner tests: every split, costed straight from the definitions.

Written apart from ``partitioner.costs`` on purpose, so the tests compare two implementations of
the cost model rather than one with itself.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import dataclass, field


@dataclass
class Instance:
    """Raw inputs of one split problem (per micro-batch), as lists."""

    forward: list[float]
    backward: list[float]
    stages: int
    weight_bytes: list[int] = field(default_factory=list)
    activation_bytes: list[int] = field(default_factory=list)
    param_bytes: list[int] = field(default_factory=list)
    tied_bytes: list[int] = field(default_factory=list)  # part of param_bytes; empty: none
    cut_bytes: list[int] = field(default_factory=list)  # L + 1 positions
    allowed: list[bool] = field(default_factory=list)  # L + 1 positions
    inflight: list[int] = field(default_factory=list)
    checkpoint: bool | str = False  # True/"always", False/"never", or "auto" (per stage)
    speed: list[float] = field(default_factory=list)
    memory: list[int | None] = field(default_factory=list)
    bandwidth: list[float] = field(default_factory=list)
    devices: int = 0
    microbatches: int = 1
    zero: int = 0  # what a replicated stage shards: 1 optimizer state, 2 + gradients, 3 + weights
    reduce_scatter: str = "step"  # zero 2 and 3: "step" holds a step's gradients whole

    def kwargs(self) -> dict:
        """Keyword arguments of ``partitioner.make_problem``."""
        return {
            "stages": self.stages,
            "weight_bytes": self.weight_bytes,
            "activation_bytes": self.activation_bytes,
            "param_bytes": self.param_bytes,
            "tied_bytes": self.tied_bytes or None,
            "cut_bytes": self.cut_bytes,
            "allowed": self.allowed,
            "inflight": self.inflight,
            "checkpoint": self.checkpoint,
            "speed": self.speed,
            "memory": self.memory,
            "bandwidth": self.bandwidth,
            "devices": self.devices,
            "microbatches": self.microbatches,
            "zero": self.zero,
            "reduce_scatter": self.reduce_scatter,
        }


def modes(inst: Instance) -> list[tuple[bool, ...]]:
    """Every per-stage recomputation choice the instance allows."""
    if inst.checkpoint == "auto":
        return list(itertools.product([False, True], repeat=inst.stages))
    return [(inst.checkpoint in (True, "always"),) * inst.stages]


def stage_costs(
    inst: Instance, bounds: list[int], reps: list[int], recompute: tuple[bool, ...] | None = None
) -> list[tuple[float, int]]:
    """(time, memory) of every stage of a split, from the definitions: a recomputing stage
    runs its forward twice and keeps one micro-batch's activations."""
    out = []
    s = inst.stages
    recompute = modes(inst)[0] if recompute is None else recompute
    for t in range(s):
        i, j, r = bounds[t], bounds[t + 1], reps[t]
        again = recompute[t]
        work = sum(inst.forward[i:j]) * (2 if again else 1) + sum(inst.backward[i:j])
        grads = sum(inst.param_bytes[i:j])
        bandwidth = inst.bandwidth[0] if inst.bandwidth else float("inf")
        # ring passes per step: a reduce-scatter per micro-batch and an all-gather, or 2
        per_microbatch = inst.zero >= 2 and inst.reduce_scatter == "microbatch"
        passes = inst.microbatches + 1 if per_microbatch else 2
        allreduce = passes * (r - 1) / r * grads / bandwidth
        compute = work / (inst.speed[t] * r) + allreduce / inst.microbatches
        link = 2 * inst.cut_bytes[j] / inst.bandwidth[t] if t < s - 1 else 0.0
        k = inst.inflight[t]
        acts = sum(inst.activation_bytes[i:j])
        stash = k * inst.cut_bytes[i] + (acts if again else k * acts)
        out.append((max(compute, link), held(inst, i, j, r) + stash))
    return out


def held(inst: Instance, i: int, j: int, replicas: int) -> int:
    """Bytes of layers [i, j)'s weights, gradients and optimizer state on one of ``replicas``
    devices: under ZeRO each sharded part of each layer is split evenly, rounded up (the
    gradients only when reduced per micro-batch); at 2 and 3 a tied weight, its gradient
    and its share of the optimizer state (by bytes, rounded down) are held whole, and FSDP2
    holds a shard beside each weight held whole (zero 2) and each gradient held whole."""
    total = 0
    for k in range(i, j):
        params, everything = inst.param_bytes[k], inst.weight_bytes[k]
        state = everything - 2 * params
        tied = inst.tied_bytes[k] if inst.tied_bytes and inst.zero >= 2 else 0
        tied_state = math.floor(state * tied / params) if tied else 0
        sharded_grads = inst.zero >= 2 and inst.reduce_scatter == "microbatch"
        parts = [(params - tied, inst.zero >= 3), (params - tied, sharded_grads),
                 (state - tied_state, inst.zero >= 1)]
        total += 2 * tied + tied_state
        total += sum(math.ceil(b / (replicas if divided else 1)) for b, divided in parts)
        if replicas > 1:  # FSDP2's shards beside the whole weight (2) and gradient ("step")
            beside = (inst.zero == 2) + (inst.zero >= 2 and not sharded_grads)
            total += beside * math.ceil((params - tied) / replicas)
    return total


def splits(inst: Instance, use_caps: bool = True):
    """Every feasible split as (bottleneck, peak memory, bounds, replicas, recompute)."""
    n, s = len(inst.forward), inst.stages
    positions = [p for p in range(1, n) if inst.allowed[p]]
    for cuts in itertools.combinations(positions, s - 1):
        bounds = [0, *cuts, n]
        for reps, again in itertools.product(
            itertools.product(range(1, inst.devices - s + 2), repeat=s), modes(inst)
        ):
            if sum(reps) > inst.devices:
                continue
            costs = stage_costs(inst, bounds, list(reps), again)
            caps = inst.memory if use_caps else [None] * s
            if any(c is not None and m > c for (_, m), c in zip(costs, caps, strict=True)):
                continue
            yield max(t for t, _ in costs), max(m for _, m in costs), bounds, list(reps), again


def optimum(inst: Instance, use_caps: bool = True) -> tuple[float, int] | None:
    """Least bottleneck and, among splits within 1e-9 of it, least peak memory."""
    found = list(splits(inst, use_caps))
    if not found:
        return None
    best = min(split[0] for split in found)
    return best, min(split[1] for split in found if split[0] <= best * (1 + 1e-9) + 1e-15)


def random_instance(
    rng: random.Random,
    *,
    max_layers: int = 8,
    max_stages: int = 4,
    bytes_on: bool = True,
    links: bool = True,
    forbid: bool = True,
    unlike: bool = False,
    extra_devices: int = 0,
) -> Instance:
    """A small random instance; caps are drawn around what splits need so some bind."""
    n = rng.randint(1, max_layers)
    s = rng.randint(1, min(n, max_stages))
    m = rng.randint(1, 6)

    def sizes(count: int) -> list[int]:
        return [rng.randint(0, 1000) if bytes_on else 0 for _ in range(count)]

    allowed = [True] + [not forbid or rng.random() > 0.25 for _ in range(n - 1)] + [True]
    schedule_1f1b = rng.random() < 0.5
    inst = Instance(
        forward=[rng.uniform(0.0, 1.0) for _ in range(n)],
        backward=[rng.uniform(0.0, 2.0) for _ in range(n)],
        stages=s,
        weight_bytes=sizes(n),
        activation_bytes=sizes(n),
        param_bytes=sizes(n),
        cut_bytes=[*sizes(n), 0],
        allowed=allowed,
        inflight=[min(m, s - t) if schedule_1f1b else m for t in range(s)],
        checkpoint=rng.random() < 0.5,
        speed=[rng.choice([0.5, 1.0, 2.0]) if unlike else 1.0] * s,
        memory=[None] * s,
        bandwidth=[rng.uniform(200.0, 2000.0) if links else float("inf")] * (s - 1),
        devices=s + extra_devices,
        microbatches=m,
    )
    if unlike:
        inst.speed = [rng.choice([0.5, 1.0, 2.0]) for _ in range(s)]
        inst.bandwidth = [rng.uniform(200.0, 2000.0) for _ in range(s - 1)]
    if extra_devices and s == 1:
        inst.bandwidth = []
    return inst


def least_memory(inst: Instance) -> int | None:
    """The least peak memory of any split, caps and time ignored."""
    return min((split[1] for split in splits(inst, use_caps=False)), default=None)
