"""ZeRO: a stage's training state sharded over its data-parallel replicas, by torch's engines.

Each stage of a ``stages x replicas`` job has ``replicas`` copies, one per replica, joined by
the replica group of placement.py. ``zero`` says what those copies stop repeating:

* 0: nothing (every copy holds every weight, gradient and optimizer state; gradients are
  all-reduced by data_parallel.py).
* 1: the optimizer state. Gradients are still all-reduced whole; torch's
  ``ZeroRedundancyOptimizer`` gives each replica whole parameters to step (about 1/replicas
  of them, by size) and broadcasts the updated ones.
* 2: and the gradients. FSDP2 (``fully_shard`` per layer with weights, on a one-dimensional
  mesh of the replica group) keeps each parameter as a dim-0 shard and reduce-scatters the
  gradients; the weights are gathered at the mini-batch's first forward and kept whole until
  its last backward (``reshard_after_forward=False``).
* 3: and the weights: gathered for each forward and again for each backward, freed after.

Under micro-batching the gradients are reduced once per mini-batch, at the stage's last
backward (``set_requires_gradient_sync``): until then each replica accumulates the whole
gradients of its micro-batches, so at zero 2 and 3 a step holds the stage's whole gradients
from its first backward to its last; the sharded gradients are what stays between steps
(benchmarks/zero_memory.py measures both). The gradients held after the reduce-scatter are
DTensors: update.py reads their local shards for the global norm (each shard counted once),
clips them in place, and the optimizer steps the shards. Checkpoints hold whole tensors
(:class:`Checkpointing`).

A weight tied across stages (an embedding and the head reading it) stays out of the shards at
zero 2 and 3: each copy is whole on every replica, as at zero 0, and its gradient is
all-reduced over the tie's ranks in every replica (data_parallel.GradientSync, summed over the
tied stages, averaged over the replicas), so the copies stay identical. Only the tied weights
are held whole; the rest of the stage is sharded as above.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor

from pipetrain.checkpoints.checkpointing import WholeState
from pipetrain.runtime.stage import OptimizerFactory, Stage
from schedules import Schedule

LEVELS = (0, 1, 2, 3)


def check_level(zero: object) -> int:
    """``zero`` as a level, refused unless it is one of 0, 1, 2, 3."""
    if isinstance(zero, bool) or zero not in LEVELS:
        raise ValueError(
            f"zero must be 0 (replicas hold everything), 1 (shard the optimizer state), 2 (and "
            f"the gradients) or 3 (and the weights), got {zero!r}"
        )
    return int(zero)


def refusal(zero: int, schedule: Schedule, cuda_graphs: bool) -> str | None:
    """Why this pipeline cannot shard at level ``zero`` yet (None: it can)."""
    if zero == 0:
        return None
    if schedule.asynchronous:
        return (
            f"zero={zero} with schedule {schedule.name!r} is not supported: the asynchronous "
            "schedules run without data-parallel replicas; use a synchronous schedule"
        )
    if zero >= 2 and schedule.splits_backward:
        return (
            f"zero={zero} with schedule {schedule.name!r} is not supported yet: its split "
            "backward computes weight gradients (W) in a second pass after the input "
            "gradients (B), and FSDP2 gathers a layer's weights for one backward pass and "
            "reduce-scatters when it ends, so W would reach neither (docs/zero.md); use "
            "zero=1 or a schedule without W (1f1b, gpipe, interleaved-1f1b)"
        )
    if zero >= 2 and cuda_graphs:
        return (
            f"zero={zero} with cuda_graphs is not supported: a captured graph cannot gather "
            "sharded weights; pass cuda_graphs=False or zero=1"
        )
    return None


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This replica's shard of ``tensor`` (a DTensor), or ``tensor`` itself: in place ops on
    it change the DTensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one replica's shard of a DTensor (each shard to count once)."""
    return isinstance(tensor, DTensor)


