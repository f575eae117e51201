"""The weights a stage's micro-batch runs on: the live parameters (synchronous schedules), or
the weight version its forward read (asynchronous schedules, pipetrain/training/weights.py),
in whose backward the weight gradients still reach the live parameters' ``.grad``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import nn

from pipetrain.layer_tree import LayerTree
from pipetrain.runtime.rng import StageRng, State
from pipetrain.runtime.stage_module import Cuts
from pipetrain.runtime.stage_slice import StageSlice
from pipetrain.training.weights import WeightVersions


class LiveWeights:
    """Every micro-batch runs on the live parameters."""

    versions: WeightVersions | None = None
    recomputes = False  # whether a forward runs without a graph, recomputed at the backward

    def __init__(self, slice_: StageSlice):
        self._slice = slice_

    def run(self, microbatch: int, target: object, cuts: Cuts | None) -> Callable[[object], object]:
        """The slice's run against ``target`` for micro-batch ``microbatch``, collecting
        ``cuts``."""
        return partial(self._slice.run_and_score, target=target, cuts=cuts)


class _Runner(nn.Module):
    """Wraps a stage's slice so that ``torch.func.functional_call`` swaps its weights, named as
    in the slice, while the stage runs it layer by layer (its errors still name the layer)."""

    def __init__(self, body: LayerTree, run: Callable[..., object]):
        super().__init__()
        self.body = body
        self._run = run

    def forward(self, value: object, target: object = None) -> object:
        return self._run(value, target=target)


class VersionedWeights:
    """An asynchronous stage's micro-batches run on ``versions``' weights in place of its
    trainable ``weights`` (the slice's parameters that need gradients, in order); "stale"
    versions run the forward without a graph and recompute it at the backward on the live
    weights, replaying its random draws from ``rng``."""

    def __init__(
        self, slice_: StageSlice, weights: list[nn.Parameter], versions: WeightVersions,
        rng: StageRng,
    ):
        self._slice, self._weights, self.versions, self._rng = slice_, weights, versions, rng
        self._runner = _Runner(slice_.module, slice_.run_and_score)
        self._names = [n for n, p in self._runner.named_parameters() if p.requires_grad]
        # "stale" recomputation: the inputs, target and random state of the forward
        self._targets: dict[int, tuple[object, object, State]] = {}

    @property
    def recomputes(self) -> bool:
        return self.versions.recomputes

    def run(self, microbatch: int, target: object, cuts: Cuts | None) -> Callable[[object], object]:
        """The slice's run against ``target`` on the weights micro-batch ``microbatch``'s
        forward reads (no cuts: an asynchronous backward is never split)."""
        return self._functional(self.versions.forward_weights(microbatch), target)

    def keep(self, microbatch: int, value: object, target: object, start: State) -> None:
        """What a "stale" backward recomputes micro-batch ``microbatch``'s forward from."""
        self._targets[microbatch] = (value, target, start)

    def _functional(
        self, weights: list[torch.Tensor] | None, target: object
    ) -> Callable[[object], object]:
        """The slice's run against ``target`` on ``weights`` in place of the parameters
        (None: the parameters themselves)."""
        if weights is None:
            return partial(self._slice.run_and_score, target=target)
        mapping = dict(zip(self._names, weights, strict=True))
        return lambda value: torch.func.functional_call(
            self._runner, mapping, (value,), {"target": target}
        )

    def backward(
        self, microbatch: int, stashed: tuple[torch.Tensor, ...], wanted: list[torch.Tensor],
        grads: Sequence[torch.Tensor | None], loss_scale: float | torch.Tensor,
    ) -> list[torch.Tensor | None]:
        """Backward of micro-batch ``microbatch`` from its ``stashed`` outputs through the
        weights its forward read (or, with "stale" versions, a recomputed forward on the live
        weights); the weight gradients are added to the live parameters' ``.grad``. Returns
        the gradients of the ``wanted`` inputs, never None (zeros where none flows):
        asynchronous schedules send every gradient."""
        versions, slice_ = self.versions, self._slice
        weights = versions.backward_weights(microbatch)
        outputs_all = stashed
        with slice_.reporting("backward", microbatch):
            if versions.recomputes:  # on the live weights, or PipeMare's corrected ones
                value, target, start = self._targets.pop(microbatch)
                assert not slice_.is_last, "the last stage has lag 0: nothing to recompute"
                live = all(w is p for w, p in zip(weights, self._weights, strict=True))
                with torch.enable_grad(), self._rng.replay(start):
                    out = self._functional(None if live else weights, target)(
                        slice_.enter(value, False)
                    )
                outputs_all = out if isinstance(out, tuple) else (out,)
            outputs = [t for t in outputs_all if t.requires_grad]
            received = slice_.output_grads(outputs, grads, microbatch, loss_scale)
            grads = [g if g is not None else torch.zeros_like(t)
                     for g, t in zip(received, outputs, strict=True)]
            # backward() accumulates into .grad in place: into the live parameters' when the
            # forward read them; else into the copies', which share the live .grad tensors
            # (allocated by the first backward after an update, then moved over below)
            for p, w in zip(self._weights, weights, strict=True):
                if w is not p:
                    w.grad = p.grad
            if outputs and wanted + weights:
                torch.autograd.backward(outputs, list(grads), inputs=wanted + weights)
        for p, w in zip(self._weights, weights, strict=True):
            if w is not p:
                p.grad, w.grad = w.grad, None
        versions.release(microbatch)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in wanted]
