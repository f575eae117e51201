"""A model and how to train it: what ``pipetrain train`` trains.

A user's module holds a function that returns a :class:`TrainTask`: the model the plan was
made for, the loss, the optimizer factory and the batch of every step::

    def task() -> pipetrain.TrainTask:
        torch.manual_seed(0)                      # every rank builds the same model
        model = nn.Sequential(...)
        def batch(step):                          # the mini-batch of step 0, 1, ...
            generator = torch.Generator().manual_seed(step)
            x = torch.randn(64, 32, generator=generator)
            return x, (x.sum(1) > 0).long()
        return pipetrain.TrainTask(model, nn.functional.cross_entropy,
                                   lambda params: torch.optim.SGD(params, lr=0.1), batch)

It sits in the runtime, below the model families (pipetrain/hf/task.py returns one) and the
command that trains it (pipetrain/tools/task.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.runtime.microbatch import Batch
from pipetrain.runtime.stage import LossFn, OptimizerFactory

RESERVED = ("balance", "plan", "chunks", "loss_fn", "optimizer", "replicas", "devices", "group",
            "checkpoint_dir", "checkpoint_every")  # Pipeline options the command sets itself


@dataclass(frozen=True)
class TrainTask:
    """A model and how to train it, as ``pipetrain train MODULE:FUNCTION`` takes it.

    ``model``: the nn.Sequential the plan was made for, built the same on every rank (seed
    first). ``loss_fn(output, target)``: a mean loss. ``optimizer``: a factory of an optimizer
    over a list of parameters (each stage builds its own). ``batch(step)``: the (inputs,
    targets) mini-batch of step 0, 1, ...: the same on every rank, the whole step's (each
    replica takes an equal share), its size the plan's micro-batch size x micro-batches x
    replicas. A function of the step, so that a resumed run trains on the batches of an
    uninterrupted one. ``options``: further Pipeline arguments (precision, clip_grad_norm,
    lr_scheduler, timeout, ...)."""

    model: nn.Sequential | LayerTree
    loss_fn: LossFn
    optimizer: OptimizerFactory
    batch: Callable[[int], tuple[Batch, Batch]]
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        layer_tree(self.model, "TrainTask.model")  # refused here, not on every rank later
        if not callable(self.batch):
            raise TypeError("TrainTask.batch must be a function of the step returning "
                            "(inputs, targets)")
        taken = sorted(set(self.options) & set(RESERVED))
        if taken:
            raise ValueError(f"TrainTask.options may not set {taken}: the plan and the command "
                             "line decide them (the loss and optimizer are fields of their own)")
