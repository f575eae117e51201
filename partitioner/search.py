"""Plan the whole run: pipeline ranks, data-parallel copies, schedule, micro-batch count and ZeRO
level chosen together, each point of that space split by :func:`partitioner.plan` and timed by
its simulator.

``devices = stages x copies``: a pipeline of ``stages`` ranks (under a schedule that puts several
stages on a rank, each rank holds ``virtual_stages`` of them, or the schedule's own count) is
copied ``data_parallel`` times, each copy running ``microbatches`` micro-batches of its share of
the batch. Points are planned fastest floor first, and a point is pruned, unplanned, where a
floor under its step (seconds no split can beat) is over the best step its schedule has so far;
one whose weights alone overflow the memory cap is refused without a split. Each generated
schedule is validated once and each distinct split problem solved once
(:mod:`partitioner.reuse`), so the search returns what planning every point would, the best of
each schedule included.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache

import numpy as np

from partitioner.costs import (
    forget_schedules,
    held_weight_bytes,
    pipeline_schedule,
    problem_from_profile,
    split_backward_time,
)
from partitioner.errors import InfeasibleError
from partitioner.planner import plan
from partitioner.plans import Host, Plan
from partitioner.profile import Profile
from partitioner.reuse import Pruned, Splits
from partitioner.units import format_bytes, parse_bandwidth, parse_bytes
from schedules import DEFAULT_SCHEDULE, lookup, names


@dataclass(frozen=True)
class Point:
    """One point of the space: ``stages`` pipeline ranks, copied ``data_parallel`` times."""

    schedule: str
    stages: int
    data_parallel: int
    microbatches: int
    zero: int
    virtual_stages: int = 1  # stages per rank (1: one stage per rank)
    microbatch_size: int = 1  # samples per micro-batch, of a copy's share of the batch

    def describe(self) -> str:
        """The point in a few words, as the CLI prints it."""
        copies = f" x {_count(self.data_parallel, 'copy', 'copies')}" if self.data_parallel > 1 \
            else ""
        pipeline = _count(self.stages, "stage") if self.virtual_stages == 1 else (
            f"{_count(self.stages, 'rank')} of {self.virtual_stages} stages")
        return (f"{self.schedule}, {pipeline}{copies}, "
                f"{_count(self.microbatches, 'micro-batch', 'micro-batches')} of "
                f"{_count(self.microbatch_size, 'sample')}, zero {self.zero}")


def _count(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the noun, singular for 1: "1 stage", "4 stages"."""
    return f"{n} {one if n == 1 else (many or one + 's')}"


@dataclass(frozen=True)
class Candidate:
    """A point and the plan it gave; without one, ``reason`` says why: it did not fit (``need``:
    the least memory cap it needs, where known) or it was ``pruned``."""

    point: Point
    plan: Plan | None
    floor: float = 0.0  # seconds no split of the point can beat
    reason: str = ""
    need: int | None = None
    pruned: bool = False

    @property
    def schedule(self) -> str:
        return self.point.schedule

    @property
    def stages(self) -> int:
        return self.point.stages

    @property
    def microbatches(self) -> int:
        return self.point.microbatches

    @property
    def zero(self) -> int:
        return self.point.zero


