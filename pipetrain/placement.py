"""Where this process sits: which stage of which replica, and the process groups it talks in.

The world is ``stages x replicas`` ranks, replica-major: replica k's stage s is rank
``k * stages + s``. So consecutive ranks form one pipeline (with one node per replica, stage
messages stay inside a node and only the gradient all-reduce crosses nodes). Every rank creates
every group, in the same order, as torch.distributed requires.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist


@dataclass
class Placement:
    stage: int
    replica: int
    replicas: int
    pipeline_ranks: list[int]  # global rank of each stage of this replica
    pipeline_group: dist.ProcessGroup  # this replica's stages: activations and gradients
    replica_group: dist.ProcessGroup | None  # this stage in every replica: gradient all-reduce
    tie_groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    @property
    def is_coordinator(self) -> bool:
        """The first rank of the first replica: writes checkpoints, prints progress."""
        return self.replica == 0 and self.stage == 0


def join(
    group: dist.ProcessGroup | None,
    stages: int,
    replicas: int | None,
    tied_stage_sets: Sequence[tuple[int, ...]],
    timeout: float,
) -> Placement:
    """Place this process and build the groups; clear errors for a world of the wrong size."""
    if not dist.is_initialized():
        raise RuntimeError(
            "no process group: call pipetrain.init_distributed() under torchrun, or pass "
            "devices=[...] to run every stage in this process"
        )
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    world = len(ranks)
    if replicas is None:
        replicas = max(world // stages, 1)
    if world != stages * replicas:
        hint = f"--nproc_per_node={stages}" + (f" (x{replicas} replicas)" if replicas > 1 else "")
        raise ValueError(
            f"world size {world} does not match the {stages} stages of balance"
            + (f" x {replicas} replicas" if replicas > 1 else "")
            + f"; launch {stages * replicas} processes, e.g. `torchrun {hint}`, or give balance "
            f"{world} entries"
        )
    me = ranks.index(dist.get_rank())
    span = timedelta(seconds=timeout)
    pipelines = [dist.new_group(ranks[k * stages : (k + 1) * stages], timeout=span)
                 for k in range(replicas)]
    columns = [dist.new_group(ranks[s::stages], timeout=span) for s in range(stages)] \
        if replicas > 1 else []
    ties = {}
    for stage_set in sorted(set(tied_stage_sets)):
        members = sorted(ranks[k * stages + s] for k in range(replicas) for s in stage_set)
        ties[stage_set] = dist.new_group(members, timeout=span)
    replica, stage = divmod(me, stages)
    return Placement(
        stage=stage,
        replica=replica,
        replicas=replicas,
        pipeline_ranks=ranks[replica * stages : (replica + 1) * stages],
        pipeline_group=pipelines[replica],
        replica_group=columns[stage] if columns else None,
        tie_groups={s: g for s, g in ties.items() if stage in s},
    )
