"""Where this process sits: which pipeline ranks it runs, of which replica, and, under torchrun,
the process groups it talks in.

The world is ``ranks x replicas`` processes, replica-major: replica k's pipeline rank r is
global rank ``k * ranks + r``. So consecutive ranks form one pipeline (with one node per
replica, stage messages stay inside a node and only the gradient all-reduce crosses nodes).
Every rank creates every group, in the same order, as torch.distributed requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from pipetrain.errors import CommunicationTimeout
from pipetrain.runtime.distributed import EXIT_WAIT, bound_exit, exit_if_stuck, quiet_io_threads


@dataclass(frozen=True)
class Placement:
    """The pipeline ranks this process runs (all of them when every rank is a thread here, one
    under torchrun) and the replica they belong to."""

    ranks: tuple[int, ...]
    replica: int = 0
    replicas: int = 1

    @property
    def is_coordinator(self) -> bool:
        """Whether this process runs the first rank of the first replica: it writes
        checkpoints and prints progress."""
        return self.replica == 0 and 0 in self.ranks


@dataclass
class Groups:
    """The process groups of one torchrun rank."""

    global_ranks: list[int]  # the global rank of each pipeline rank of this replica
    pipeline: dist.ProcessGroup  # this replica's ranks: activations and gradients
    replicas: dist.ProcessGroup | None  # this rank in every replica: gradient all-reduce
    every: dist.ProcessGroup  # every rank of every replica, a group of its own: AGREE
    ties: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)  # by rank set

    def all(self) -> list[dist.ProcessGroup]:
        """Every group here, each once."""
        found = [self.pipeline, self.every, self.replicas, *self.ties.values()]
        return list({id(g): g for g in found if g is not None}.values())


def _wrong_world(world: int, ranks: int, replicas: int | None) -> str:
    """Why ``world`` processes cannot run ``ranks`` ranks per pipeline x ``replicas`` (None:
    as many as fit), and the fixes, replicas counted."""
    if replicas is None:  # replicas = world // ranks: any multiple of ranks would do
        divisors = [k for k in range(1, world + 1) if world % k == 0]
        return (
            f"world size {world} does not match the {ranks} stages of balance: each replica of "
            f"the pipeline takes {ranks} processes, so launch a multiple of {ranks} (`torchrun "
            f"--nproc_per_node={ranks}` for one pipeline, {2 * ranks} for 2 replicas), or give "
            "balance a number of entries "
            f"that divides {world} ({divisors}; {world} // entries replicas), e.g. {world} "
            "entries for one pipeline"
        )
    refit = (
        f"or give balance {world // replicas} entries ({replicas} replicas x "
        f"{world // replicas} stages = {world})" if world % replicas == 0
        else f"or pass a number of replicas that divides {world}"
    )
    return (
        f"world size {world} does not match the {ranks} stages of balance x {replicas} "
        f"replicas (replicas={replicas}): launch {ranks * replicas} processes, e.g. `torchrun "
        f"--nproc_per_node={ranks * replicas}` on one node, {refit}"
    )


def join(
    group: dist.ProcessGroup | None,
    ranks: int,
    replicas: int | None,
    tied_rank_sets: Sequence[tuple[int, ...]],
    timeout: float,
) -> tuple[Placement, Groups]:
    """Place this process among ``ranks`` pipeline ranks per replica and build the groups
    (one per set of ranks sharing a weight too); clear errors for a world of the wrong size,
    and for a rank that does not take part in creating the groups within ``timeout``."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call pipetrain.init_distributed() under torchrun, or pass "
            "devices=[...] to run every stage in this process"
        )
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    world = len(members)
    if world != ranks * (replicas or max(world // ranks, 1)):
        raise ValueError(_wrong_world(world, ranks, replicas))
    replicas = replicas or world // ranks
    me = members.index(dist.get_rank())
    replica, rank = divmod(me, ranks)
    stuck = CommunicationTimeout(_not_joined(members, timeout, (
        f"torch's wait on the rendezvous store went on {EXIT_WAIT:g} s past it: the store's "
        "host, rank 0 under torchrun, may be the rank that stopped")))
    try:
        with exit_if_stuck(timeout + EXIT_WAIT, stuck):
            return Placement((rank,), replica, replicas), _new_groups(
                members, ranks, replicas, tied_rank_sets, timedelta(seconds=timeout), me)
    except RuntimeError as error:  # DistStoreError, gloo's: a rank did not get there
        bound_exit()  # the groups half made may hold the exit
        raise CommunicationTimeout(_not_joined(members, timeout, str(error))) from error


def _not_joined(members: list[int], timeout: float, error: str) -> str:
    """Why creating the groups of ``members`` failed (``error``: torch's words)."""
    return (
        f"rank {dist.get_rank()}: creating the pipeline's process groups (every rank of "
        f"{members} creates each, in the same order, while building its Pipeline) did not "
        f"complete within timeout={timeout:g} s: a rank never got there. It died, hangs, "
        "failed before building its Pipeline (see its log) or builds one with another "
        "balance, replicas or schedule; start every rank with the same script and settings, "
        f"or raise Pipeline(timeout=...) if one is only slow to get there. ({error})"
    )


def _new_groups(
    members: list[int], ranks: int, replicas: int, tied_rank_sets: Sequence[tuple[int, ...]],
    span: timedelta, me: int,
) -> Groups:
    """The groups of :func:`join` for the process at index ``me`` of ``members``, each
    created with the timeout ``span``.

    The groups that carry the schedule's messages and gradient reductions get quiet I/O
    threads (distributed.quiet_io_threads: they never preempt the compute). The agreement's
    group does not, and is one of its own even with one replica: every rank waits in AGREE,
    so nothing computes that its I/O could preempt, while an idle-class I/O thread on a core
    another process keeps busy (a data loader's worker, a neighbour job) would wake only
    when that process yields, late by milliseconds on the step's critical path (measured:
    benchmarks/hf_throughput.py's late rank waited 3-8 ms in AGREE's all-reduce against
    0.9 ms in a group of normal I/O threads, with a helper's tests on the machine)."""
    with quiet_io_threads():
        pipelines = [dist.new_group(members[k * ranks : (k + 1) * ranks], timeout=span)
                     for k in range(replicas)]
        columns = [dist.new_group(members[r::ranks], timeout=span) for r in range(ranks)] \
            if replicas > 1 else []
        ties = {}
        for rank_set in sorted(set(tied_rank_sets)):
            users = sorted(members[k * ranks + r] for k in range(replicas) for r in rank_set)
            ties[rank_set] = dist.new_group(users, timeout=span)
    # the step's agreement in a group of the step's timeout, not the caller's (whose
    # default, 600 s, a collective stuck on a stopped peer would wait out at exit)
    every = dist.new_group(members, timeout=span)
    replica, rank = divmod(me, ranks)
    return Groups(
        global_ranks=members[replica * ranks : (replica + 1) * ranks],
        pipeline=pipelines[replica],
        replicas=columns[rank] if columns else None,
        every=every,
        ties={s: g for s, g in ties.items() if rank in s},
    )
