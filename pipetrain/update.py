"""The optimizer step that needs the whole model: fp16 unscaling and skipping, global clipping.

A synchronous schedule ends each stage's list with its optimizer step. When the step depends on
every stage's gradients (a clip by the norm of the whole model, or fp16's overflow check), the
stages defer it (``Stage.defer_update``) and :class:`Update` runs it after the list:

1. fp16: divide every gradient by the loss scale.
2. The global gradient norm: each stage's sum of squares in float64, summed over this process's
   stages and all-reduced over every rank, with the gradients each replica holds after its
   all-reduce counted once (each replica adds 1/replicas of its sum) and a weight tied across
   stages counted once (on the first stage that uses it). Every rank gets the same norm.
3. fp16: a non-finite norm is an overflow on some rank: no rank steps (the optimizer and the
   learning-rate schedule are left alone) and every scaler halves its scale.
4. Clip: multiply the gradients by ``max_norm / (norm + 1e-6)`` when that is below 1, as
   ``torch.nn.utils.clip_grad_norm_`` does.
5. Each stage's optimizer step, then its learning-rate schedule's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from pipetrain.precision import LossScaler, autocast_dtype
from pipetrain.stage import Stage

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over every rank (identity in one process)


def learning_rate(stages: Sequence[Stage]) -> float | None:
    """The first parameter group's learning rate of the first stage here with an optimizer."""
    for stage in stages:
        if stage.optimizer is not None:
            return float(stage.optimizer.param_groups[0]["lr"])
    return None


def _stepped(stage: Stage) -> list[nn.Parameter]:
    """The parameters ``stage``'s optimizer steps."""
    if stage.optimizer is None:
        return []
    return [p for group in stage.optimizer.param_groups for p in group["params"]]


class Update:
    """The deferred optimizer step of this process's ``stages`` (see the module docstring).

    ``first_user`` maps a weight tied across stages (by id) to the first stage using it;
    ``reduce`` sums a float64 tensor over every rank of every replica (in one process: as is).
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        max_norm: float | None,
        scaler: LossScaler | None,
        first_user: dict[int, int],
        reduce: Reduce,
        replicas: int = 1,
    ):
        self.stages, self.max_norm, self.scaler = list(stages), max_norm, scaler
        self.reduce, self.replicas = reduce, replicas
        self._counted = [
            [p for p in _stepped(s) if first_user.get(id(p), s.index) == s.index]
            for s in self.stages
        ]
        for stage in self.stages:
            stage.defer_update = True

    def begin(self) -> None:
        """Before the backward: the last stage starts it from the current loss scale."""
        if self.scaler is not None:
            for stage in self.stages:
                stage.loss_scale = self.scaler.scale

    @torch.no_grad()
    def run(self) -> dict[str, Any]:
        """Unscale, measure, maybe skip, clip and step; returns the step's metrics."""
        scaler = self.scaler
        if scaler is not None:
            self._scale_gradients(1.0 / scaler.scale)
        norm = self._global_norm()
        skipped = scaler is not None and not math.isfinite(norm)
        if not skipped:
            if self.max_norm is not None:
                coefficient = self.max_norm / (norm + 1e-6)
                if coefficient < 1.0:
                    self._scale_gradients(coefficient)
            for stage in self.stages:
                stage.update()
        metrics: dict[str, Any] = {"grad_norm": norm}
        if scaler is not None:
            metrics.update(loss_scale=scaler.scale, skipped_step=skipped)
            scaler.update(found_inf=skipped)
        return metrics

    def _scale_gradients(self, factor: float) -> None:
        for stage in self.stages:
            grads = [p.grad for p in _stepped(stage) if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor)

    def _global_norm(self) -> float:
        device = self.stages[0].device
        local = torch.zeros((), dtype=torch.float64, device=device)
        for params in self._counted:
            grads = [p.grad for p in params if p.grad is not None]
            if grads:  # one sum per stage, on its device; one transfer per stage
                norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64)
                                     for g in grads])
                local += norms.square().sum().to(device)
        return math.sqrt(float(self.reduce(local / self.replicas)))


def check_options(
    optimizer: object, lr_scheduler: object, precision: str, max_norm: float | None,
    schedule: str, asynchronous: bool,
) -> torch.dtype | None:
    """Refuse what the step cannot do, naming the alternative; return the autocast dtype."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer is an optimizer instance, but each stage builds its own from its "
            "parameters: pass a factory: optimizer=lambda params: torch.optim.SGD(params, ...)"
        )
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"optimizer must be a factory of the stage's parameters, got "
            f"{type(optimizer).__name__}: optimizer=lambda params: torch.optim.SGD(params, ...)"
        )
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler | ReduceLROnPlateau) or (
        lr_scheduler is not None and not callable(lr_scheduler)
    ):
        raise TypeError(
            "lr_scheduler must be a factory of each stage's optimizer, got "
            f"{type(lr_scheduler).__name__}: pass lr_scheduler=lambda optimizer: "
            "torch.optim.lr_scheduler.LambdaLR(optimizer, ...)"
        )
    if lr_scheduler is not None and optimizer is None:
        raise ValueError("lr_scheduler schedules the optimizer's learning rate: pass optimizer=")
    dtype = autocast_dtype(precision)
    if max_norm is not None and (
        isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0
    ):
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {max_norm!r}")
    if asynchronous and precision == "fp16":
        raise ValueError(
            f"precision='fp16' needs every stage to skip the same update on an overflow, but "
            f"schedule {schedule!r} updates each stage at its own time: use precision='bf16' "
            "(no loss scaling), or a synchronous schedule such as '1f1b' with fp16"
        )
    if asynchronous and max_norm is not None:
        raise ValueError(
            f"clip_grad_norm needs the whole model's gradients of one update, but schedule "
            f"{schedule!r} updates each stage at its own time: use a synchronous schedule "
            "such as '1f1b' or 'interleaved' to clip, or drop clip_grad_norm"
        )
    return dtype
