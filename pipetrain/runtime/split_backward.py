"""A stage's split backward (the zero-bubble schedules' B and W): B computes a micro-batch's
input gradients and keeps W's work, W later accumulates its weight gradients. Where each layer
holds its weights itself, the forward cuts its graph after each layer
(pipetrain/runtime/stage_module.py) and W backpropagates each layer alone from the output
gradients B found; otherwise W backpropagates the stage's outputs again."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import cast

import torch
from torch import nn

from pipetrain.runtime.stage_module import Cuts, StageModule

# W's work for one micro-batch: (tensors, their gradients, the weights to reach from them)
_WeightWork = tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Parameter]]
# what W computes the gradients of, for given weights (sharding.py: FSDP2's gathered ones)
Leaves = Callable[[Sequence[nn.Parameter]], list[torch.Tensor]]


class SplitBackward:
    """The B/W split of a stage running ``module``, whose trainable ``weights`` are given in
    order: every backward when ``scheduled`` (a schedule with W), else only that of a
    micro-batch whose forward was cut whole. ``sharded``: the weights are FSDP2's DTensors;
    ``leaves`` gives what W differentiates for them (the gathered parameters FSDP2 swapped in
    for the forward; by default the weights themselves). ``whole``: no backward is split,
    and every W finds its weight gradients made by B (compiled layers, compiled.py: a
    compiled layer's backward makes its input and weight gradients in one call, so a B and a
    W would each run all of it, and torch refuses the second run where the compiled backward
    reuses its saved activations' memory, its donated buffers)."""

    def __init__(
        self, module: StageModule, weights: list[nn.Parameter], scheduled: bool, sharded: bool,
        leaves: Leaves = list, whole: bool = False,
    ):
        self.scheduled, self._leaves = scheduled, leaves
        self._every = scheduled and not whole  # every backward split
        self._weights = weights
        per_layer = [[p for p in layer.parameters() if p.requires_grad] for layer in module]
        distinct = len({id(p) for p in weights}) == sum(len(ps) for ps in per_layer)
        # W per layer from its outputs' gradients needs each weight in one layer only; else
        # (and for recomputed micro-batches) W backpropagates the stage's outputs again.
        self._layer_weights = per_layer if distinct else None
        # A layer with weights inside it (a transformer block) would have its insides
        # backpropagated again by W; layers that hold their weights themselves (Linear, Conv,
        # norms) need only their weight gradients there. Weights sharded by FSDP2 (ZeRO 2, 3:
        # sharding.py) are reduce-scattered as the armed last backward's B ends, before a cut
        # W (split-backward schedules reduce after their last W instead).
        self.weights_at_top = distinct and not sharded and not whole and not any(
            p.requires_grad for layer in module for child in layer.children()
            for p in child.parameters()
        )
        self._work: dict[int, list[_WeightWork]] = {}

    def cuts(self, cut: bool) -> Cuts | None:
        """The cuts a forward collects: under a schedule with W, or ``cut`` asked (and
        allowed: :attr:`weights_at_top`), where each weight is in one layer only."""
        if (self._every or cut) and self._layer_weights is not None:
            return Cuts(self._layer_weights)
        return None

    def splits(self, cuts: Cuts | None) -> bool:
        """Whether the backward of a forward that collected ``cuts`` is split: outside a
        schedule with W only a whole cut splits, where W then costs no more than its share of
        one backward (an uncut W would backpropagate everything again)."""
        return self._every or (cuts is not None and cuts.whole)

    def input_gradients(
        self,
        microbatch: int,
        cuts: Cuts | None,
        outputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        wanted: list[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """B: the ``wanted`` inputs' gradients and, in the same pass, those of the aliases of
        each cut (no weight gradient is computed); W's work is kept."""
        cuts = cuts if cuts is not None and cuts.whole else None
        aliases = [a for cut in cuts.layers for a in cut.aliases] if cuts else []
        found: list[torch.Tensor | None] = [None] * (len(wanted) + len(aliases))
        if outputs and (wanted or aliases):
            found = list(torch.autograd.grad(
                # tensors and gradient edges mix (torch's annotation has one or the other)
                outputs, cast(list[torch.Tensor], [*wanted, *aliases]), grads,
                retain_graph=True, allow_unused=True,
            ))
        work: list[_WeightWork] = []
        if cuts is not None:
            at = len(wanted)
            for cut in cuts.layers:
                got = found[at : at + len(cut.aliases)]
                at += len(cut.aliases)
                pairs = [(t, g) for t, g in zip(cut.outputs, got, strict=True) if g is not None]
                if pairs:
                    work.append(([t for t, _ in pairs], [g for _, g in pairs], cut.weights))
        elif outputs and self._weights:
            work.append((outputs, grads, self._weights))
        self._work[microbatch] = work
        return found[: len(wanted)]

    def backward_weights(self, microbatch: int, reporting: AbstractContextManager[None]) -> None:
        """W: accumulate micro-batch ``microbatch``'s weight gradients (layer by layer, last
        first, each from its output gradient found by B), failures raised through
        ``reporting``. A recomputed (checkpointed) micro-batch backpropagates its outputs a
        second time, which recomputes its forward once more (non-reentrant checkpointing
        recomputes once per backward)."""
        work = self._work.pop(microbatch)
        with reporting:
            for tensors, grads, weights in reversed(work):
                torch.autograd.backward(
                    tensors, grads, inputs=self._leaves(weights), retain_graph=True
                )

    def pending(self, microbatch: int) -> bool:
        """Whether micro-batch ``microbatch``'s W is still to run."""
        return microbatch in self._work

    def waiting(self) -> set[int]:
        """The micro-batches whose W is still to run."""
        return set(self._work)
