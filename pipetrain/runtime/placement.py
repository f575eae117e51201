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
    ties: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)  # by rank set


def join(
    group: dist.ProcessGroup | None,
    ranks: int,
    replicas: int | None,
    tied_rank_sets: Sequence[tuple[int, ...]],
    timeout: float,
) -> tuple[Placement, Groups]:
    """Place this process among ``ranks`` pipeline ranks per replica and build the groups
    (one per set of ranks sharing a weight too); clear errors for a world of the wrong size."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call pipetrain.init_distributed() under torchrun, or pass "
            "devices=[...] to run every stage in this process"
        )
    members = dist.get_process_group_ranks(group or dist.group.WORLD)
    world = len(members)
    if replicas is None:
        replicas = max(world // ranks, 1)
    if world != ranks * replicas:
        hint = f"--nproc_per_node={ranks}" + (f" (x{replicas} replicas)" if replicas > 1 else "")
        raise ValueError(
            f"world size {world} does not match the {ranks} stages of balance"
            + (f" x {replicas} replicas" if replicas > 1 else "")
            + f"; launch {ranks * replicas} processes, e.g. `torchrun {hint}`, or give balance "
            f"{world} entries"
        )
    me = members.index(dist.get_rank())
    span = timedelta(seconds=timeout)
    pipelines = [dist.new_group(members[k * ranks : (k + 1) * ranks], timeout=span)
                 for k in range(replicas)]
    columns = [dist.new_group(members[r::ranks], timeout=span) for r in range(ranks)] \
        if replicas > 1 else []
    ties = {}
    for rank_set in sorted(set(tied_rank_sets)):
        users = sorted(members[k * ranks + r] for k in range(replicas) for r in rank_set)
        ties[rank_set] = dist.new_group(users, timeout=span)
    replica, rank = divmod(me, ranks)
    groups = Groups(
        global_ranks=members[replica * ranks : (replica + 1) * ranks],
        pipeline=pipelines[replica],
        replicas=columns[rank] if columns else None,
        ties={s: g for s, g in ties.items() if rank in s},
    )
    return Placement((rank,), replica, replicas), groups
