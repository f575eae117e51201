"""What a stage updates: the weights it owns, their optimizer and learning-rate schedule."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pipetrain.training.compensation import Compensator

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def build_optimizer(
    params: list[nn.Parameter], optimizer: OptimizerFactory | None,
    lr_scheduler: SchedulerFactory | None,
) -> tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LRScheduler | None]:
    """A stage's optimizer of ``params`` (None without a factory or weights) and its
    learning-rate schedule, one stepped per update."""
    built = optimizer(params) if optimizer is not None and params else None
    scheduler = lr_scheduler(built) if lr_scheduler and built is not None else None
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "ReduceLROnPlateau steps on a validation metric, not once per update: call its "
            "step(metric) yourself on pipe.stages[i].optimizer, or pass a per-update "
            "schedule (LambdaLR, CosineAnnealingLR, ...) as lr_scheduler"
        )
    return built, scheduler


class StageOptimizer:
    """The stage's ``owned`` weights (a weight tied to a layer of another stage in this
    process is that stage's to step), their optimizer and its learning-rate schedule."""

    def __init__(
        self, owned: list[nn.Parameter], optimizer: OptimizerFactory | None,
        lr_scheduler: SchedulerFactory | None,
    ):
        self.owned = owned
        self.optimizer, self.scheduler = build_optimizer(owned, optimizer, lr_scheduler)

    def zero_grad(self, keep: bool) -> None:
        """Clear the owned weights' gradients: zeroed in place where ``keep`` (gradients that
        are all-reduce buckets' views or a CUDA graph's buffers), else set to None."""
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=not keep)
            return
        for p in self.owned:
            if p.grad is not None and keep:
                p.grad.zero_()
            else:
                p.grad = None

    def step(self, compensator: Compensator | None = None) -> None:
        """The optimizer step (through ``compensator``, an asynchronous stage's delay
        compensation, if any), then the learning-rate schedule's; nothing without an
        optimizer."""
        if self.optimizer is None:
            return
        (compensator or self.optimizer).step()
        if self.scheduler is not None:
            self.scheduler.step()
