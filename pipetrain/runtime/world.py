"""Where a pipeline's ranks run: every rank as a thread of this process, or one torchrun rank.

``Pipeline`` talks to a :class:`World` and never asks which one it has. The World knows which
pipeline ranks run here and on which devices, links them (a :class:`Transport` per rank here),
runs their executors, reduces, gathers and waits across ranks, and says which replica this
process trains. :class:`ThreadWorld` runs every rank here, rank r on ``devices[r]`` (a
LocalHub, a thread pool); :class:`ProcessWorld` is one rank of a torchrun job (its process
groups from pipetrain/runtime/placement.py, a DistributedTransport). A World speaks in pipeline
ranks; which stages a rank holds is the schedule's business.
"""

from __future__ import annotations

import atexit
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence, Set
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.errors import PeerError
from pipetrain.observe.trace import Recorder, measure_clock_offset
from pipetrain.runtime.agreement import check_same
from pipetrain.runtime.collectives import Collectives, rank_names
from pipetrain.runtime.data_parallel import GradientSync, JointSync, Sync, VersionSync
from pipetrain.runtime.distributed import bound_shutdown, local_device
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.placement import Groups, Placement, join
from pipetrain.runtime.tags import CLOCK_TAG
from pipetrain.runtime.transport import DistributedTransport, LocalHub, Transport
from schedules import Schedule, ScheduleSpec

T = TypeVar("T")
SentLoss = tuple[torch.Tensor, "dist.Work | None"]  # a loss on its way to every rank
RankTies = Sequence[tuple[nn.Parameter, tuple[int, ...]]]  # a shared weight, the ranks using it


