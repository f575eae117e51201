"""The synchronous step, as the actions that end every synchronous list: REDUCE, AGREE, STEP.

Whether to step at all depends on every stage: a non-finite loss or gradient anywhere skips the
step on every rank. So a synchronous rank's list ends with REDUCE of each of its stages (the
executor finishes its sends; the stage's gradient all-reduces, armed as its last backward made
the gradients, finish: :meth:`Update.reduce`), then one AGREE (:meth:`Update.agree`), then STEP
of each stage (:meth:`Update.update`). :class:`Update` is the step handler of this process's
executors (pipetrain/runtime/handler.py). Where one process runs every rank (threads), each
rank's AGREE meets the others here and the last to arrive agrees for every stage, whose
gradients are all final then; the others wait for it (bounded by the pipeline's timeout, and
stopped early when a peer fails). Where each process runs one rank, its AGREE agrees at once
and the all-reduce below is the meeting of the ranks. The agreement, per step, on the device,
without waiting for it where torch allows:

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
5. fp16: the loss scale's update (once per step). Then, in each STEP, the stage's optimizer
   step and its learning-rate schedule's, unless the step is skipped.

The host waits for the device once per step (reading whether to skip) only where it must: an
optimizer that cannot skip on the device (only torch's fused ones take a ``found_inf`` tensor),
a learning-rate schedule (a Python object stepped or not), or ``nonfinite="raise"``. Otherwise
the skip happens on the device and the warning comes when the flags have reached the host
(:class:`~pipetrain.runtime.readback.HostCopy`), at the next step or when the metrics are read.
A step the host skipped is warned of (or raises NonFiniteError on every rank) when the list is
done (:meth:`Update.result`): every rank ends its list, so the pipeline goes on after it.
"""

from __future__ import annotations

import math
import threading
import time
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pipetrain.errors import CommunicationTimeout, NonFiniteError, PeerError
from pipetrain.runtime.handler import WithinCall
from pipetrain.runtime.readback import HostCopy
from pipetrain.runtime.sharding import local, sharded
from pipetrain.runtime.stage import Stage
from pipetrain.training.precision import LossScaler
from schedules import Schedule, with_early_weights, with_step_tail

Reduce = Callable[[torch.Tensor], torch.Tensor]  # sum over every rank (identity in one process)
WAIT_POLL = 0.05  # seconds between a waiting AGREE's looks at its peers


def learning_rate(stages: Sequence[Stage]) -> float | torch.Tensor | None:
    """The first parameter group's learning rate of the first stage here with an optimizer
    (as the optimizer holds it: a tensor learning rate is not read here)."""
    for stage in stages:
        if stage.optimizer is not None:
            lr: float | torch.Tensor = stage.optimizer.param_groups[0]["lr"]
            return lr
    return None


def stepped_parameters(stage: Stage) -> list[nn.Parameter]:
    """The parameters ``stage``'s optimizer steps."""
    if stage.optimizer is None:
        return []
    return [p for group in stage.optimizer.param_groups for p in group["params"]]


