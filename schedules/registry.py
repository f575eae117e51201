"""Every schedule by name: one entry each, carrying what the rest of pipetrain knows about it.

Config, planner, memory accounting and runtime read a schedule's properties here and nowhere
else, so adding a schedule is one :class:`ScheduleSpec` passed to :func:`register` (a generator
that states each rank's compute order through :func:`schedules.generators.from_order` gets its
messages placed for it). :func:`register` builds the schedule at a few small sizes and refuses an
entry whose stated properties its generator contradicts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from schedules.action import Kind, Schedule
from schedules.asynchronous import pipedream, pipedream_2bw, unroll
from schedules.dualpipe import dualpipev
from schedules.generators import (
    gpipe,
    interleaved,
    looped_bfs,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
)
from schedules.list_scheduling import interleaved_zb, zbv
from schedules.v_shape import v_half, v_min
from schedules.validate import validate

DEFAULT_SCHEDULE = "1f1b"
"""The schedule a Pipeline, a plan and a simulation use when none is named: the only place
that says so."""

RECOMPUTE_MODES = ("never", "except_last", "always")  # torchgpipe's activation checkpointing


def recompute_below(mode: str, microbatches: int) -> int:
    """Micro-batches numbered below this recompute their forward in the backward under
    checkpoint ``mode`` (one of RECOMPUTE_MODES), with ``microbatches`` per mini-batch."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"checkpoint must be one of {RECOMPUTE_MODES}, got {mode!r}")
    return {"never": 0, "except_last": microbatches - 1, "always": microbatches}[mode]

# (stage, stages, micro-batches) -> micro-batches whose activations that stage holds at once
InflightRule = Callable[[int, int, int], int]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule and its properties.

    ``generator`` builds it: ``generator(stages, microbatches)``, or for a schedule with
    several stages per rank ``generator(ranks, microbatches, stages_per_rank)``; the Schedule
    it returns carries ``name``. ``split_backward``: its lists have W actions (B then computes
    input gradients only). ``asynchronous``: it never flushes (see schedules/asynchronous.py);
    ``update_per_microbatch``: such a schedule updates after every micro-batch rather than once
    per mini-batch. ``checkpoint`` is the recomputation mode Pipeline uses unless told otherwise.
    ``inflight(stage, stages, microbatches)`` is the most micro-batches whose activations a
    stage holds at once (DeepSpeed's ``num_pipe_buffers``); None counts it along the generated
    lists. ``runnable`` is False for a schedule that can be validated and simulated but that the
    runtime does not execute. ``stages_per_rank`` fixes how many stages a multi-stage schedule
    puts on each rank (2 for a V), None where any count runs. ``microbatches_per_stage``: the
    generator takes no fewer micro-batches than this many per stage (see
    :meth:`least_microbatches`).
    """

    name: str
    generator: Callable[..., Schedule]
    multi_stage_per_rank: bool = False
    split_backward: bool = False
    asynchronous: bool = False
    update_per_microbatch: bool = False
    checkpoint: str = "never"
    inflight: InflightRule | None = None
    runnable: bool = True
    stages_per_rank: int | None = None
    microbatches_per_stage: int = 0

    def least_microbatches(self, stages: int) -> int:
        """The fewest micro-batches the schedule runs over ``stages`` stages (DualPipeV: one
        per stage)."""
        return max(1, self.microbatches_per_stage * stages)


def _gpipe_inflight(stage: int, stages: int, microbatches: int) -> int:
    return microbatches


def _one_f_one_b_inflight(stage: int, stages: int, microbatches: int) -> int:
    return min(microbatches, stages - stage)


def _looped_bfs_inflight(stage: int, stages: int, microbatches: int) -> int:
    """Looped BFS: every micro-batch, as in GPipe (its first backward follows its last
    forward on each stage)."""
    return microbatches


def _stream_inflight(stage: int, stages: int, microbatches: int) -> int:
    """PipeDream's endless 1F1B stream: stage s always has p - s micro-batches in flight."""
    return stages - stage


# GPipe holds every micro-batch's activations until its backwards start, so it recomputes all
# but the last micro-batch; the others hold about a pipeline depth of micro-batches, where
# recomputing costs throughput (a quarter of it under 1F1B) for little memory.
_REGISTRY: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("gpipe", gpipe, checkpoint="except_last", inflight=_gpipe_inflight),
        ScheduleSpec("1f1b", one_f_one_b, inflight=_one_f_one_b_inflight),
        ScheduleSpec("interleaved", interleaved, multi_stage_per_rank=True),
        ScheduleSpec(
            "looped-bfs", looped_bfs, multi_stage_per_rank=True, inflight=_looped_bfs_inflight
        ),
        ScheduleSpec("zb-h1", zero_bubble_h1, split_backward=True),
        ScheduleSpec("zb-h2", zero_bubble_h2, split_backward=True),
        ScheduleSpec(
            "interleaved-zb", interleaved_zb, multi_stage_per_rank=True, split_backward=True
        ),
        ScheduleSpec(
            "zbv", zbv, multi_stage_per_rank=True, split_backward=True, stages_per_rank=2
        ),
        # the V with controllable memory: about 1/2 and 1/3 of zbv's activations per rank
        # (schedules/v_shape.py); a stage's own peak has no closed form, so it is counted
        ScheduleSpec(
            "v-half", v_half, multi_stage_per_rank=True, split_backward=True, stages_per_rank=2
        ),
        ScheduleSpec(
            "v-min", v_min, multi_stage_per_rank=True, split_backward=True, stages_per_rank=2
        ),
        ScheduleSpec(
            "dualpipev", dualpipev, multi_stage_per_rank=True, split_backward=True,
            stages_per_rank=2, microbatches_per_stage=1,
        ),
        ScheduleSpec(
            "pipedream", pipedream, asynchronous=True, update_per_microbatch=True,
            inflight=_stream_inflight,
        ),
        ScheduleSpec("pipedream-2bw", pipedream_2bw, asynchronous=True, inflight=_stream_inflight),
    )
}


