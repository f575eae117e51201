"""Plan the whole run: stage count, replicas, schedule, micro-batch count and ZeRO level chosen
together, each candidate split by :func:`partitioner.plan` and timed by its simulator.

A first cut of issue 48: the search is exhaustive over the space (no bounds yet), so it is
meant for tens of devices; each choice the caller fixes narrows it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from partitioner.errors import InfeasibleError
from partitioner.planner import plan
from partitioner.plans import Plan
from partitioner.profile import Profile
from schedules import lookup, names


@dataclass(frozen=True)
class Candidate:
    """One point of the space and the plan it gave (None: it did not fit, ``reason`` says)."""

    schedule: str
    stages: int
    microbatches: int
    zero: int
    plan: Plan | None
    reason: str = ""


def peak_memory(result: Plan) -> int:
    """The most bytes any rank holds under the plan (stages sharing a rank summed)."""
    held: dict[int, int] = {}
    for stage in result.per_stage:
        for rank in stage.ranks:
            held[rank] = held.get(rank, 0) + stage.memory_bytes
    return max(held.values())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    profile: Profile,
    *,
    devices: int,
    batch_size: int,
    memory: int | str | None = None,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
    microbatches: Sequence[int] | None = None,
    zero: Sequence[int] | None = None,
    virtual_stages: int = 2,
) -> list[Candidate]:
    """Every candidate of the space, planned: ``devices = stages x replicas``, the micro-batch
    count dividing ``batch_size``, synchronous runnable schedules, ZeRO levels where stages are
    replicated. Under "interleaved" the ranks are the devices (no replicas)."""
    if devices < 1 or batch_size < 1:
        raise ValueError(f"devices and batch_size must be >= 1, got {devices}, {batch_size}")
    found = []
    for name in schedules or names(asynchronous=False, runnable=True):
        interleaved = lookup(name).multi_stage_per_rank
        counts = stages or [s for s in _divisors(devices) if s <= len(profile.layers)]
        for count in counts:
            for m in microbatches or _divisors(batch_size):
                levels = zero or ([0, 1, 2, 3] if count < devices and not interleaved else [0])
                for level in levels:
                    found.append(_one(
                        profile, name, count, m, level, devices, batch_size, memory,
                        virtual_stages,
                    ))
    return found


def _one(
    profile: Profile, schedule: str, stages: int, microbatches: int, zero: int, devices: int,
    batch_size: int, memory: int | str | None, virtual_stages: int,
) -> Candidate:
    interleaved = lookup(schedule).multi_stage_per_rank
    if batch_size % microbatches:
        return Candidate(schedule, stages, microbatches, zero, None,
                         f"{microbatches} micro-batches do not divide the batch of {batch_size}")
    if interleaved and stages != devices:
        return Candidate(schedule, stages, microbatches, zero, None,
                         f"{schedule} runs on as many ranks as devices ({devices})")
    try:
        result = plan(
            profile,
            stages=stages * virtual_stages if interleaved else stages,
            microbatches=microbatches,
            schedule=schedule,
            memory=memory,
            devices=None if interleaved or stages == devices else devices,
            microbatch_size=batch_size // microbatches,
            virtual_stages=virtual_stages,
            zero=zero,
        )
    except (InfeasibleError, ValueError) as error:
        return Candidate(schedule, stages, microbatches, zero, None, str(error))
    return Candidate(schedule, stages, microbatches, zero, result)


def _rank(c: Candidate) -> tuple[float, int, int]:
    """Fastest first; ties: the lower ZeRO level, then less memory."""
    assert c.plan is not None
    return (c.plan.step_time, c.zero, peak_memory(c.plan))


def best_per_schedule(found: Sequence[Candidate]) -> dict[str, Candidate]:
    """The fastest feasible candidate of each schedule, fastest schedule first."""
    best: dict[str, Candidate] = {}
    for c in found:
        if c.plan is not None and (c.schedule not in best or _rank(c) < _rank(best[c.schedule])):
            best[c.schedule] = c
    return dict(sorted(best.items(), key=lambda item: _rank(item[1])))