def pipeline_ranks(
    schedule: ScheduleSpec, stages: int, devices: Sequence[str | torch.device] | None,
    group: dist.ProcessGroup | None, replicas: int | None,
) -> int:
    """How many ranks run the pipeline: one per stage, except for schedules that put several
    stages on a rank, where the devices (or the processes of one replica) count them."""
    if not schedule.multi_stage_per_rank:
        if devices is not None and len(devices) != stages:
            raise ValueError(
                f"devices lists {len(devices)} devices for {stages} stages; give one "
                "device per entry of balance"
            )
        return stages
    if devices is not None:
        ranks = len(devices)
    elif dist.is_initialized():
        ranks = max(dist.get_world_size(group) // (replicas or 1), 1)
    else:
        return stages  # join() explains that there is no process group
    if stages % ranks or stages < ranks:
        chunks = max(stages // ranks, 2)
        raise ValueError(
            f"{schedule.name} with {ranks} ranks x {chunks} chunks needs balance with "
            f"{ranks * chunks} entries (a multiple of {ranks}, one per stage), got {stages}"
        )
    return ranks


class World(ABC):
    """The ranks of one pipeline replica as this process sees them. ``place`` settles
    ``placement`` (the ranks here, the replica) and ``transports`` (one per rank here, in
    ``placement.ranks``' order); the rest needs it done."""

    placement: Placement
    transports: list[Transport]

    def __init__(self, timeout: float):
        self.timeout = timeout  # seconds any wait on another rank may take

    @abstractmethod
    def pipeline_ranks(self, schedule: ScheduleSpec, stages: int) -> int:
        """How many ranks run ``stages`` stages under the schedule of entry ``schedule`` (see
        :func:`pipeline_ranks`)."""

    @property
    @abstractmethod
    def placed(self) -> bool:
        """Whether the ranks are known before ``place`` (devices given, or a process group)."""

    @abstractmethod
    def place(self, schedule: Schedule, tied_stages: Sequence[tuple[int, ...]]) -> None:
        """Settle which ranks run here and link them; ``tied_stages`` lists, per weight shared
        by several stages, those stages."""

    @abstractmethod
    def device(self, rank: int) -> torch.device:
        """The device of rank ``rank`` (one that runs here)."""

    @abstractmethod
    def first_stage(self, schedule: Schedule) -> int | None:
        """The first stage of this process's one rank; None where every rank runs here."""

    @abstractmethod
    def agree(self, settings: Callable[[], dict[str, Any]]) -> None:
        """Refuse to go on unless every rank built the same ``settings()`` (agreement.py)."""

    @abstractmethod
    def gradient_syncs(
        self, owned: Mapping[int, list[nn.Parameter]], ties: RankTies, joint: Set[tuple[int, ...]],
        per_version: bool = False,
    ) -> dict[int, list[Sync]]:
        """Per stage here (``owned``: the parameters each steps), the all-reduces it runs
        before each optimizer step. ``joint``: the sets of ranks whose shared weights some rank
        holds on several of its stages (their reduction waits for all of them).
        ``per_version``: asynchronous stages, whose replicas reduce at each update
        (data_parallel.VersionSync)."""

    def replica_group(self) -> dist.ProcessGroup | None:
        """The group of this rank's copies in every replica (None: one replica); ZeRO shards
        over it (sharding.py)."""
        return None

    def replica_collectives(self) -> Collectives | None:
        """What bounds and names the waits of the collectives over ``replica_group()``
        (collectives.py); None where there is no such group."""
        return None

    @abstractmethod
    def run(
        self, executors: list[Executor], inputs: Sequence[object] | None,
        targets: Sequence[object] | None, training: bool,
    ) -> list[Any]:
        """Run one executor per rank here; return the last rank's outputs."""

    @abstractmethod
    def run_ranks(self, work: Callable[[int, Transport], T]) -> list[T]:
        """``work(rank, transport)`` for each rank here (in ``placement.ranks``' order), each
        on a thread of its own where there are several; their results."""

    @abstractmethod
    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank of every replica, in place."""

    @abstractmethod
    def share_loss(self, loss: torch.Tensor) -> SentLoss:
        """Start handing the last rank's ``loss`` to every rank of the pipeline."""

    @abstractmethod
    def received_loss(self, sent: SentLoss) -> torch.Tensor:
        """The loss ``share_loss`` sent, once here, averaged over replicas."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank of the pipeline gets here."""

    @abstractmethod
    def gather_per_rank(
        self, bubbles: list[float], memory: list[float], peaks: dict[str, float]
    ) -> tuple[list[float], list[float], dict[str, float]]:
        """Each rank's bubble and peak memory, for the progress line (on every rank)."""

    @abstractmethod
    def gather_objects(self, value: Any, what: str, every_replica: bool = False) -> list[Any]:
        """Every process's ``value`` (picklable; ``what``: the check it serves, for errors),
        on every rank: one per process of the
        pipeline in pipeline rank order (``every_replica``: of every replica, in the order of
        their global ranks, the first rank's first); ``[value]`` where every rank runs here."""

    @abstractmethod
    def recorders(
        self, schedule: Schedule, at_exit: Callable[[], object]
    ) -> list[Recorder | None]:
        """One trace recorder per rank here; ``at_exit`` saves them where a process ends
        without its caller saying so (a torchrun rank)."""

    @abstractmethod
    def stop_peers(self, reason: str) -> bool:
        """Stop the ranks of other processes, which raise ``reason`` at their next wait
        instead of waiting out the timeout; whether there were any (then this pipeline has
        stopped for good)."""


class ThreadWorld(World):
    """Every rank in this process, rank r a thread on ``devices[r]``, linked by a LocalHub. A
    weight shared by stages is one tensor here, so no gradient crosses ranks but the
    pipeline's own, and every reduction is the value itself."""

    _hub: LocalHub

    def __init__(self, devices: Sequence[str | torch.device], timeout: float):
        super().__init__(timeout)
        self.devices = list(devices)
        self._pool: ThreadPoolExecutor | None = None

    def pipeline_ranks(self, schedule: ScheduleSpec, stages: int) -> int:
        return pipeline_ranks(schedule, stages, self.devices, None, None)

    @property
    def placed(self) -> bool:
        return True

    def place(self, schedule: Schedule, tied_stages: Sequence[tuple[int, ...]]) -> None:
        hub = LocalHub([torch.device(d) for d in self.devices])
        for stages in tied_stages:
            if len({hub.devices[schedule.rank_of(s)] for s in stages}) > 1:
                raise ValueError(
                    f"stages {list(stages)} share a weight but sit on different devices; "
                    "put them on one device or untie the weight"
                )
        self.placement = Placement(tuple(range(schedule.ranks)))
        self.transports = [hub.endpoint(r) for r in range(schedule.ranks)]
        self._hub, self._pool = hub, ThreadPoolExecutor(schedule.ranks)

    def device(self, rank: int) -> torch.device:
        return self._hub.devices[rank]

    def first_stage(self, schedule: Schedule) -> int | None:
        return None

    def agree(self, settings: Callable[[], dict[str, Any]]) -> None:
        """One process built every stage: nothing to compare."""

    def gradient_syncs(
        self, owned: Mapping[int, list[nn.Parameter]], ties: RankTies, joint: Set[tuple[int, ...]],
        per_version: bool = False,
    ) -> dict[int, list[Sync]]:
        return {s: [] for s in owned}

    def run(
        self, executors: list[Executor], inputs: Sequence[object] | None,
        targets: Sequence[object] | None, training: bool,
    ) -> list[Any]:
        """Each executor on a thread of its own (a new thread computes gradients whatever
        the caller's grad mode); the first failure that is not a peer's reaction to another
        is raised."""
        results = self.run_ranks(lambda rank, transport: executors[rank].run(inputs, targets))
        return results[-1]

    def run_ranks(self, work: Callable[[int, Transport], T]) -> list[T]:
        """The first failure that is not a peer's reaction to another is raised."""
        assert self._pool is not None, "place() comes first"
        futures = [self._pool.submit(work, r, t)
                   for r, t in zip(self.placement.ranks, self.transports, strict=True)]
        errors = [f.exception() for f in futures]
        root = next((e for e in errors if e and not isinstance(e, PeerError)), None)
        if root or any(errors):
            raise root or next(e for e in errors if e)
        return [f.result() for f in futures]

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def share_loss(self, loss: torch.Tensor) -> SentLoss:
        return loss, None

    def received_loss(self, sent: SentLoss) -> torch.Tensor:
        return sent[0]

    def barrier(self) -> None:
        """Every rank is here."""

    def gather_per_rank(
        self, bubbles: list[float], memory: list[float], peaks: dict[str, float]
    ) -> tuple[list[float], list[float], dict[str, float]]:
        return bubbles, memory, peaks

    def gather_objects(self, value: Any, what: str, every_replica: bool = False) -> list[Any]:
        return [value]

    def stop_peers(self, reason: str) -> bool:
        return False  # every rank is here: the caller's error stops them all

    def recorders(
        self, schedule: Schedule, at_exit: Callable[[], object]
    ) -> list[Recorder | None]:
        return [Recorder(r, r, schedule) for r in range(schedule.ranks)]


class ProcessWorld(World):
    """This process as one rank of a torchrun job of ``ranks x replicas`` processes in
    ``group`` (default: the whole world), after every rank agrees on the settings. Weights
    shared across ranks are summed over those ranks; each rank's gradients are averaged over
    its replicas."""

    groups: Groups
    rank: int  # the pipeline rank this process runs

    def __init__(self, group: dist.ProcessGroup | None, replicas: int | None, timeout: float):
        super().__init__(timeout)
        self.group, self.replicas = group, replicas  # the group: every rank of every replica

    def pipeline_ranks(self, schedule: ScheduleSpec, stages: int) -> int:
        return pipeline_ranks(schedule, stages, None, self.group, self.replicas)

    @property
    def placed(self) -> bool:
        return dist.is_initialized()

    def place(self, schedule: Schedule, tied_stages: Sequence[tuple[int, ...]]) -> None:
        rank_sets = [tuple(sorted({schedule.rank_of(s) for s in ss})) for ss in tied_stages]
        cross = [r for r in rank_sets if len(r) > 1]
        self.placement, self.groups = join(
            self.group, schedule.ranks, self.replicas, cross, self.timeout
        )
        self.rank = self.placement.ranks[0]
        self._device = local_device()
        user = self.group or dist.group.WORLD
        assert user is not None, "join() checked that there is a process group"
        others = [g for g in (*self.groups.all(), user) if g is not self.groups.pipeline]
        self._transport = DistributedTransport(
            self.groups.pipeline, self.groups.global_ranks, self._device, others
        )
        self.transports = [self._transport]
        self.collectives = Collectives(
            self._transport, rank_names(schedule, dist.get_process_group_ranks(user),
                                         self.placement.replicas),
            self.timeout,
        )
        bound_shutdown(self.timeout, lambda work: self.collectives.wait(
            work, "pipetrain.shutdown()'s barrier (every rank calls it, last)", user))

    def device(self, rank: int) -> torch.device:
        return self._device

    def first_stage(self, schedule: Schedule) -> int | None:
        return schedule.stages_on(self.rank)[0]

    def agree(self, settings: Callable[[], dict[str, Any]]) -> None:
        check_same(settings(), self.groups.pipeline, self.groups.global_ranks, self.collectives)

    def replica_group(self) -> dist.ProcessGroup | None:
        return self.groups.replicas

    def replica_collectives(self) -> Collectives | None:
        return self.collectives if self.groups.replicas is not None else None

    def gradient_syncs(
        self, owned: Mapping[int, list[nn.Parameter]], ties: RankTies, joint: Set[tuple[int, ...]],
        per_version: bool = False,
    ) -> dict[int, list[Sync]]:
        """One all-reduce per set of ranks sharing weights (summed over those ranks, averaged
        over replicas), one over replicas for each stage's other weights (``per_version``: at
        each update, VersionSync; else overlapping the backward, GradientSync). A set's weights are
        reduced in the order of ``ties``, the same on every rank; where a rank holds them on
        several stages (``joint``), once, when the last of those stages finishes its backward:
        per stage, the ranks would meet in different orders."""
        scale = 1.0 / self.placement.replicas
        stage_of = {id(p): s for s, params in owned.items() for p in params}
        syncs: dict[int, list[Sync]] = {s: [] for s in owned}
        for rank_set, group in self.groups.ties.items():
            shared = [p for p, ranks in ties if id(p) in stage_of and ranks == rank_set]
            users = sorted({stage_of[id(p)] for p in shared})
            if not shared:
                continue
            if rank_set in joint:
                sync = JointSync(GradientSync(shared, group, scale, self.collectives,
                                              overlap=False),
                                 len(users))
                for s in users:
                    syncs[s].append(sync)
            else:
                syncs[users[0]].append(GradientSync(shared, group, scale, self.collectives))
        ranks_of = {id(p): ranks for p, ranks in ties}
        for s, params in owned.items():
            rest = [p for p in params if len(ranks_of.get(id(p), ())) < 2]
            if self.groups.replicas is not None and rest:
                reduce = VersionSync if per_version else GradientSync
                syncs[s].append(reduce(rest, self.groups.replicas, scale, self.collectives))
        return syncs

    def run(
        self, executors: list[Executor], inputs: Sequence[object] | None,
        targets: Sequence[object] | None, training: bool,
    ) -> list[Any]:
        """On this thread, with gradients on when training (a caller's no_grad would drop the
        graph)."""
        with torch.enable_grad() if training else nullcontext():
            return executors[0].run(inputs, targets)

    def run_ranks(self, work: Callable[[int, Transport], T]) -> list[T]:
        return [work(self.rank, self._transport)]

    def sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        work = dist.all_reduce(value, group=self.groups.every, async_op=True)
        self.collectives.wait(work, "the step's agreement (an all-reduce over every rank)",
                              self.groups.every)
        return value

    def share_loss(self, loss: torch.Tensor) -> SentLoss:
        last = self.groups.global_ranks[-1]
        return loss, dist.broadcast(loss, last, group=self.groups.pipeline, async_op=True)

    def received_loss(self, sent: SentLoss) -> torch.Tensor:
        """Raises PeerError (every peer stopped) when the loss does not arrive."""
        value, work = sent
        self.collectives.wait(work, "the loss's broadcast from the last stage",
                              self.groups.pipeline)
        if self.groups.replicas is not None:  # the mean over every replica's batch
            work = dist.all_reduce(value, group=self.groups.replicas, async_op=True)
            self.collectives.wait(work, "the loss's all-reduce over the replicas",
                                  self.groups.replicas)
            value /= self.placement.replicas
        return value

    def barrier(self) -> None:
        work = dist.barrier(group=self.groups.pipeline, async_op=True)
        self.collectives.wait(work, "a barrier of the pipeline's ranks", self.groups.pipeline)

    def stop_peers(self, reason: str) -> bool:
        self._transport.abort(reason)
        return True

    def gather_per_rank(
        self, bubbles: list[float], memory: list[float], peaks: dict[str, float]
    ) -> tuple[list[float], list[float], dict[str, float]]:
        mine = torch.tensor([bubbles[0], memory[0]], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in self.groups.global_ranks]
        work = dist.all_gather(every, mine, group=self.groups.pipeline, async_op=True)
        self.collectives.wait(work, "the progress line's gather of each rank's bubble and "
                              "memory", self.groups.pipeline)
        bubbles, memory = [float(t[0]) for t in every], [float(t[1]) for t in every]
        ranks = self.groups.global_ranks
        return bubbles, memory, {f"rank{r}": m for r, m in zip(ranks, memory, strict=True)}

    def gather_objects(self, value: Any, what: str, every_replica: bool = False) -> list[Any]:
        """In a group of the pipeline's timeout (every: the caller's group's ranks, in its
        order)."""
        group = self.groups.every if every_replica else self.groups.pipeline
        every: list[Any] = [None] * dist.get_world_size(group)
        self.collectives.call(what, [group],
                              lambda: dist.all_gather_object(every, value, group=group))
        return every

    def recorders(
        self, schedule: Schedule, at_exit: Callable[[], object]
    ) -> list[Recorder | None]:
        """One recorder, its clock offset from the first rank's measured now."""
        pipeline = self.groups.pipeline
        offset, latency = self.collectives.call(
            "the trace's clock measurement", [pipeline],
            lambda: measure_clock_offset(pipeline, self.groups.global_ranks, CLOCK_TAG),
        )
        recorder = Recorder(dist.get_rank(), self.rank, schedule, offset, latency)
        atexit.register(at_exit)
        return [recorder]


def make_world(
    devices: Sequence[str | torch.device] | None, group: dist.ProcessGroup | None,
    replicas: int | None, timeout: float,
) -> World:
    """Every rank here on ``devices`` when given, else this process's rank of a torchrun job."""
    if devices is not None:
        return ThreadWorld(devices, timeout)
    return ProcessWorld(group, replicas, timeout)
