"""``plan()``: from a profile and a cluster to a Plan, with the step it predicts; and the costs
and prediction of a split chosen by hand (:func:`stage_costs`, :func:`simulate_split`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import networkx as nx

from partitioner.costs import StageCost, evaluate, problem_from_profile
from partitioner.dp import Split, solve
from partitioner.ilp import solve_ilp
from partitioner.plans import Host, Plan, StagePlan
from partitioner.profile import Profile
from partitioner.topology import chain_order, is_uniform, link_bandwidths, memory_of, speed_of
from partitioner.units import parse_bandwidth, parse_bytes
from schedules import Simulation, build, simulate

SOLVERS = ("auto", "dp", "ilp")


def _min_cap(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else min(a, b)


def plan(
    profile: Profile,
    *,
    stages: int,
    microbatches: int,
    schedule: str = "1f1b",
    memory: int | str | None = None,
    bandwidth: float | str | None = None,
    devices: int | nx.Graph | None = None,
    checkpoint: str = "never",
    microbatch_size: int | None = None,
    solver: str = "auto",
    cores: int | None = None,
    overhead: float = 0.0,
) -> Plan:
    """Split ``profile`` into ``stages`` stages for ``microbatches`` micro-batches per step.

    ``memory``: bytes per device (``"16GiB"`` works too), None for no cap. ``bandwidth``: bytes/s
    between stages (``"25GB/s"``), None for free communication. ``devices``: None (one device per
    stage), an int >= ``stages`` (identical devices; stages may be replicated) or a device graph
    from :mod:`partitioner.topology` with one device per stage (identical devices: DP with every
    link's own bandwidth; unlike devices: integer program). ``microbatch_size`` defaults to the
    profile's batch size. Raises InfeasibleError when nothing fits, naming the cap that would.

    ``cores`` and ``overhead`` change the prediction, not the split (see :func:`predict`): the
    stages are processes sharing ``cores`` processors of one host (a CPU machine), and the
    runtime spends ``overhead`` seconds of its own per action.
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
    if isinstance(devices, nx.Graph):
        if devices.number_of_nodes() != stages:
            raise ValueError(
                f"a device graph must have one device per stage ({stages}), it has "
                f"{devices.number_of_nodes()}; pass devices=<int> to replicate stages"
            )
        order = chain_order(devices)
        speed = [speed_of(devices, r) for r in order]
        caps = [_min_cap(cap, memory_of(devices, r)) for r in order]
        links = link_bandwidths(devices, order)
        ranks = [[r] for r in order]
        use_ilp = use_ilp or (solver == "auto" and not is_uniform(devices))
    problem = problem_from_profile(
        profile,
        stages=stages,
        microbatches=microbatches,
        microbatch_size=microbatch_size,
        schedule=schedule,
        checkpoint=checkpoint,
        speed=speed,
        memory=caps,
        bandwidth=links,
        devices=count,
    )
    split = solve_ilp(problem) if use_ilp else solve(problem)
    if not ranks:
        first = [sum(split.replicas[:t]) for t in range(stages)]
        ranks = [list(range(a, a + r)) for a, r in zip(first, split.replicas, strict=True)]
    size = profile.batch_size if microbatch_size is None else microbatch_size
    host = Host(cores, overhead)
    return _make_plan(
        profile, split, ranks, schedule, microbatches, size, checkpoint, use_ilp, host
    )


def predict(
    schedule: str,
    microbatches: int,
    forward: Sequence[float],
    backward: Sequence[float],
    message: Sequence[float],
    optimizer_step: Sequence[float],
    host: Host | None = None,
) -> Simulation:
    """The planner's prediction of one step: ``schedule`` simulated on per-stage costs
    (``message``: per boundary, the seconds one activation takes at the link's bandwidth).

    On a ``host`` with ``cores`` the stages are processes sharing that many processors: they run
    slower while more stages run than there are cores, and a message is a memory copy out of
    one process and into the next, so its bytes / bandwidth is processor time at both ends
    (``copy`` in ``schedules.simulate``) rather than time on a link. ``overhead`` is the
    runtime's own time per action (bookkeeping, posting messages), which a traced run reports
    (``pipetrain trace``)."""
    host = host or Host()
    shared = host.cores is not None
    return simulate(
        build(schedule, len(forward), microbatches),
        forward=forward,
        backward=backward,
        transfer=0.0 if shared else message,
        copy=message if shared else 0.0,
        optimizer_step=optimizer_step,
        overhead=host.overhead,
        cores=host.cores,
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
) -> Plan:
    """The Plan of a split, its step predicted by the schedule simulator."""
    stages = split.stages
    simulation = predict(
        schedule,
        microbatches,
        [s.forward for s in stages],
        [s.backward for s in stages],
        [s.message for s in stages[:-1]],
        [s.allreduce for s in stages],
        host,
    )
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
                compute_time=s.compute,
                allreduce_time=s.allreduce,
                transfer_time=s.message,
                transfer_bytes=s.send_bytes,
                memory_bytes=s.memory,
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
    schedule: str = "1f1b",
    microbatch_size: int | None = None,
    checkpoint: str = "never",
    bandwidth: float | str | None = None,
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
        bandwidth=math.inf if bandwidth is None else parse_bandwidth(bandwidth),
    )
    return evaluate(problem, [0, *(c + 1 for c in cut_layers(balance)), len(profile.layers)])


def simulate_split(
    profile: Profile,
    balance: Sequence[int],
    *,
    microbatches: int,
    schedule: str = "1f1b",
    microbatch_size: int | None = None,
    checkpoint: str = "never",
    bandwidth: float | str | None = None,
    host: Host | None = None,
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
    )
    return predict(
        schedule,
        microbatches,
        [s.forward for s in costs],
        [s.backward for s in costs],
        [s.message for s in costs[:-1]],
        [0.0] * len(costs),
        host,
    )