def skips_on_device(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer.step`` honours a ``found_inf`` tensor (torch's fused optimizers,
    which GradScaler drives the same way) instead of needing the host to decide."""
    return optimizer is None or bool(getattr(optimizer, "_step_supports_amp_scaling", False))


@dataclass
class _Round:
    """One step's meeting of this process's AGREE actions: the stages arrived so far, and,
    once the last has agreed for all of them, whether that failed."""

    arrived: set[int] = field(default_factory=set)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Update(WithinCall):
    """The synchronous step of this process's ``stages`` (see the module docstring): the step
    handler of their lists (pipetrain/runtime/handler.py), shared by this process's executors.

    ``max_norm`` clips, ``scaler`` is fp16's loss scale; ``first_user`` maps a weight tied
    across stages (by id) to the first stage using it; ``reduce`` sums a tensor over every rank
    of every replica (None: one process holds every rank, the value is the sum);
    ``replicas`` counts the pipeline's replicas; ``nonfinite`` "skip" or "raise".
    """

    def __init__(
        self,
        stages: Sequence[Stage],
        max_norm: float | None = None,
        scaler: LossScaler | None = None,
        first_user: dict[int, int] | None = None,
        reduce: Reduce | None = None,
        replicas: int = 1,
        nonfinite: str = "skip",
    ):
        self.stages, self.max_norm, self.scaler = list(stages), max_norm, scaler
        self.sum_over_ranks, self.replicas, self.nonfinite = reduce, replicas, nonfinite
        self.count = self.stages[0].count  # the pipeline's stages: the agreement vector's
        self.device = self.stages[0].device  # where the agreement vector lives
        self._zero = torch.zeros((), dtype=torch.float64, device=self.device)
        # found_inf as the host decided it (0.0, 1.0), for the loss scale's update
        self._flags = torch.tensor([0.0, 1.0], device=self.device).unbind()
        self._stepped = [stepped_parameters(s) for s in self.stages]
        ties = first_user or {}
        self._counted = [
            [p for p in params if ties.get(id(p), s.index) == s.index]
            for s, params in zip(self.stages, self._stepped, strict=True)
        ]
        # The host must read the skip flag when a step cannot be skipped on the device.
        self.host_decides = nonfinite == "raise" or any(
            s.scheduler is not None or not skips_on_device(s.optimizer) for s in self.stages
        )
        self._unreported: list[tuple[int, HostCopy]] = []
        self._indices = {s.index for s in self.stages}
        self._lock = threading.Lock()
        self._round = _Round()
        self._step = 0  # the step being trained (counted from 1)
        self._skip: bool | None = None  # the host's decision (None: the device's, found_inf)
        self._found_inf: torch.Tensor | None = None
        self._result: tuple[torch.Tensor, dict[str, Any]] | None = None
        self._complaint: str | None = None  # a skipped step's warning or error, said after
        self._list: tuple[Schedule, Schedule] | None = None  # a schedule, the list run for it

    def call_list(self, schedule: Schedule) -> Schedule:
        """The list this process trains ``schedule`` with: closed by the whole step (an older
        hand-written list closed by its STEPs alone gets its REDUCEs and AGREE,
        :func:`schedules.with_step_tail`), and with an early W (schedules/early.py)
        for each stage here whose last backward the previous stage, on another rank, waits
        for to run its own last backward. Sending first takes the weight-gradient half of the
        backward off the pipeline's drain, once per stage boundary (the two halves cost about
        one whole backward when the forward was cut; the cut is made for this micro-batch
        only). Not where the schedule places W itself (zero bubble) or a CUDA graph replays
        the backward."""
        if self._list is None or self._list[0] is not schedule:
            early = [
                s.index for s in self.stages
                if not s.is_first and not schedule.local(s.index, s.index - 1)
                and s.graphs is None
            ]
            listed = with_step_tail(schedule)
            if early and not schedule.splits_backward:
                listed = with_early_weights(listed, early)
            self._list = schedule, listed
        return self._list[1]

    def loss_scale(self) -> float | torch.Tensor:
        """What the last stage's backward starts from this step: fp16's current loss scale,
        on the last stage's device (a tensor: no wait for the host), else 1."""
        if self.scaler is None:
            return 1.0
        return self.scaler.tensor.to(self.stages[-1].device)

    def begin(self, step: int) -> None:
        """Before step ``step``'s list (counted from 1): clear the gradients, and warn of the
        earlier skipped steps whose flags reached the host."""
        self.report(wait=False)
        for stage in self.stages:
            stage.zero_grad()
        self._step, self._result, self._complaint = step, None, None

    def result(self) -> tuple[torch.Tensor, dict[str, Any]]:
        """After the list: the mini-batch's mean loss and the step's metrics, device tensors
        both; a step the host skipped is warned of (or raises NonFiniteError) here."""
        if self._complaint is not None:
            self._say(self._complaint)
        assert self._result is not None, "the list ran AGREE"
        return self._result

    def reduce(self, stage: Stage) -> None:
        """REDUCE: wait for ``stage``'s gradient all-reduces, armed as its last backward (or W)
        made the gradients, and refuse a step with micro-batches not yet backpropagated."""
        for sync in stage.syncs:
            sync.finish()
        stage.check_backpropagated()

    def agree(
        self, stages: Collection[int], check: Callable[[], None], timeout: float, where: str
    ) -> None:
        """AGREE of the rank holding ``stages``. The last of this process's ranks to arrive
        agrees for all its stages (every stage's gradients are final then); the others wait
        for it, no longer than ``timeout`` and only while ``check`` finds every peer running."""
        with self._lock:
            meeting = self._round
            meeting.arrived.update(stages)
            last = meeting.arrived >= self._indices
            if last:
                self._round = _Round()
        if last:
            try:
                self._agree()
            except BaseException as error:
                meeting.error = error
                raise
            finally:
                meeting.done.set()
            return
        deadline = time.monotonic() + timeout
        while not meeting.done.wait(WAIT_POLL):
            check()
            if time.monotonic() > deadline:
                raise CommunicationTimeout(
                    f"{where} waited {timeout:g} s at AGREE for this process's other stages "
                    "to finish their backwards; one of them is slow or hung (raise "
                    "Pipeline(timeout=...) if it is only slow)"
                )
        if meeting.error is not None:
            raise PeerError(f"{where}: the step's agreement failed: {meeting.error}")

    @torch.no_grad()
    def _agree(self) -> None:
        """Unscale, agree, decide whether to skip, clip, and update fp16's scale."""
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
            self._skip, self._found_inf = skipped, None
            self._complaint = self._nonfinite(self._step, vector.tolist()) if skipped else None
        else:
            found_inf = total.mul(0).nan_to_num(1.0).float()  # 1.0 for inf or NaN, else 0.0
            skipped, self._skip, self._found_inf = found_inf.bool(), None, found_inf
            self._unreported.append((self._step, HostCopy(vector)))
        metrics: dict[str, Any] = {"grad_norm": norm, "skipped_step": skipped}
        if self.scaler is not None:
            metrics["loss_scale"] = scale
            if self._complaint is None or self.nonfinite != "raise":  # a raise ends the step
                self.scaler.update(found_inf)
        self._result = vector[self.count], metrics

    def update(self, stage: Stage) -> None:
        """STEP: ``stage``'s optimizer step as AGREE decided: skipped by the host, or by the
        optimizer itself where ``found_inf`` is 1."""
        if self._skip:
            return
        optimizer = stage.optimizer
        if self._found_inf is None or optimizer is None:
            stage.step()
            return
        optimizer.found_inf = self._found_inf.to(stage.device)  # type: ignore[attr-defined]
        try:
            stage.step()
        finally:
            optimizer.found_inf = None  # type: ignore[attr-defined]

    def report(self, wait: bool) -> None:
        """Warn of the skipped steps whose flags reached the host (``wait``: of all of them,
        waiting for them if need be)."""
        while self._unreported and (wait or self._unreported[0][1].ready()):
            step, copy = self._unreported.pop(0)
            text = self._nonfinite(step, copy.values())
            if text is not None:
                self._say(text)

    def _nonfinite(self, step: int, vector: list[float]) -> str | None:
        """What is not finite in skipped step ``step``'s agreement ``vector``; None where
        nothing is worth a word (an fp16 overflow: the loss scale deals with it)."""
        gradients = [s for s, v in enumerate(vector[: self.count]) if not _finite(v)]
        loss = not _finite(vector[self.count])
        if not loss and (not gradients or self.scaler is not None):
            return None
        what = [f"gradients on stage{'s' * (len(gradients) > 1)} "
                f"{', '.join(map(str, gradients))}"] if gradients else []
        what += [f"the loss (stage {self.count - 1})"] if loss else []
        return f"step {step}: non-finite {' and '.join(what)}"

    def _say(self, text: str) -> None:
        """Warn of a skipped step, or raise for it (``nonfinite="raise"``)."""
        if self.nonfinite == "raise":
            raise NonFiniteError(
                f"{text}; the step was skipped on every rank (weights and optimizer state "
                "untouched). Check the batch and the learning rate, or pass "
                "Pipeline(nonfinite='skip') to skip such steps with a warning"
            )
        warnings.warn(
            f"{text}: the step was skipped on every rank (weights, optimizer state and "
            "learning-rate schedule untouched); pass Pipeline(nonfinite='raise') to stop "
            "instead", RuntimeWarning, stacklevel=3,
        )

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
        vector = torch.stack(entries).double()
        return self.sum_over_ranks(vector) if self.sum_over_ranks is not None else vector


def _finite(value: float) -> bool:
    return value - value == 0
