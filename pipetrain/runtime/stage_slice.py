"""A stage's slice of the model: its layers, where it sits in the pipeline, and one run of a
micro-batch through them to the next boundary or, on the last stage, to the loss.

The slice knows nothing of recomputation, CUDA graphs or weight versions
(pipetrain/runtime/forward_policy.py and weight_source.py decide those): it runs its layers
under the stage's autocast, scores the loss, starts the last stage's backward from the loss
scale, and names the layer a failure came from.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from pipetrain.errors import PeerError, StageError
from pipetrain.layer_tree import LayerTree
from pipetrain.runtime.stage_module import Cuts, LayerRun, StageModule, alias
from pipetrain.training.precision import autocast, to_boundary

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a stage's input: a tensor, or a tuple or list of them."""
    members = value if isinstance(value, tuple | list) else (value,)
    return [t for t in members if isinstance(t, torch.Tensor)]


def _own_version(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory under a version counter of its own (no copy). Micro-batches are
    views of one mini-batch, which share its counter: once a stage modifies its input in
    place, each micro-batch needs its own, or autograd takes the next micro-batch's change
    for one of the data a backward needs."""
    return tensor.new_empty(0).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def entered(value: object, copy: bool, own_versions: bool) -> object:
    """A stage's input (a tensor or a tuple or list of them) as its first layer reads it, so
    that the layer may modify it in place as a model's own layers may: through :func:`alias`
    where it needs a gradient (the stashed inputs, leaves, only collect gradients), under a
    version counter of its own where asked; copied when the forward will run again on the
    same input (recomputation), which an in-place op must not have changed."""

    def enter(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        if copy:
            return t.clone()
        if t.requires_grad:
            return alias(t)
        return _own_version(t) if own_versions else t

    if type(value) is tuple:
        return tuple(enter(t) for t in value)
    if type(value) is list:
        return [enter(t) for t in value]
    return enter(value)


class StageSlice:
    """Stage ``index`` of ``count``: the model's layers from ``offset`` on, on ``device``,
    run under autocast to ``autocast_dtype`` (None: fp32); on the last stage scored by
    ``loss_fn``, whose backward starts from the loss scale over ``loss_divisor`` (the
    micro-batches of one update), so the gradients are those of the mean loss."""

    def __init__(
        self,
        module: nn.Sequential | LayerTree,
        index: int,
        count: int,
        offset: int,
        device: torch.device,
        loss_fn: LossFn | None,
        autocast_dtype: torch.dtype | None,
        loss_divisor: int,
    ):
        self.module = StageModule.of(module).to(device)  # hooks on it run (stage_module.py)
        self.at = LayerRun()  # the layer at work, named if it fails
        self.index, self.count, self.offset = index, count, offset
        self.device = device
        self.loss_fn = loss_fn
        self.autocast_dtype = autocast_dtype  # mixed precision (pipetrain/training/precision.py)
        self.loss_divisor = loss_divisor
        # False: autocast keeps no weight-cast cache (sharded weights, CUDA graph replays)
        self.autocast_cache = True
        self.own_versions = False  # a forward modified an input in place (see _own_version)
        # the loss's num_items_in_batch this step, where it takes one (loss_items.py)
        self.num_items: torch.Tensor | None = None

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    def enter(self, value: object, copy: bool) -> object:
        """``value`` as the first layer reads it (:func:`entered`)."""
        return entered(value, copy, self.own_versions)

    def entering(
        self, run: Callable[[object], object], copy: bool
    ) -> Callable[[object], object]:
        """``run`` (the slice on some weights) applied to its input as the first layer
        reads it (:meth:`enter`): the work a forward policy runs, once or again."""
        return lambda value: run(self.enter(value, copy))

    @contextmanager
    def watching(self, value: object) -> Iterator[None]:
        """Note a forward inside that modifies ``value``'s tensors in place: later inputs then
        get version counters of their own (see :func:`_own_version`)."""
        plain = [(t, t._version) for t in _tensors(value) if not t.requires_grad]
        yield
        if any(t._version != seen for t, seen in plain):
            self.own_versions = True

    def run_and_score(
        self, value: object, target: object, cuts: Cuts | None = None, score: bool = True
    ) -> object:
        """The slice's output (in the autocast dtype, for the next stage), or on the last stage
        its loss against ``target`` (``score=False``: its output). ``cuts`` collects a split
        backward's cuts."""
        with autocast(self.device, self.autocast_dtype, cache=self.autocast_cache):
            self.at.cuts = cuts
            try:
                output = self.module(value, run=self.at)
            finally:
                self.at.cuts = None
            if self.is_last:
                return self._loss(output, target) if score else output
        return to_boundary(output, self.autocast_dtype)

    def _loss(self, output: object, target: object) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("training needs loss_fn: pass Pipeline(..., loss_fn=...)")
        self.at.position = len(self.module)  # past the last layer: the loss is to blame
        if self.num_items is None:
            loss = self.loss_fn(output, target)  # type: ignore[arg-type]
        else:
            loss = self.loss_fn(
                output, target, num_items_in_batch=self.num_items  # type: ignore[call-arg, arg-type]
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "loss_fn must return a scalar tensor (use reduction='mean'), "
                f"got {type(loss).__name__} of shape {getattr(loss, 'shape', None)}"
            )
        return loss

    @contextmanager
    def reporting(self, step: str | Callable[[], str], microbatch: int) -> Iterator[None]:
        """Raise what fails inside as a StageError naming this stage, ``step`` (a callable:
        named once it failed) and the micro-batch; a StageError passes as it is, and so does a
        PeerError (a collective of the layers' own with a lost replica, collectives.py)."""
        try:
            yield
        except (StageError, PeerError):
            raise
        except Exception as error:
            name = step() if callable(step) else step
            raise StageError(
                f"stage {self.index}, {name} of micro-batch {microbatch} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def forward_step(self) -> str:
        """The failed part of a forward: the layer it was in, or the loss."""
        position = self.at.position
        if position < len(self.module):
            layer = self.module[position]
            return f"layer {self.offset + position} ({type(layer).__name__}), forward"
        return "loss_fn, forward"

    def output_grads(
        self, outputs: list[torch.Tensor], grads: Sequence[torch.Tensor | None],
        microbatch: int, loss_scale: float | torch.Tensor,
    ) -> Sequence[torch.Tensor | None]:
        """The gradients to start the backward of ``outputs`` from: on the last stage the loss
        scale over the loss divisor (the mean over micro-batches, without a division in each
        micro-batch's graph), else the received ones, one per output that needs a gradient
        (None: the next stage's input got none, as a detached one)."""
        if self.is_last:
            if not outputs:
                return []
            if isinstance(loss_scale, torch.Tensor):  # fp16's, on the device (precision.py)
                scaled = loss_scale / self.loss_divisor
                return [scaled.to(outputs[0].dtype).expand_as(outputs[0])]
            return [torch.full_like(outputs[0], loss_scale / self.loss_divisor)]
        if len(grads) != len(outputs):
            raise StageError(
                f"stage {self.index}: received {len(grads)} gradients for micro-batch "
                f"{microbatch} but {len(outputs)} outputs need one"
            )
        return grads
