"""The optimizer step that needs the whole model: agreement on skipping, clipping, fp16.

Every synchronous schedule ends each stage's list with its step action, where the executor only
gets the stage's gradients ready; :class:`Update` calls ``Stage.step()`` after the list, because
whether to step at all depends on every stage: a non-finite loss or gradient anywhere skips the
step on every rank. Per step, on the device, without waiting for it where torch allows:

1. fp16: divide every gradient by the loss scale (a device tensor, as in torch.amp.GradScaler).
2. The agreement vector (float64): one entry per stage, the sum of squares of its gradients
   (their norms in fp32 by ``torch._foreach_norm``, as ``torch.nn.utils.clip_grad_norm_``
   computes them), and one for the mini-batch's mean loss. Each rank fills its stages'
   entries, the gradients each replica holds after its all-reduce counted once (each replica
   adds 1/replicas; under ZeRO 2 and 3 each adds its own shard's, sharding.py), a weight tied
   across stages counted once (on the first stage using it);
   one all-reduce sums it over every rank. Every rank then holds the same vector, and in it
   the loss, averaged over replicas: no other message carries it.
3. Any non-finite entry skips the step on every rank: weights, optimizer state and the
   learning-rate schedule are left alone (``skipped_step`` in the metrics). Outside fp16 a
   skip warns, naming the step and the stages, or raises :class:`NonFiniteError` with
   ``nonfinite="raise"``; in fp16 an overflowing gradient is the loss scale's business (halved,
   as GradScaler does) and only a non-finite loss warns.
4. Clip: the gradients are multiplied by ``min(1, max_norm / (norm + 1e-6))``, a device tensor,
   always (as ``clip_grad_norm_`` with foreach does).
5. Each stage's optimizer step, then its learning-rate schedule's.

The host waits for the device once per step (reading whether to skip) only where it must: an
optimizer that cannot skip on the device (only torch's fused ones take a ``found_inf`` tensor),
a learning-rate schedule (a Python object stepped or not), or ``nonfinite="raise"``. Otherwise
the skip happens on the device and the warning comes when the flags have reached the host
(:class:`~pipetrain.runtime.readback.HostCopy`), at the next step or when the metrics are read.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pipetrain.errors import NonFiniteError
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.readback import HostCopy
from pipetrain.runtime.runner import Runner
from pipetrain.runtime.sharding import local, sharded
from pipetrain.runtime.stage import Stage
from pipetrain.training.precision import LossScaler
from schedules import Schedule

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over every rank (identity in one process)


def learning_rate(stages: Sequence[Stage]) -> float | torch.Tensor | None:
    """The first parameter group's learning rate of the first stage here with an optimizer
    (as the optimizer holds it: a tensor learning rate is not read here)."""
    for stage in stages:
        if stage.optimizer is not None:
            lr: float | torch.Tensor = stage.optimizer.param_groups[0]["lr"]
            return lr
    return None


def _stepped(stage: Stage) -> list[nn.Parameter]:
    """The parameters ``stage``'s optimizer steps."""
    if stage.optimizer is None:
        return []
    return [p for group in stage.optimizer.param_groups for p in group["params"]]