def peak_memory(result: Plan) -> int:
    """The most bytes any rank holds under the plan (stages sharing a rank summed)."""
    held: dict[int, int] = {}
    for stage in result.per_stage:
        for rank in stage.ranks:
            held[rank] = held.get(rank, 0) + stage.memory_bytes
    return max(held.values())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def space(
    profile: Profile,
    *,
    devices: int,
    batch_size: int,
    schedules: Sequence[str] | None = None,
    stages: Sequence[int] | None = None,
    microbatches: Sequence[int] | None = None,
    zero: Sequence[int] | None = None,
    virtual_stages: int = 2,
) -> Iterator[Point]:
    """Every point of the space: ``stages`` dividing ``devices`` (at most one layer a stage), the
    copies and micro-batches dividing ``batch_size``, as many micro-batches as the schedule
    takes at least, ZeRO levels where there are copies to shard over; what the caller fixes
    narrows it (a fixed value that does not fit is left out: :func:`why_empty` says why)."""
    if devices < 1 or batch_size < 1:
        raise ValueError(f"devices and batch_size must be >= 1, got {devices}, {batch_size}")
    for name in schedules or names(asynchronous=False, runnable=True):
        spec = lookup(name)
        per_rank = (spec.stages_per_rank or virtual_stages) if spec.multi_stage_per_rank else 1
        for ranks in stages or _divisors(devices):
            copies, left = divmod(devices, ranks)
            if left or ranks * per_rank > len(profile.layers) or batch_size % copies:
                continue
            least = spec.least_microbatches(ranks * per_rank)
            for m in microbatches or _divisors(batch_size // copies):
                if m < least or (batch_size // copies) % m:
                    continue
                for level in zero or ([0, 1, 2, 3] if copies > 1 else [0]):
                    yield Point(name, ranks, copies, m, level, per_rank,
                                batch_size // (copies * m))


def why_empty(profile: Profile, *, devices: int, batch_size: int,
              stages: Sequence[int] | None = None,
              microbatches: Sequence[int] | None = None) -> str:
    """Why :func:`space` has no point, worded with the flag that fixes it."""
    counts = [s for s in stages or _divisors(devices) if devices % s == 0]
    if not counts:
        return (f"--stages {', '.join(map(str, stages or []))} does not divide the {devices} "
                f"devices into copies of one pipeline: use a divisor of {devices}")
    fit = [s for s in counts if s <= len(profile.layers)]
    if not fit:
        return (f"{len(profile.layers)} layers cannot fill "
                f"{_count(min(counts), 'stage')}: use fewer --stages")
    copies = [devices // s for s in fit if batch_size % (devices // s) == 0]
    if not copies:
        return (f"the batch of {batch_size} does not split over {devices // max(fit)} or more "
                f"copies of the pipeline: use a --batch-size that is a multiple of "
                f"{devices // max(fit)}, or more --stages")
    return (f"no micro-batch count {microbatches} divides a copy's share of the batch of "
            f"{batch_size} ({', '.join(str(batch_size // c) for c in copies)} samples) with "
            "as many micro-batches as the schedule needs: use another --microbatches or "
            "--batch-size")


@dataclass(frozen=True)
class _Work:
    """What the time floors need of the profile: per layer, seconds of forward + backward per
    sample and seconds of a whole all-reduce of its gradients at unit ring share, and the least
    share of any layer's compute its forward is; ``split_sample``: the per-sample seconds
    with the backward split into B and W as profiled (:func:`split_backward_time`)."""

    per_sample: np.ndarray
    allreduce: np.ndarray
    forward_share: float
    split_sample: np.ndarray

    @staticmethod
    def of(profile: Profile, recompute: bool, bandwidth: float | str | None) -> _Work:
        layers = profile.layers
        # per sample only what grows with the batch: the floor stays under any micro-batch's
        grows = [layer.backward - layer.backward_fixed for layer in layers]
        split = [split_backward_time(layer, b)[0] for layer, b in zip(layers, grows, strict=True)]
        forward = np.array([layer.forward - layer.forward_fixed for layer in layers])
        # the least forward share, of the whole or the split backward: a floor for both
        backward = [max(la.backward, split_backward_time(la, la.backward)[0]) for la in layers]
        shares = [layer.forward / (layer.forward * (2 if recompute else 1) + b)
                  for layer, b in zip(layers, backward, strict=True)
                  if layer.forward + layer.backward > 0]
        link = math.inf if bandwidth is None else parse_bandwidth(bandwidth)
        ring = np.array([2.0 * layer.param_bytes for layer in layers]) / link
        return _Work((forward + grows) / profile.batch_size, ring, min(shares, default=0.0),
                     (forward + split) / profile.batch_size)


def time_floor(work: _Work, point: Point) -> float:
    """Seconds no split of ``point`` can beat (:func:`partitioner.reuse.step_floor` for an
    unknown split): a copy's compute C per micro-batch times :func:`_floor_factor` of the
    schedule's placement; or each rank's share of the compute and the all-reduces over the
    copies that end its step, and the rank holding the heaviest layer's."""
    spec = lookup(point.schedule)
    chain = work.forward_share if spec.split_backward else 1.0
    m = point.microbatches
    compute = (work.split_sample if spec.split_backward else work.per_sample) \
        * point.microbatch_size
    reduce = work.allreduce * (1 - 1 / point.data_parallel)
    return max(float(compute.sum()) * _floor_factor(_placement(point), m, chain),
               float(m * compute.sum() + reduce.sum()) / point.stages,
               float((m * compute + reduce).max()))


def _placement(point: Point) -> tuple[int, ...]:
    """Each stage's rank under the point's schedule (it does not depend on the micro-batch
    count, so the schedule is built for its fewest)."""
    count = point.stages * point.virtual_stages
    if point.virtual_stages == 1:
        return tuple(range(count))
    spec = lookup(point.schedule)
    tried = sorted({spec.least_microbatches(count), point.stages, point.microbatches})
    for m in tried:
        try:
            return pipeline_schedule(point.schedule, count, m, point.virtual_stages,
                                     checked=False).placement
        except ValueError:
            continue
    return tuple(t % point.stages for t in range(count))  # never reached for a runnable point


@lru_cache(maxsize=4096)
def _floor_factor(placement: tuple[int, ...], m: int, chain: float) -> float:
    """F with step >= F * C for every split of compute C per micro-batch over the stages of
    ``placement``: for stage k, ``chain * P_k + m * T_k`` bounds the step (P_k the compute of
    stages before k, which the first micro-batch's forward and, ``chain`` = 1, the last one's
    backward cross; T_k the compute of stage k's rank on stages >= k). Any weights on these
    bounds give a floor (their weighted sum, least over where C lies); with one stage per rank
    the best is ``chain / (1 - (1 - chain / m) ** S)``, else multiplicative weights find good
    ones."""
    stages, ranks = len(placement), len(set(placement))
    even = m / ranks  # each rank runs its share
    if chain == 0.0:
        return even
    if ranks == stages:
        return max(even, chain / (1 - (1 - chain / m) ** stages))
    where = np.array(placement)
    k = np.arange(stages)
    game = (chain * (k[None, :] < k[:, None])
            + m * ((k[:, None] <= k[None, :]) & (where[:, None] == where[None, :]))) / m
    weights, best = np.ones(stages), 0.0
    for _ in range(400):
        pay = (weights / weights.sum()) @ game
        best = max(best, float(pay.min()))
        weights *= np.exp(0.2 * game[:, int(pay.argmin())])
        weights /= weights.max()
    return max(even, best * m)


def forget() -> None:
    """Drop what searches keep between them (generated schedules, floor factors): the cold
    start a fresh ``pipetrain plan`` has."""
    forget_schedules()
    _floor_factor.cache_clear()


def weight_floor(profile: Profile, point: Point) -> int:
    """Bytes some rank holds at least: per layer its weights, gradients and optimizer state
    (their share at the point's ZeRO level over its copies) and one micro-batch's activations,
    spread evenly over the ranks, or the heaviest layer's."""
    problem = problem_from_profile(
        profile, stages=1, microbatches=1, microbatch_size=point.microbatch_size,
        zero=point.zero, data_parallel=point.data_parallel,
        reduce_scatter="microbatch" if point.zero >= 2 else "step",
    )
    credit = 0 if problem.input_bytes is None else problem.input_bytes
    held = held_weight_bytes(problem) + problem.activation_bytes - credit
    return max(-(-int(held.sum()) // point.stages), int(held.max()))


WITHIN = 1.1  # each schedule's best is kept where it is within this of the best step


@dataclass(frozen=True)
class Settings:
    """What every point is planned under (as :func:`partitioner.plan` takes them)."""

    memory: int | None = None
    bandwidth: float | str | None = None
    checkpoint: str = "auto"
    host: Host = field(default_factory=Host)
    reduce_scatter: str = "auto"


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
    settings: Settings | None = None,
    prune: bool = True,
    within: float = WITHIN,
) -> list[Candidate]:
    """Every point of :func:`space`, planned, refused or (``prune``) pruned, fastest floor
    first. ``memory`` (bytes per device, or "80GB") overrides ``settings.memory``.

    Pruning keeps the best point, and the best of each schedule whose best is within
    ``within`` times the best step: a point is pruned where its floor is over its
    schedule's best so far, or over ``within`` times the best so far."""
    settings = settings or Settings()
    if memory is not None:
        settings = replace(settings, memory=parse_bytes(memory))
    work = _Work.of(profile, settings.checkpoint != "never", settings.bandwidth)
    points = space(profile, devices=devices, batch_size=batch_size, schedules=schedules,
                   stages=stages, microbatches=microbatches, zero=zero,
                   virtual_stages=virtual_stages)
    ordered = sorted(((time_floor(work, p), p) for p in points),
                     key=lambda pair: (pair[0], pair[1].zero, pair[1].stages))
    splits = Splits()
    best: dict[str, float] = {}
    found = []
    for floor, point in ordered:
        ceiling = math.inf
        if prune:
            ceiling = min(best.get(point.schedule, math.inf),
                          within * min(best.values(), default=math.inf))
        one = _planned(profile, point, floor, ceiling, settings, splits)
        if one.plan is not None:
            best[point.schedule] = min(best.get(point.schedule, math.inf), one.plan.step_time)
        found.append(one)
    return found


def _planned(profile: Profile, point: Point, floor: float, ceiling: float,
             settings: Settings, splits: Splits) -> Candidate:
    """The candidate of ``point``: pruned by its floors, refused, or planned."""
    if floor > ceiling:
        return _pruned(point, floor)
    cap = settings.memory
    if cap is not None and (held := weight_floor(profile, point)) > cap:
        return Candidate(point, None, floor, f"its weights, gradients, optimizer state and one "
                         f"micro-batch's activations need {format_bytes(held)} on some rank, "
                         f"over the cap of {format_bytes(cap)}", need=held)
    splits.ceiling = ceiling
    several = point.virtual_stages > 1
    try:
        result = plan(
            profile, stages=point.stages * point.virtual_stages, microbatches=point.microbatches,
            schedule=point.schedule, memory=cap, bandwidth=settings.bandwidth,
            checkpoint=settings.checkpoint, microbatch_size=point.microbatch_size,
            cores=settings.host.cores, overhead=settings.host.overhead,
            virtual_stages=point.virtual_stages if several else 2, zero=point.zero,
            reduce_scatter=settings.reduce_scatter if point.zero >= 2 else "auto",
            data_parallel=point.data_parallel, splits=splits,
        )
    except Pruned as stop:
        return _pruned(point, stop.floor)
    except (InfeasibleError, ValueError) as error:
        need = error.smallest_cap if isinstance(error, InfeasibleError) else None
        return Candidate(point, None, floor, str(error), need=need)
    return Candidate(point, result, floor)


def _pruned(point: Point, floor: float) -> Candidate:
    return Candidate(point, None, floor, f"pruned: its step is at least {floor * 1e3:.3f} ms, "
                     f"over the best {point.schedule} plan's or what the search keeps",
                     pruned=True)


def rank_key(c: Candidate) -> tuple[float, int, int, int, int, int]:
    """Fastest first; ties: the lower ZeRO level, less memory, fewer stages, fewer
    micro-batches, then the default schedule, then the others by name."""
    assert c.plan is not None
    order = [DEFAULT_SCHEDULE, *sorted(set(names()) - {DEFAULT_SCHEDULE})]
    return (c.plan.step_time, c.zero, peak_memory(c.plan), c.stages, c.microbatches,
            order.index(c.schedule) if c.schedule in order else len(order))


def best_per_schedule(found: Sequence[Candidate]) -> dict[str, Candidate]:
    """The fastest feasible candidate of each schedule, fastest schedule first."""
    best: dict[str, Candidate] = {}
    for c in found:
        if c.plan is not None and (c.schedule not in best
                                   or rank_key(c) < rank_key(best[c.schedule])):
            best[c.schedule] = c
    return dict(sorted(best.items(), key=lambda item: rank_key(item[1])))


def frontier(found: Sequence[Candidate]) -> list[Candidate]:
    """The planned candidates no other beats in both step time and peak memory, fastest
    first: the time-vs-memory trade the search saw."""
    planned = sorted((c for c in found if c.plan is not None), key=rank_key)
    kept: list[Candidate] = []
    for c in planned:
        assert c.plan is not None
        if not kept or peak_memory(c.plan) < min(peak_memory(k.plan) for k in kept if k.plan):
            kept.append(c)
    return kept