class _Generators(Mapping[str, Callable[..., Schedule]]):
    """The registry seen as name -> generator (the older ``GENERATORS`` table)."""

    def __getitem__(self, name: str) -> Callable[..., Schedule]:
        return _REGISTRY[name].generator

    def __iter__(self) -> Iterator[str]:
        return iter(_REGISTRY)

    def __len__(self) -> int:
        return len(_REGISTRY)


GENERATORS: Mapping[str, Callable[..., Schedule]] = _Generators()


def names(**properties: object) -> list[str]:
    """The registered schedule names, sorted; with keywords, those whose entries have those
    values, e.g. ``names(asynchronous=True)``."""
    return sorted(
        name for name, spec in _REGISTRY.items()
        if all(getattr(spec, key) == value for key, value in properties.items())
    )


def lookup(name: str) -> ScheduleSpec:
    """The entry of schedule ``name``; an unknown name is refused with the choices."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; choose one of {names()}") from None


def register(spec: ScheduleSpec) -> None:
    """Add ``spec`` to the registry, after checking its generator against what it states."""
    if spec.name in _REGISTRY:
        raise ValueError(
            f"schedule {spec.name!r} is registered already; pick another name or unregister it"
        )
    check_spec(spec)
    _REGISTRY[spec.name] = spec


def unregister(name: str) -> None:
    """Remove schedule ``name`` (one that :func:`register` added, say in a test)."""
    lookup(name)
    del _REGISTRY[name]


def build(name: str, stages: int, microbatches: int, *, ranks: int | None = None) -> Schedule:
    """The schedule called ``name`` for ``stages`` stages and ``microbatches`` micro-batches.

    ``ranks`` is the number of devices. Schedules with one stage per rank need none (or
    ``ranks=stages``); "interleaved" needs it and puts ``stages // ranks`` chunks on each rank,
    e.g. ``build("interleaved", 8, 16, ranks=4)`` for two chunks on each of four ranks.
    """
    spec = lookup(name)
    if spec.multi_stage_per_rank:
        return spec.generator(*_chunks(name, stages, microbatches, ranks))
    if ranks is not None and ranks != stages:
        raise ValueError(
            f"schedule {name!r} runs one stage per rank, so ranks must equal stages "
            f"(got ranks={ranks}, stages={stages}); 'interleaved' puts several stages on a rank"
        )
    return spec.generator(stages, microbatches)


def _chunks(name: str, stages: int, microbatches: int, ranks: int | None) -> tuple[int, int, int]:
    """(ranks, microbatches, chunks per rank) for a schedule with several stages per rank."""
    if ranks is None:
        raise ValueError(
            f"schedule {name!r} needs ranks=: stages = ranks x chunks per rank, e.g. "
            f"build({name!r}, 8, {microbatches}, ranks=4) for 2 chunks on each of 4 ranks"
        )
    if ranks < 1:
        raise ValueError(f"a pipeline needs at least one rank, got ranks={ranks}")
    if stages < ranks or stages % ranks:
        raise ValueError(
            f"schedule {name!r} puts the same number of stages on every rank: stages={stages} "
            f"is not a positive multiple of ranks={ranks}"
        )
    fixed = lookup(name).stages_per_rank
    if fixed is not None and stages != fixed * ranks:
        raise ValueError(
            f"schedule {name!r} puts {fixed} stages on each rank: with ranks={ranks} it needs "
            f"stages={fixed * ranks}, got {stages}"
        )
    return ranks, microbatches, stages // ranks


def inflight(schedule: Schedule) -> tuple[int, ...]:
    """Per stage, the most micro-batches whose activations it holds at once under
    ``schedule`` (a forward stores one, the backward frees it, or the W when the backward is
    split): the entry's rule where it states one and built these lists, else (lists of
    one's own too) counted along the lists (an asynchronous schedule's over
    enough calls to reach its steady state)."""
    entry = _REGISTRY.get(schedule.name)
    if entry is None or entry.inflight is None or not _builds(entry, schedule):
        return counted_inflight(schedule)
    stages, microbatches = schedule.stages, schedule.microbatches
    return tuple(entry.inflight(s, stages, microbatches) for s in range(stages))


def spec_of(schedule: Schedule) -> ScheduleSpec:
    """The entry ``schedule`` runs under: its name's, where the registry builds these very
    lists under that name; else one that states what the lists show (a CSV's, say: no
    recomputation by default, the activations in flight counted along the lists)."""
    entry = _REGISTRY.get(schedule.name)
    if entry is not None and _builds(entry, schedule):
        return entry
    return ScheduleSpec(
        name=schedule.name, generator=lambda *_: schedule,
        multi_stage_per_rank=not schedule.one_stage_per_rank,
        split_backward=schedule.splits_backward, asynchronous=schedule.asynchronous,
        update_per_microbatch=schedule.asynchronous and schedule.update_every == 1,
    )


def _builds(entry: ScheduleSpec, schedule: Schedule) -> bool:
    """Whether ``entry`` builds exactly ``schedule`` at its size."""
    try:
        built = build(entry.name, schedule.stages, schedule.microbatches, ranks=schedule.ranks)
    except ValueError:  # a size or placement the entry does not build
        return False
    return built == schedule


def fewer_in_flight(name: str, stages: int, microbatches: int) -> str | None:
    """The default schedule where it holds fewer micro-batches' activations at once than the
    synchronous, one-stage-per-rank schedule ``name`` at this size (the way out that a plan
    short of memory offers, e.g. from "gpipe"); else None."""
    spec = lookup(name)
    if name == DEFAULT_SCHEDULE or spec.asynchronous or spec.multi_stage_per_rank:
        return None
    try:
        theirs = inflight(build(name, stages, microbatches))
        ours = inflight(build(DEFAULT_SCHEDULE, stages, microbatches))
    except ValueError:  # a size one of them refuses
        return None
    return DEFAULT_SCHEDULE if max(ours) < max(theirs) else None


def counted_inflight(schedule: Schedule) -> tuple[int, ...]:
    """:func:`inflight` counted along the lists, whatever the entry states."""
    if schedule.asynchronous:
        schedule = unroll(schedule, -(-schedule.stages // schedule.microbatches) + 2)
    frees = Kind.WEIGHT if schedule.splits_backward else Kind.BACKWARD
    held, peak = [0] * schedule.stages, [0] * schedule.stages
    for ops in schedule.actions.values():
        for action in ops:
            if action.kind is Kind.FORWARD:
                held[action.stage] += 1
                peak[action.stage] = max(peak[action.stage], held[action.stage])
            elif action.kind is frees:
                held[action.stage] -= 1
    return tuple(peak)


# (stages or ranks, micro-batches) at which register() builds a new entry's schedule
_CHECK_SIZES = ((1, 1), (2, 2), (2, 5), (3, 4), (4, 3), (4, 8))


def check_spec(spec: ScheduleSpec) -> None:
    """Build ``spec``'s schedule at a few small sizes, validate each and compare it with what
    the entry states; raise ValueError naming the first contradiction."""
    if spec.checkpoint not in RECOMPUTE_MODES:
        raise ValueError(
            f"schedule {spec.name!r}: checkpoint must be one of {RECOMPUTE_MODES}, "
            f"got {spec.checkpoint!r}"
        )
    if spec.asynchronous and spec.checkpoint != "never":
        raise ValueError(
            f"schedule {spec.name!r} is asynchronous: a micro-batch's backward reads the "
            "weights its forward read, which recomputation would not; use checkpoint='never'"
        )
    if spec.update_per_microbatch and not spec.asynchronous:
        raise ValueError(
            f"schedule {spec.name!r}: update_per_microbatch applies to asynchronous schedules"
        )
    built = 0
    for ranks, microbatches in _CHECK_SIZES:
        stages = 2 * ranks if spec.multi_stage_per_rank else ranks
        try:
            schedule = (
                spec.generator(ranks, microbatches, 2) if spec.multi_stage_per_rank
                else spec.generator(stages, microbatches)
            )
        except ValueError:  # a size the schedule refuses (too few micro-batches, say)
            continue
        _check_built(spec, schedule, stages, microbatches)
        built += 1
    if not built:
        raise ValueError(f"schedule {spec.name!r}: its generator refused every size tried")


def _check_built(spec: ScheduleSpec, schedule: Schedule, stages: int, microbatches: int) -> None:
    """``schedule``, built by ``spec`` at this size, against what ``spec`` states."""
    where = f"schedule {spec.name!r} at {stages} stages, {microbatches} micro-batches"
    validate(schedule)
    stated = {
        "name": spec.name,
        "stages": stages,
        "microbatches": microbatches,
        "asynchronous": spec.asynchronous,
        "split_backward": spec.split_backward,
        "several stages on a rank": spec.multi_stage_per_rank,
        "micro-batches per update": 1 if spec.update_per_microbatch else microbatches,
    }
    found = {
        "name": schedule.name,
        "stages": schedule.stages,
        "microbatches": schedule.microbatches,
        "asynchronous": schedule.asynchronous,
        "split_backward": schedule.splits_backward,
        "several stages on a rank": not schedule.one_stage_per_rank,
        "micro-batches per update": (
            schedule.update_every if schedule.asynchronous else microbatches
        ),
    }
    for key, value in stated.items():
        if found[key] != value:
            raise ValueError(f"{where}: the entry states {key} = {value}, the schedule has "
                             f"{found[key]}; make the entry and the generator agree")
    if spec.inflight is not None:
        rule = tuple(spec.inflight(s, stages, microbatches) for s in range(stages))
        if rule != counted_inflight(schedule):
            raise ValueError(
                f"{where}: the entry's inflight rule gives {list(rule)} micro-batches per "
                f"stage but the lists hold {list(counted_inflight(schedule))}; fix the rule "
                "or leave it out (None counts along the lists)"
            )
