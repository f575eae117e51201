"""What ``pipetrain train`` trains, and its training loop on one rank.

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

``pipetrain train mymodule:task --plan plan.json --steps 100`` starts one process per rank,
calls it in each, and trains with the plan's split, schedule and micro-batches.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from partitioner import Plan
from pipetrain.checkpoints.restart import start_or_resume
from pipetrain.runtime.microbatch import Batch, batch_size
from pipetrain.runtime.pipeline import Pipeline
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

    model: nn.Sequential
    loss_fn: LossFn
    optimizer: OptimizerFactory
    batch: Callable[[int], tuple[Batch, Batch]]
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Sequential):
            raise TypeError(f"TrainTask.model must be an nn.Sequential, got "
                            f"{type(self.model).__name__}")
        if not callable(self.batch):
            raise TypeError("TrainTask.batch must be a function of the step returning "
                            "(inputs, targets)")
        taken = sorted(set(self.options) & set(RESERVED))
        if taken:
            raise ValueError(f"TrainTask.options may not set {taken}: the plan and the command "
                             "line decide them (the loss and optimizer are fields of their own)")


@dataclass(frozen=True)
class Run:
    """How long and where to train: the command line's choices."""

    steps: int
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    log_every: int = 10
    fresh: bool = False  # a new run beside an earlier run's checkpoints in checkpoint_dir


def check_batch(x: Batch, y: Batch, step: int, expected: int, plan: Plan, replicas: int) -> None:
    """Refuse a batch of another size than the plan's micro-batches make, naming both fixes."""
    for what, value in (("inputs", x), ("targets", y)):
        size = batch_size(value, f"batch({step}) {what}")
        if size == expected:
            continue
        per = plan.microbatches * replicas
        replan = (f", or plan for micro-batches of {size // per} samples (profile a batch of "
                  f"{size // per})" if size % per == 0 else "")
        raise ValueError(
            f"batch({step}) gives {what} of {size} samples, but the plan trains "
            f"{plan.microbatches} micro-batches of {plan.microbatch_size} samples on each of "
            f"{replicas} replica(s): {expected} a step; return {expected} samples{replan}"
        )


def train(task: TrainTask, plan: Plan, run: Run, world: int, rank: int) -> float | None:
    """Train ``task`` on this rank of ``world`` (a multiple of the plan's ranks), resuming or
    saving in ``run.checkpoint_dir`` (Pipeline's own: :func:`start_or_resume` decides, then
    ``train_step`` saves every ``run.checkpoint_every`` steps there); the last step's loss
    (None when the checkpoint already held every step)."""
    replicas = world // plan.pipeline_ranks
    pipe = Pipeline(task.model, plan=plan, loss_fn=task.loss_fn, optimizer=task.optimizer,
                    replicas=replicas, checkpoint_every=run.checkpoint_every, **task.options)
    folder = run.checkpoint_dir
    resumed = start_or_resume(pipe, folder, run.resume, run.fresh) if folder is not None else None
    if rank == 0 and resumed is not None:
        print(f"resumed from step {resumed} of {folder}", flush=True)
    expected = plan.microbatches * plan.microbatch_size * replicas
    share = expected // replicas
    mine = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
    loss = None
    while pipe.step < run.steps:
        x, y = task.batch(pipe.step)
        check_batch(x, y, pipe.step, expected, plan, replicas)
        loss = pipe.train_step(_part(x, mine), _part(y, mine))  # saves every checkpoint_every
        if rank == 0 and (pipe.step % run.log_every == 0 or pipe.step == run.steps):
            print(f"step {pipe.step}/{run.steps}  loss {loss:.4f}", flush=True)
    if folder is not None:
        pipe.save(folder)  # nothing new when the last periodic save was this step
    return None if loss is None else float(loss)


def _part(value: Batch, rows: slice) -> Batch:
    return tuple(t[rows] for t in value) if isinstance(value, tuple | list) else value[rows]


def under_torchrun() -> bool:
    """Whether this process is a rank that torchrun started."""
    return all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