def skips_on_device(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer.step`` honours a ``found_inf`` tensor (torch's fused optimizers,
    which GradScaler drives the same way) instead of needing the host to decide."""
    return optimizer is None or bool(getattr(optimizer, "_step_supports_amp_scaling", False))


class Update:
    """The deferred optimizer step of this process's ``stages`` (see the module docstring).

    ``first_user`` maps a weight tied across stages (by id) to the first stage using it;
    ``reduce`` sums a tensor over every rank of every replica (in one process: as is);
    ``count`` is the pipeline's number of stages; ``nonfinite`` "skip" or "raise".
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        max_norm: float | None,
        scaler: LossScaler | None,
        first_user: dict[int, int],
        reduce: Reduce,
        replicas: int = 1,
        count: int | None = None,
        nonfinite: str = "skip",
    ):
        self.stages, self.max_norm, self.scaler = list(stages), max_norm, scaler
        self.reduce, self.replicas, self.nonfinite = reduce, replicas, nonfinite
        self.count = count if count is not None else 1 + max(s.index for s in self.stages)
        self.device = self.stages[0].device  # where the agreement vector lives
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        # found_inf as the host decided it (0.0, 1.0), for the loss scale's update
        self._flags = torch.tensor([0.0, 1.0], device=self.device).unbind()
        self._stepped = [_stepped(s) for s in self.stages]
        self._counted = [
            [p for p in params if first_user.get(id(p), s.index) == s.index]
            for s, params in zip(self.stages, self._stepped, strict=True)
        ]
        # The host must read the skip flag when a step cannot be skipped on the device.
        self.host_decides = nonfinite == "raise" or any(
            s.scheduler is not None or not skips_on_device(s.optimizer) for s in self.stages
        )
        self._unreported: list[tuple[int, HostCopy]] = []

    def loss_scale(self) -> float | torch.Tensor:
        """What the last stage's backward starts from this step: fp16's current loss scale,
        on the last stage's device (a tensor: no wait for the host), else 1."""
        if self.scaler is None:
            return 1.0
        return self.scaler.tensor.to(self.stages[-1].device)

    def train(
        self, runner: Runner, schedule: Schedule, x: object, y: object, step: int
    ) -> tuple[torch.Tensor, dict[str, Any], float, list[Executor]]:
        """Train step ``step`` (counted from 1): ``schedule``'s list, then the optimizer step.
        Returns the loss, the step's metrics, its time and the executors that ran."""
        for stage in self.stages:
            stage.zero_grad()
        start = time.perf_counter()  # zeroing the gradients is no part of the step
        executors = runner.run(schedule, x, y, True, loss_scale=self.loss_scale())
        value, stepped = self.run(step)
        return value, stepped, time.perf_counter() - start, executors

    @torch.no_grad()
    def run(self, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """Step ``step`` (counted from 1): unscale, agree, maybe skip, clip and step. Returns
        the mini-batch's mean loss and the step's metrics, device tensors both."""
        self.report(wait=False)
        scale = self.scaler.tensor.clone() if self.scaler is not None else None
        if scale is not None:
            self._scale_gradients(scale.reciprocal())
        vector = self._agreement()
        total = vector.sum()  # inf or NaN exactly when an entry is
        norm = None
        if self.max_norm is not None:
            norm = vector[: self.count].sum().sqrt()
            self._scale_gradients((self.max_norm / (norm + 1e-6)).clamp(max=1.0).float())
        skipped: bool | torch.Tensor
        if self.host_decides:
            skipped = not math.isfinite(total.item())  # the step's one host sync (docstring)
            found_inf = self._flags[skipped]
            if skipped:
                self._complain(step, vector.tolist())
            else:
                for stage in self.stages:
                    stage.step()
        else:
            found_inf = total.mul(0).nan_to_num(1.0).float()  # 1.0 for inf or NaN, else 0.0
            self._step_on_device(found_inf)
            skipped = found_inf.bool()
            self._unreported.append((step, HostCopy(vector)))
        metrics: dict[str, Any] = {"grad_norm": norm, "skipped_step": skipped}
        if self.scaler is not None:
            metrics["loss_scale"] = scale
            self.scaler.update(found_inf)
        return vector[self.count], metrics

    def report(self, wait: bool) -> None:
        """Warn of the skipped steps whose flags reached the host (``wait``: of all of them,
        waiting for them if need be)."""
        while self._unreported and (wait or self._unreported[0][1].ready()):
            step, copy = self._unreported.pop(0)
            self._complain(step, copy.values())

    def _complain(self, step: int, vector: list[float]) -> None:
        """Warn of (or raise for) skipped step ``step`` from its agreement ``vector``."""
        gradients = [s for s, v in enumerate(vector[: self.count]) if not _finite(v)]
        loss = not _finite(vector[self.count])
        if not loss and (not gradients or self.scaler is not None):
            return  # fine, or an fp16 overflow: the loss scale deals with it
        what = [f"gradients on stage{'s' * (len(gradients) > 1)} "
                f"{', '.join(map(str, gradients))}"] if gradients else []
        what += [f"the loss (stage {self.count - 1})"] if loss else []
        text = f"step {step}: non-finite {' and '.join(what)}"
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"{text}; the step was skipped on every rank (weights and optimizer state "
                "untouched). Check the batch and the learning rate, or pass "
                "Pipeline(nonfinite='skip') to skip such steps with a warning"
            )
        warnings.warn(
            f"{text}: the step was skipped on every rank (weights, optimizer state and "
            "learning-rate schedule untouched); pass Pipeline(nonfinite='raise') to stop "
            "instead", RuntimeWarning, stacklevel=4,
        )

    def _step_on_device(self, found_inf: torch.Tensor) -> None:
        """Every stage's step, which the optimizer itself skips where ``found_inf`` is 1."""
        for stage in self.stages:
            optimizer = stage.optimizer
            if optimizer is None:
                continue
            optimizer.found_inf = found_inf.to(stage.device)  # type: ignore[attr-defined]
            try:
                stage.step()
            finally:
                optimizer.found_inf = None  # type: ignore[attr-defined]

    def _scale_gradients(self, factor: torch.Tensor) -> None:
        for stage, params in zip(self.stages, self._stepped, strict=True):
            grads = [local(p.grad) for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, factor.to(stage.device))

    def _agreement(self) -> torch.Tensor:
        """The agreement vector (module docstring, 2), summed over every rank."""
        entries = [self._zero] * (self.count + 1)
        for stage, params in zip(self.stages, self._counted, strict=True):
            grads = [p.grad for p in params if p.grad is not None]
            for shards in (False, True):  # whole gradients, then shards (ZeRO 2, 3)
                part = [local(g) for g in grads if sharded(g) == shards]
                if not part:
                    continue
                # fp32 norms of every gradient, as clip_grad_norm_ computes them
                norms = torch.stack(torch._foreach_norm(part, 2.0, dtype=torch.float32))
                square = torch.dot(norms, norms).to(self.device)
                if not shards and self.replicas > 1:  # each replica adds 1/replicas of it
                    square = square.double() / self.replicas
                before = entries[stage.index]  # a shard's square: each replica adds its own
                entries[stage.index] = square if before is self._zero else before + square
            if stage.is_last and stage.losses:
                losses = torch.stack(list(stage.losses.values()))
                mean = losses.mean(dtype=torch.float64).to(self.device)
                entries[self.count] = mean / self.replicas if self.replicas > 1 else mean
        return self.reduce(torch.stack(entries).double())


def _finite(value: float) -> bool:
    return value - value == 0
