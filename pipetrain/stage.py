"""One stage of the pipeline: its slice of the model and what it keeps between F and B.

The stage knows nothing of schedules or links: the executor hands it a micro-batch's inputs for
a forward and the output gradients for a backward, and the stage returns what must cross the
next boundary. Between the two it stashes, per micro-batch, the inputs (whose gradients flow
back) and the outputs (or, on the last stage, the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from pipetrain.batchnorm import gathering_statistics
from pipetrain.data_parallel import GradientSync
from pipetrain.errors import StageError
from pipetrain.memory import ActivationLedger

CHECKPOINT_MODES = ("never", "except_last", "always")

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def checkpoint_stop(mode: str, chunks: int) -> int:
    """Micro-batches with index below this are recomputed in backward (torchgpipe's modes)."""
    stops = {"never": 0, "except_last": chunks - 1, "always": chunks}
    if mode not in stops:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    return stops[mode]


@dataclass
class _Stashed:
    inputs: tuple[torch.Tensor, ...]  # leaves whose .grad goes back to the previous stage
    outputs: tuple[torch.Tensor, ...]  # what backward starts from (the scaled loss on the last)


class Stage:
    """Stage ``index`` of ``count``: a module slice on ``device`` with its optimizer."""

    def __init__(
        self,
        module: nn.Sequential,
        index: int,
        count: int,
        offset: int,
        device: torch.device,
        optimizer: OptimizerFactory | None,
        loss_fn: LossFn | None,
        checkpoint: str,
        track_memory: bool = False,
        owned_elsewhere: frozenset[int] = frozenset(),
    ):
        self.module = module.to(device)
        self.index, self.count, self.offset = index, count, offset
        self.device = device
        self.loss_fn = loss_fn
        self.checkpoint = checkpoint
        checkpoint_stop(checkpoint, 1)  # reject an unknown mode now, not at the first step
        # A weight tied to a layer of another stage in this process is stepped by that stage.
        params = [
            p for p in self.module.parameters() if p.requires_grad and id(p) not in owned_elsewhere
        ]
        self.optimizer = optimizer(params) if optimizer is not None and params else None
        self.syncs: list[GradientSync] = []  # gradient all-reduces before each optimizer step
        self.ledger = ActivationLedger.for_parameters(params) if track_memory else None
        self._stash: dict[int, _Stashed] = {}
        self.losses: dict[int, torch.Tensor] = {}

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def _run_layers(self, value: object) -> object:
        for position, layer in enumerate(self.module):
            self._layer = position  # names the culprit if a layer raises
            value = layer(value)
        return value

    def forward(
        self,
        microbatch: int,
        inputs: tuple[torch.Tensor, ...],
        value: object,
        target: object = None,
        chunks: int = 1,
        training: bool = True,
    ) -> object:
        """Run the slice on ``value`` (built from ``inputs``); return its output. In training,
        stash what backward needs; on the last stage compute the loss against ``target``."""
        self._layer = 0
        try:
            if not training:
                with torch.no_grad():
                    return self._run_layers(value)
            # On the last stage the loss is part of the (possibly recomputed) work, so a
            # checkpointed micro-batch keeps nothing but its inputs.
            work = partial(self._run_and_score, target=target)
            ledger = self.ledger.recording(microbatch, inputs) if self.ledger else nullcontext()
            with ledger, gathering_statistics():
                if microbatch < checkpoint_stop(self.checkpoint, chunks):
                    output = recompute(work, value, use_reentrant=False)
                else:
                    output = work(value)
        except Exception as error:
            if self._layer < len(self.module):
                layer = self.module[self._layer]
                where = f"layer {self.offset + self._layer} ({type(layer).__name__})"
            else:
                where = "loss_fn"
            raise StageError(
                f"stage {self.index}, {where}, forward of micro-batch {microbatch} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if self.is_last:
            self.losses[microbatch] = output.detach()  # type: ignore[union-attr]
            saved: tuple[torch.Tensor, ...] = (output / chunks,)  # type: ignore[operator]
        else:
            saved = output if isinstance(output, tuple) else (output,)  # type: ignore[assignment]
        self._stash[microbatch] = _Stashed(inputs, saved)
        return output

    def _run_and_score(self, value: object, target: object) -> object:
        """The slice's output, or on the last stage its loss against ``target``."""
        output = self._run_layers(value)
        return self._loss(output, target) if self.is_last else output

    def _loss(self, output: object, target: object) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("training needs loss_fn: pass Pipeline(..., loss_fn=...)")
        self._layer = len(self.module)  # past the last layer: the loss is to blame
        loss = self.loss_fn(output, target)  # type: ignore[arg-type]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "loss_fn must return a scalar tensor (use reduction='mean'), "
                f"got {type(loss).__name__} of shape {getattr(loss, 'shape', None)}"
            )
        return loss

    def backward(self, microbatch: int, grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Backpropagate micro-batch ``microbatch`` from its output gradients; return the
        gradients of the inputs that the previous stage asked for."""
        stashed = self._stash.pop(microbatch)
        outputs = [t for t in stashed.outputs if t.requires_grad]
        if self.is_last:
            grads = [torch.ones_like(outputs[0])] if outputs else []
        elif len(grads) != len(outputs):
            raise StageError(
                f"stage {self.index}: received {len(grads)} gradients for micro-batch "
                f"{microbatch} but {len(outputs)} outputs need one"
            )
        try:
            if outputs:
                torch.autograd.backward(outputs, grads)
        except Exception as error:
            raise StageError(
                f"stage {self.index}, backward of micro-batch {microbatch} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        if self.ledger:
            self.ledger.release(microbatch)
        return [
            x.grad if x.grad is not None else torch.zeros_like(x)
            for x in stashed.inputs
            if x.requires_grad
        ]

    def zero_grad(self) -> None:
        self.losses.clear()
        keep = bool(self.syncs)  # synchronised gradients are views into all-reduce buckets
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=not keep)
        else:
            self.module.zero_grad(set_to_none=not keep)

    def step(self) -> None:
        if self._stash:
            raise StageError(
                f"stage {self.index}: optimizer step with micro-batches {sorted(self._stash)} "
                "not yet backpropagated; the schedule is incomplete"
            )
        if self.optimizer is not None:
            self.optimizer.step()

