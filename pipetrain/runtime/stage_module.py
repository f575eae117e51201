"""A stage's slice of the model as the module the stage calls, and a split backward's cuts.

A stage runs its slice as one call of :class:`StageModule`, a LayerTree of the stage's
layers (named as in the full model, pipetrain/layer_tree.py), so hooks registered on
``stage.module`` run once per micro-batch, as on any module (torch.distributed.pipelining's
stage calls its module too). Given a :class:`LayerRun`, the slice notes which layer is running
(a failure names it) and, under a split backward (the zero-bubble schedules), cuts the graph
after each layer with weights.

The weight pass (W) backpropagates each such layer on its own, from its outputs to its
weights, with the outputs' gradients that the input pass (B) found. Those gradients must hold
only what flows back from LATER layers: the gradient of a layer's output ``h`` taken as a
whole already holds every path from ``h``, those through the layer's other outputs included,
so a layer returning ``(tanh(h), h)`` (a residual branch crossing the boundary) would have W
count the ``tanh`` path twice. Hence the cut: later layers read identity aliases of the
layer's outputs, B takes the gradients that reach the aliases, which only later uses reach,
and W starts from the layer's own outputs, so autograd adds the paths inside the layer
exactly once. An alias is a tensor of its own in the graph (:func:`alias`, not a view): an
in-place op on it or on a view of it (``Flatten`` then ``ReLU(inplace=True)``) rewrites the
alias's history, never the output's, and B asks for the gradient at the alias's node as it
was made (its gradient edge), which every later use reaches however it was rewritten.

``pipe.module`` is a :class:`PipelineLayers`: the same layers as one module, which the stages
never call, so it refuses hooks rather than ignore them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NoReturn, cast

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge

from pipetrain.layer_tree import LayerTree, layer_tree


class _Alias(torch.autograd.Function):
    """The identity, as a node of its own: the output shares the input's memory (and version
    counter) without being a view of it."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad


def alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a later layer may read it, in place too: an identity of its own in the
    graph (an in-place op on it rewrites its history, not ``tensor``'s, and a leaf stays
    untouched by autograd's leaf rule). No copy."""
    return cast(torch.Tensor, _Alias.apply(tensor))  # type: ignore[no-untyped-call]


@dataclass
class Cut:
    """One layer's cut: its outputs (W starts there), the gradient edges of the aliases later
    layers read (B takes the gradients that reach them), and the layer's weights."""

    outputs: list[torch.Tensor]
    aliases: list[GradientEdge]
    weights: list[nn.Parameter]


@dataclass
class Cuts:
    """The cuts of one micro-batch's forward, one per layer with weights. ``per_layer`` lists
    each layer's weights (empty: nothing to cut). ``whole`` turns False when a layer with
    weights returned something other than a tensor or a plain tuple or list of them: W then
    backpropagates the stage's outputs to all its weights at once."""

    per_layer: Sequence[list[nn.Parameter]]
    layers: list[Cut] = field(default_factory=list)
    whole: bool = True

    def after(self, position: int, output: object) -> object:
        """``output`` of layer ``position`` as later layers read it (aliased when cut)."""
        weights = self.per_layer[position]
        if not weights or not self.whole:
            return output
        if isinstance(output, torch.Tensor):
            members: list[object] = [output]
        elif type(output) in (tuple, list):
            members = list(output)  # type: ignore[call-overload]
        else:
            self.whole = False
            return output
        cut = Cut([], [], weights)
        read = []
        for member in members:
            if isinstance(member, torch.Tensor) and member.requires_grad:
                read_as = alias(member)
                cut.outputs.append(member)
                cut.aliases.append(get_gradient_edge(read_as))
                member = read_as
            read.append(member)
        self.layers.append(cut)
        if isinstance(output, torch.Tensor):
            return read[0]
        return type(output)(read)  # type: ignore[call-arg]


@dataclass
class LayerRun:
    """What a stage follows of one call of its slice: the layer at work (its position; the
    number of layers once past the last) and, for a split backward, the cuts."""

    position: int = 0
    cuts: Cuts | None = None


class StageModule(LayerTree):
    """A stage's layers, called in order (see the module docstring); ``calls``, where set,
    calls each position's layer instead (compile=True's compiled layers: compiled.py)."""

    calls: Sequence[Callable[..., object]] = ()

    @classmethod
    def of(cls, module: nn.Sequential | LayerTree) -> StageModule:
        """``module``'s layers (the same objects, under the same names, a layer used twice at
        both positions) and their glue as a StageModule."""
        if isinstance(module, StageModule):
            return module
        tree = layer_tree(module, "a stage")
        return cls(tree.positions(), tree.glue)

    def forward(self, value: object, run: LayerRun | None = None) -> object:
        """The last layer's output; ``run`` (a keyword, unseen by hooks) follows the call."""
        layers = self.calls or self.called()
        for position, layer in enumerate(layers):
            if run is not None:
                run.position = position
            value = layer(value)
            if run is not None and run.cuts is not None:
                value = run.cuts.after(position, value)
        return value


def _refused(name: str) -> Callable[..., NoReturn]:
    """A hook registration of :class:`PipelineLayers` that refuses, saying where hooks run."""

    def refuse(self: nn.Module, *args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError(
            f"pipe.module.{name}(...): a hook on pipe.module would never run, because "
            "train_step and eval_step call each stage's slice, not this view of the layers; "
            "register it on pipe.stages[i].module (it runs once per micro-batch on stage i) "
            "or on a layer of the model"
        )

    refuse.__name__ = name
    return refuse


class PipelineLayers(LayerTree):
    """This process's layers, named as in the full model: ``pipe.module``. The stages run the
    layers, never this module, so it refuses forward and backward hooks."""

    register_forward_pre_hook = _refused("register_forward_pre_hook")
    register_forward_hook = _refused("register_forward_hook")
    register_full_backward_pre_hook = _refused(
        "register_full_backward_pre_hook"
    )
    register_full_backward_hook = _refused("register_full_backward_hook")
    register_backward_hook = _refused("register_backward_hook")