def zero_redundancy(factory: OptimizerFactory, group: dist.ProcessGroup) -> OptimizerFactory:
    """The optimizer of ``factory`` with its state sharded over ``group`` (zero=1): torch's
    ZeroRedundancyOptimizer of the same class, parameter groups and settings."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        plain = factory(params)
        accepted = inspect.signature(type(plain).__init__).parameters
        defaults = {k: v for k, v in plain.defaults.items() if k in accepted}
        groups = [dict(g) for g in plain.param_groups]
        return ZeroRedundancyOptimizer(
            groups, optimizer_class=type(plain), process_group=group, **defaults
        )

    return build


class ShardedGradients:
    """FSDP2 on one stage's layers (zero 2 or 3), with data_parallel.GradientSync's two calls:
    ``arm`` before the stage's last backward of the mini-batch (reduce-scatter its gradients
    there; at zero 2 also free the gathered weights after it), ``finish`` before the step.
    ``whole``: weights tied across stages, left out of the shards (module docstring).
    ``bring_up(i)`` gives a meta model's layer i its values just before it is sharded, so a
    rank holds one whole layer at a time besides its shards."""

    def __init__(
        self, module: nn.Module, group: dist.ProcessGroup, zero: int, device: torch.device,
        bring_up: Callable[[int], object] | None = None,
        whole: Collection[nn.Parameter] = (),
    ):
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        self.keep_gathered = zero == 2
        kept = set(whole)  # weights tied across stages: whole on every replica (tied_syncs)
        for index, layer in enumerate(module.children()):
            if bring_up is not None:
                bring_up(index)
            if any(p.requires_grad and p not in kept for p in layer.parameters()):
                fully_shard(layer, mesh=mesh, reshard_after_forward=zero == 3,
                            ignored_params=kept or None)
        fully_shard(module, mesh=mesh, reshard_after_forward=zero == 3,
                    ignored_params=kept or None)
        self.module: FSDPModule = module  # type: ignore[assignment]
        self._accumulate()

    def _accumulate(self) -> None:
        """Until armed, backwards add to each replica's whole gradients, not reduced."""
        self.module.set_requires_gradient_sync(False)
        if self.keep_gathered:
            self.module.set_reshard_after_backward(False)

    def arm(self) -> None:
        self.module.set_requires_gradient_sync(True)
        if self.keep_gathered:
            self.module.set_reshard_after_backward(True)

    def finish(self) -> None:
        """FSDP2 waited for its reduce-scatters when the last backward ended; back to
        accumulating for the next mini-batch."""
        self._accumulate()


class Checkpointing:
    """A sharded pipeline's checkpoints hold whole tensors, as an unsharded one's do, so they
    load under any balance, replica count or ``zero``: ``whole`` gathers each stage's state
    from its replicas before the first replica writes it; ``shard`` gives a sharded stage its
    shares of the whole tensors read back."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group

    def whole(self, stages: Sequence[Stage]) -> list[WholeState]:
        """Per stage, its module and optimizer state_dicts whole (on the first replica; the
        optimizer's is None elsewhere). Every replica calls it: it gathers."""
        states: list[WholeState] = []
        for stage in stages:
            module = {k: _full(v) for k, v in stage.module.state_dict().items()}
            optimizer = stage.optimizer
            state: dict[str, Any] | None = None
            if isinstance(optimizer, ZeroRedundancyOptimizer):
                optimizer.consolidate_state_dict(to=0)  # to the first replica, by group rank
                if dist.get_rank(self.group) == 0:
                    state = optimizer.state_dict()
                    # torch keeps the gathered copy, a whole optimizer state: drop it
                    optimizer._all_state_dicts = []  # type: ignore[attr-defined]
            elif optimizer is not None:
                state = optimizer.state_dict()
                state["state"] = {
                    i: {k: _full(v) for k, v in s.items()} for i, s in state["state"].items()
                }
            states.append((module, state))
        return states

    @staticmethod
    def shard(
        stage: Stage, modules: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``modules`` and ``optimizer_state`` (by parameter name) with ``stage``'s whole
        tensors replaced by its shares, placed as its parameters are (no communication:
        every replica read the whole tensors)."""
        modules, optimizer_state = dict(modules), dict(optimizer_state)
        for key, value in stage.module.state_dict().items():
            if isinstance(value, DTensor) and key in modules:
                modules[key] = _like(value, modules[key])
        for name, param in stage.module.named_parameters():
            if isinstance(param, DTensor) and name in optimizer_state:
                optimizer_state[name] = {
                    k: _like(param, v) if isinstance(v, torch.Tensor) and v.shape == param.shape
                    else v
                    for k, v in optimizer_state[name].items()
                }
        return modules, optimizer_state


def _full(value: object) -> object:
    """``value`` whole: a DTensor gathered from its shards (a collective), else as it is."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def _like(sharded: DTensor, whole: torch.Tensor) -> DTensor:
    """This rank's share of ``whole``, placed as ``sharded`` is."""
    return distribute_tensor(
        whole.to(sharded.device), sharded.device_mesh, sharded.placements, src_data_rank=None
    )
