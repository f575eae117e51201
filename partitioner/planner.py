"""``plan()``: from a profile and a cluster to a Plan, with the step it predicts; and the costs
and prediction of a split chosen by hand (:func:`stage_costs`, :func:`simulate_split`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import networkx as nx

from partitioner.costs import (
    REDUCE_SCATTER,
    Problem,
    StageCost,
    evaluate,
    pipeline_schedule,
    problem_from_profile,
)
from partitioner.dp import Split, solve
from partitioner.errors import InfeasibleError, Remedy
from partitioner.ilp import solve_ilp
from partitioner.plans import Host, Plan, StagePlan
from partitioner.profile import Profile
from partitioner.reuse import Splits
from partitioner.topology import chain_order, is_uniform, link_bandwidths, memory_of, speed_of
from partitioner.units import parse_bandwidth, parse_bytes
from schedules import DEFAULT_SCHEDULE, Simulation, lookup, simulate
from schedules.registry import fewer_in_flight

SOLVERS = ("auto", "dp", "ilp")


def _min_cap(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def plan(
    profile: Profile,
    *,
    stages: int,
    microbatches: int,
    schedule: str = DEFAULT_SCHEDULE,
    memory: int | str | None = None,
    bandwidth: float | str | None = None,
    devices: int | nx.Graph | None = None,
    checkpoint: str = "auto",
    microbatch_size: int | None = None,
    solver: str = "auto",
    cores: int | None = None,
    overhead: float = 0.0,
    virtual_stages: int = 2,
    zero: int = 0,
    reduce_scatter: str = "auto",
    data_parallel: int = 1,
    splits: Splits | None = None,
) -> Plan:
    """Split ``profile`` into ``stages`` stages for ``microbatches`` micro-batches per step.

    ``memory``: bytes per device (``"16GiB"`` works too), None for no cap. ``bandwidth``: bytes/s
    between stages (``"25GB/s"``), None for free communication. ``devices``: None (one device per
    stage), an int >= ``stages`` (identical devices; stages may be replicated) or a device graph
    from :mod:`partitioner.topology` with one device per stage (identical devices: DP with every
    link's own bandwidth; unlike devices: integer program). ``microbatch_size`` defaults to the
    profile's batch size. ``checkpoint="auto"`` recomputes activations only on the stages
    whose memory cap needs it ("always": every stage, "never": none; ``Plan.checkpoints``).
    Raises InfeasibleError when nothing fits, naming the cap that would and the ways out.
    ``zero``: each replicated stage shards its optimizer state (1), also its gradients (2),
    also its weights (3) over its replicas, as ``Pipeline(zero=...)`` does: a stage's memory
    counts its share of them. ``reduce_scatter`` (zero 2 and 3, as ``Pipeline``'s): "step"
    counts a step's gradients whole and one reduce-scatter, "microbatch" their shards and a
    reduce-scatter per micro-batch; "auto" (default) plans under both and keeps the faster
    split that fits, "step" on a tie (``Plan.reduce_scatter`` says which).

    ``data_parallel``: copies of the whole pipeline, each running every micro-batch of its own
    samples, all-reducing (and under ``zero`` sharding) each stage's weights together
    (``Plan.data_parallel``). ``splits`` (a search's :class:`partitioner.reuse.Splits`) solves
    each distinct problem once and raises ``Pruned`` for a split whose step floor is over its
    ceiling.

    ``cores`` and ``overhead`` change the prediction, not the split (see :func:`predict`): the
    stages are processes sharing ``cores`` processors of one host (a CPU machine), and the
    runtime spends ``overhead`` seconds of its own per action.

    Under "interleaved", ``stages`` counts virtual stages (the length of the balance): they run
    ``virtual_stages`` to a rank on ``stages / virtual_stages`` ranks, stage s on rank
    s mod ranks, and ``memory`` caps the sum of a rank's stages. Under "zb-h1"/"zb-h2" each
    layer's backward is split into B and W by :func:`partitioner.costs.weight_gradient_share`.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    cap = None if memory is None else parse_bytes(memory)
    link = math.inf if bandwidth is None else parse_bandwidth(bandwidth)
    speed: list[float] | None = None
    caps: int | None | list[int | None] = cap
    links: float | list[float] = link
    count: int | None = None if isinstance(devices, nx.Graph) else devices
    ranks: list[list[int]] = []
    use_ilp = solver == "ilp"
    _check_devices(schedule, devices)
    if isinstance(devices, nx.Graph):
        speed, caps, links, ranks = _on_graph(devices, stages, cap, link)
        use_ilp = use_ilp or (solver == "auto" and not is_uniform(devices))
    problem = problem_from_profile(
        profile, stages=stages, microbatches=microbatches, microbatch_size=microbatch_size,
        schedule=schedule, checkpoint=checkpoint, virtual_stages=virtual_stages, speed=speed,
        memory=caps, bandwidth=links, devices=count, zero=zero, data_parallel=data_parallel,
    )
    split, mode = _choose(problem, use_ilp, schedule, checkpoint, reduce_scatter, splits)
    ranks = ranks or _ranks(split, schedule, microbatches, virtual_stages, cap)
    if splits is not None:
        splits.check(split.stages, ranks, microbatches, not lookup(schedule).split_backward)
    size = profile.batch_size if microbatch_size is None else microbatch_size
    made = _make_plan(profile, split, ranks, schedule, microbatches, size, checkpoint, use_ilp,
                      Host(cores, overhead), virtual_stages, splits)
    return replace(made, reduce_scatter=mode, zero=zero, data_parallel=data_parallel)


def _choose(
    problem: Problem, use_ilp: bool, schedule: str, checkpoint: str, reduce_scatter: str,
    splits: Splits | None = None,
) -> tuple[Split, str]:
    """The split and the reduce-scatter mode it is planned under (:func:`plan`): under
    "auto" at zero 2 and 3 the faster of the two that fit, by the bottleneck."""
    if reduce_scatter not in ("auto", *REDUCE_SCATTER):
        raise ValueError(f"reduce_scatter must be 'auto' or one of {REDUCE_SCATTER}, got "
                         f"{reduce_scatter!r}")
    if reduce_scatter == "microbatch" and problem.zero < 2:
        raise ValueError(f"reduce_scatter='microbatch' needs zero 2 or 3 (zero={problem.zero} "
                         "keeps the gradients whole): pass --zero 2 or 3")
    if reduce_scatter != "auto":
        modes: tuple[str, ...] = (reduce_scatter,)
    else:
        modes = REDUCE_SCATTER if problem.zero >= 2 else ("step",)
    found: list[tuple[Split, str]] = []
    failure: InfeasibleError | None = None
    for mode in modes:  # "step" first: kept on a tie (fewer collectives)
        try:
            found.append((_solve(replace(problem, reduce_scatter=mode), use_ilp, schedule,
                                 checkpoint, splits), mode))
        except InfeasibleError as error:
            failure = error  # the last mode's: the smallest cap
    if not found:
        assert failure is not None
        raise failure
    return min(found, key=lambda pair: pair[0].bottleneck)


def _ranks(
    split: Split, schedule: str, microbatches: int, virtual_stages: int, cap: int | None
) -> list[list[int]]:
    """Each stage's ranks: where the schedule puts several stages on a rank, its placement
    (their memory checked together against ``cap``), else consecutive ranks, as many as its
    replicas."""
    stages = len(split.replicas)
    if lookup(schedule).multi_stage_per_rank:
        placement = pipeline_schedule(schedule, stages, microbatches, virtual_stages,
                                      checked=False).placement  # predict validates it
        ranks = [[rank] for rank in placement]
        _check_rank_memory(split.stages, ranks, cap)
        return ranks
    first = [sum(split.replicas[:t]) for t in range(stages)]
    return [list(range(a, a + r)) for a, r in zip(first, split.replicas, strict=True)]


def _check_devices(schedule: str, devices: int | nx.Graph | None) -> None:
    """Refuse ``devices`` where ``schedule`` puts several stages on a rank: it places them
    itself."""
    if lookup(schedule).multi_stage_per_rank and devices is not None:
        raise ValueError(
            f"schedule {schedule!r} places its stages on stages / virtual_stages ranks itself; "
            "leave out devices (replicas and device graphs are for one stage per rank)"
        )


def _on_graph(
    devices: nx.Graph, stages: int, cap: int | None, link: float
) -> tuple[list[float], list[int | None], list[float], list[list[int]]]:
    """Per stage along the device chain: speed, memory cap and link bandwidth, and its rank."""
    if devices.number_of_nodes() != stages:
        raise ValueError(
            f"a device graph must have one device per stage ({stages}), it has "
            f"{devices.number_of_nodes()}; pass devices=<int> to replicate stages"
        )
    order = chain_order(devices)
    speed = [speed_of(devices, r) for r in order]
    caps = [_min_cap(cap, memory_of(devices, r)) for r in order]
    return speed, caps, link_bandwidths(devices, order), [[r] for r in order]


def _solve(
    problem: Problem, use_ilp: bool, schedule: str, checkpoint: str, splits: Splits | None = None
) -> Split:
    """The best split by the DP (kept in ``splits``) or the integer program; if none fits,
    the ways out."""
    try:
        if use_ilp:
            return solve_ilp(problem)
        return splits.solve(problem) if splits is not None else solve(problem)
    except InfeasibleError as error:
        remedies = _remedies(problem, schedule, checkpoint, error.smallest_cap is not None)
        raise InfeasibleError(error.reason, error.smallest_cap, remedies) from None


def _remedies(problem: Problem, schedule: str, checkpoint: str, memory: bool) -> list[Remedy]:
    """The ways out of an infeasible plan, leaving out the options already in force."""
    if not memory:  # too few layers or cuts: fewer stages is the way out
        return []
    found = [Remedy("a larger memory cap", "a larger --memory")]
    if problem.stages < problem.layers:
        found.append(Remedy("more stages", "a larger --stages"))
    lighter = fewer_in_flight(schedule, problem.stages, problem.microbatches)
    if lighter is not None:
        found.append(Remedy(
            f"schedule={lighter!r} (fewer micro-batches in flight)",
            f"--schedule {lighter} (fewer micro-batches in flight)",
        ))
    if checkpoint == "never":
        found.append(Remedy(
            "checkpoint='auto' (recompute activations where the cap needs it)",
            "--checkpoint auto (recompute activations where the cap needs it)",
        ))
    if problem.devices * problem.data_parallel > problem.stages and problem.zero < 3:
        found.append(Remedy(
            "zero=3 (replicated stages shard their weights, gradients and optimizer state)",
            "--zero 3 (replicated stages shard their weights, gradients and optimizer state)",
        ))
    return found


def _check_rank_memory(
    stages: Sequence[StageCost], ranks: Sequence[list[int]], cap: int | None
) -> None:
    """Raise InfeasibleError when the stages sharing a rank need more than ``cap`` bytes.

    The split is chosen for time; with several stages per rank the memory cap applies to
    their sum, which the per-stage solvers do not see, so it is checked here."""
    if cap is None:
        return
    need: dict[int, int] = {}
    for cost, where in zip(stages, ranks, strict=True):
        need[where[0]] = need.get(where[0], 0) + cost.memory
    rank, most = max(need.items(), key=lambda item: item[1])
    if most > cap:
        remedies = [
            Remedy("a larger memory cap", "a larger --memory"),
            Remedy("more ranks (fewer virtual_stages per rank)", "a smaller --virtual-stages"),
        ]
        if not all(s.recompute for s in stages):
            remedies.append(Remedy("checkpoint='always'", "--checkpoint always"))
        raise InfeasibleError(
            f"rank {rank} holds {most:,} bytes of its stages, over the memory cap of "
            f"{cap:,} bytes",
            smallest_cap=None,
            remedies=remedies,
        )


def predict(
    schedule: str,
    microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    message: Sequence[float],
    optimizer_step: Sequence[float],
    host: Host | None = None,
    *,
    weight: Sequence[float] | None = None,
    virtual_stages: int = 2,
) -> Simulation:
    """The planner's prediction of one step: ``schedule`` simulated on per-stage costs
    (``message``: per boundary, the seconds one activation takes at the link's bandwidth).

    ``backward`` is each stage's whole backward and ``weight`` (default none) the part of it
    that computes weight gradients: a zero-bubble schedule runs that part as its W actions,
    the rest as B; any other schedule runs the whole backward as B. "interleaved" runs
    ``virtual_stages`` stages per rank.

    On a ``host`` with ``cores`` the stages are processes sharing that many processors: they run
    slower while more stages run than there are cores, and a message is a memory copy out of
    one process and into the next, so its bytes / bandwidth is processor time at both ends
    (``copy`` in ``schedules.simulate``) rather than time on a link. ``overhead`` is the
    runtime's own time per action (bookkeeping, posting messages), which a traced run reports
    (``pipetrain trace``)."""
    host = host or Host()
    shared = host.cores is not None
    w = [0.0] * len(backward) if weight is None else list(weight)
    return simulate(
        pipeline_schedule(schedule, len(forward), microbatches, virtual_stages),
        forward=forward,
        backward=[b - x for b, x in zip(backward, w, strict=True)],
        weight=w,
        transfer=0.0 if shared else message,
        copy=message if shared else 0.0,
        optimizer_step=optimizer_step,
        overhead=host.overhead,
        cores=host.cores,
        validated=True,  # pipeline_schedule validated it
    )


def _make_plan(
    profile: Profile,
    split: Split,
    ranks: Sequence[list[int]],
    schedule: str,
    microbatches: int,
    microbatch_size: int,
    checkpoint: str,
    by_ilp: bool,
    host: Host,
    virtual_stages: int,
    splits: Splits | None = None,
) -> Plan:
    """The Plan of a split, its step predicted by the schedule simulator (once per distinct
    simulation where a search's ``splits`` keeps them)."""
    stages = split.stages
    costs = ([s.forward for s in stages], [s.backward for s in stages],
             [s.message for s in stages[:-1]], [s.allreduce for s in stages],
             [s.weight for s in stages])

    def run() -> Simulation:
        forward, backward, message, allreduce, weight = costs
        return predict(schedule, microbatches, forward, backward, message, allreduce, host,
                       weight=weight, virtual_stages=virtual_stages)

    key = (schedule, microbatches, virtual_stages, host, *map(tuple, costs))
    simulation = run() if splits is None else splits.predicted(key, run)
    step = simulation.step_time
    per_stage = []
    for s, where in zip(stages, ranks, strict=True):
        layers = profile.layers[s.start : s.stop]
        per_stage.append(
            StagePlan(
                layers=(s.start, s.stop),
                ranks=list(where),
                names=[layer.name for layer in layers],
                param_counts=[layer.param_count for layer in layers],
                forward_time=s.forward,
                backward_time=s.backward,
                weight_time=s.weight,
                compute_time=s.compute,
                allreduce_time=s.allreduce,
                transfer_time=s.message,
                transfer_bytes=s.send_bytes,
                memory_bytes=s.memory,
                checkpoint="always" if s.recompute else "never",
            )
        )
    flat = all(len(r) == 1 for r in ranks)
    return Plan(
        schedule=schedule,
        stages=len(stages),
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        checkpoint=checkpoint,
        balance=split.balance,
        stage_to_rank=[r[0] for r in ranks] if flat else [list(r) for r in ranks],
        per_stage=per_stage,
        bottleneck=split.bottleneck,
        step_time=step,
        bubble_fraction=simulation.bubble_fraction,
        samples_per_second=microbatches * microbatch_size / step if step > 0 else math.inf,
        device=profile.device,
        solver="ilp" if by_ilp else "dp",
        host=host,
    )


def cut_layers(balance: Sequence[int]) -> list[int]:
    """The layers after which a split with ``balance`` cuts."""
    return [sum(balance[: t + 1]) - 1 for t in range(len(balance) - 1)]


def stage_costs(
    profile: Profile,
    balance: Sequence[int],
    *,
    microbatches: int,
    schedule: str = DEFAULT_SCHEDULE,
    microbatch_size: int | None = None,
    checkpoint: str = "never",
    bandwidth: float | str | None = None,
    virtual_stages: int = 2,
) -> list[StageCost]:
    """What the planner's cost model says each stage of the split ``balance`` costs per
    micro-batch (a split chosen by hand, e.g. a uniform one, to compare with a plan)."""
    balance = list(balance)
    if not balance or any(b < 1 for b in balance) or sum(balance) != len(profile.layers):
        raise ValueError(
            f"balance {balance} must give every stage at least one layer and cover the "
            f"profile's {len(profile.layers)} layers"
        )
    problem = problem_from_profile(
        profile,
        stages=len(balance),
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        schedule=schedule,
        checkpoint=checkpoint,
        virtual_stages=virtual_stages,
        bandwidth=math.inf if bandwidth is None else parse_bandwidth(bandwidth),
    )
    return evaluate(problem, [0, *(c + 1 for c in cut_layers(balance)), len(profile.layers)])


def simulate_split(
    profile: Profile,
    balance: Sequence[int],
    *,
    microbatches: int,
    schedule: str = DEFAULT_SCHEDULE,
    microbatch_size: int | None = None,
    checkpoint: str = "never",
    bandwidth: float | str | None = None,
    host: Host | None = None,
    virtual_stages: int = 2,
) -> Simulation:
    """The planner's prediction of a split (:func:`partitioner.predict` on
    :func:`stage_costs`), e.g. of a uniform one to compare with a plan."""
    costs = stage_costs(
        profile,
        balance,
        microbatches=microbatches,
        schedule=schedule,
        microbatch_size=microbatch_size,
        checkpoint=checkpoint,
        bandwidth=bandwidth,
        virtual_stages=virtual_stages,
    )
    return predict(
        schedule,
        microbatches,
        [s.forward for s in costs],
        [s.backward for s in costs],
        [s.message for s in costs[:-1]],
        [0.0] * len(costs),
        host,
        weight=[s.weight for s in costs],
        virtual_stages=virtual_stages,
    )
