"""Timing several pipeline configurations of one model side by side over gloo processes.

Every rank builds one ``Pipeline`` per configuration (its keyword arguments; ``"optimizer"``
names one of :data:`OPTIMIZERS`) from a fresh :class:`Workload` (model, split, loss and a fixed
mini-batch), warms each up, then times them in rounds: each round runs every configuration for
``steps`` consecutive train_steps in :func:`timing.rotation` order, a barrier before and a
flush after (outside the time), so what is timed is the steady state, the first step's fill
amortized over ``steps``. A configuration's time is the median over rounds of the slowest
rank's per-step time. With ``memory=True`` each configuration is built once more with
``track_memory=True`` and run untimed to read what every rank holds (:func:`stage_bytes`).
benchmarks/async_digits.py, staleness_study.py and async_throughput.py time through it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ranks import init_rank, spawn_ranks
from timing import rotation


@dataclass
class Workload:
    """What a configuration trains: the model (fresh: a Pipeline takes it), its split (one
    stage per rank), the loss and the one mini-batch every step trains on."""

    model: Any
    balance: list[int]
    loss_fn: Callable[..., Any]
    x: Any
    y: Any


@dataclass(frozen=True)
class TimingRun:
    """One timing run: ``world`` ranks, ``workload`` a picklable callable (a module-level
    function or a functools.partial of one) building a :class:`Workload`, ``configs`` each
    configuration's Pipeline keywords by key."""

    world: int
    workload: Callable[[], Workload]
    configs: dict[Any, dict[str, Any]]
    rounds: int
    steps: int
    memory: bool = False
    warmup: int = 3


def _optimizer(name: str) -> Callable[..., Any]:
    """The optimizer factory a configuration's ``"optimizer"`` names (default SGD, momentum)."""
    import torch

    from pipetrain.optim import nadamw

    return {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-4, momentum=0.9),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.01),
        "nadamw": nadamw(1e-4),
    }[name]


def build(run: TimingRun, options: dict[str, Any], **extra: Any) -> tuple[Any, Workload]:
    """A pipeline of ``run``'s workload under ``options`` (and ``extra``), and its workload."""
    import pipetrain

    work = run.workload()
    options = {**options, **extra}
    pipe = pipetrain.Pipeline(
        work.model, work.balance, loss_fn=work.loss_fn, timeout=300,
        optimizer=_optimizer(options.pop("optimizer", "sgd")), **options,
    )
    return pipe, work


def _tensor_bytes(tensors: Any) -> int:
    import torch

    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def stage_bytes(pipe: Any) -> dict[str, int]:
    """What this rank's stages hold, in bytes: weights (their gradients are as large),
    optimizer state, the asynchronous stages' extra weight versions at their peak, and the
    activations saved for backward at their peak (``track_memory=True``, else 0)."""
    held = dict(weights=0, optimizer=0, versions=0, activations=0)
    for stage in pipe.stages:
        held["weights"] += _tensor_bytes(stage.module.parameters())
        if stage.optimizer is not None:
            held["optimizer"] += sum(_tensor_bytes(s.values())
                                     for s in stage.optimizer.state.values())
        if stage.versions is not None:
            held["versions"] += stage.versions.peak_bytes
        if stage.ledger is not None:
            held["activations"] += stage.ledger.peak_bytes
    return held


def _memory(run: TimingRun) -> dict[Any, list[dict[str, int]]]:
    """Per configuration, every rank's :func:`stage_bytes` after ``run.warmup`` + 2 untimed
    steps (the weight versions are at their steady state by then)."""
    import torch.distributed as dist

    memory = {}
    for key, options in run.configs.items():
        pipe, work = build(run, options, track_memory=True)
        for _ in range(run.warmup + 2):
            pipe.train_step(work.x, work.y)
        every: list[Any] = [None] * run.world
        dist.all_gather_object(every, stage_bytes(pipe))
        pipe.flush()
        memory[key] = every
    return memory


def time_pipelines(rank: int, port: int, run: TimingRun, results: Any) -> None:
    """One rank of ``run`` (spawned by :func:`time_configs`); the first puts on ``results``
    ``{"times": median seconds per step by key, "memory": ...}`` (memory only when asked)."""
    import torch
    import torch.distributed as dist

    init_rank(rank, run.world, port, 300)
    pipes = {key: build(run, options) for key, options in run.configs.items()}
    for pipe, work in pipes.values():
        for _ in range(run.warmup):
            pipe.train_step(work.x, work.y)
        pipe.flush()
    times: dict[Any, list[float]] = {key: [] for key in pipes}
    for r in range(run.rounds):
        for key in rotation(list(pipes), r):
            pipe, work = pipes[key]
            dist.barrier()
            start = time.perf_counter()
            for _ in range(run.steps):
                pipe.train_step(work.x, work.y)
            took = torch.tensor([(time.perf_counter() - start) / run.steps], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            times[key].append(float(took))
            pipe.flush()
    del pipes
    memory = _memory(run) if run.memory else None
    if rank == 0:
        results.put({"times": {k: statistics.median(v) for k, v in times.items()},
                     "memory": memory})
    dist.barrier()
    dist.destroy_process_group()


def time_configs(run: TimingRun) -> dict[str, Any]:
    """Run ``run`` on ``run.world`` spawned ranks: ``{"times": ..., "memory": ...}``."""
    result: dict[str, Any] = spawn_ranks(time_pipelines, run.world, run)
    return result
