"""``pipetrain train``'s training loop on one rank, of a :class:`TrainTask`
(pipetrain/runtime/train_task.py: what a user's function returns).

``pipetrain train mymodule:task --plan plan.json --steps 100`` starts one process per rank,
calls it in each, and trains with the plan's split, schedule and micro-batches.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

from partitioner import Plan
from pipetrain.checkpoints.restart import start_or_resume
from pipetrain.runtime.microbatch import Batch, batch_size
from pipetrain.runtime.pipeline import Pipeline
from pipetrain.runtime.train_task import TrainTask

__all__ = ["Run", "TrainTask", "check_batch", "train", "under_torchrun"]


@dataclass(frozen=True)
class Run:
    """How long and where to train: the command line's choices."""

    steps: int
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    log_every: int = 10
    fresh: bool = False  # a new run beside an earlier run's checkpoints in checkpoint_dir
    compile: bool = False  # --compile: Pipeline(compile=True), whatever the task's options say


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
    replicas = world // plan.pipeline_ranks  # --nproc's copies in place of the plan's
    options = {**task.options, **({"compile": True} if run.compile else {})}
    pipe = Pipeline(task.model, plan=replace(plan, data_parallel=replicas), loss_fn=task.loss_fn,
                    optimizer=task.optimizer, checkpoint_every=run.checkpoint_every, **options)
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
