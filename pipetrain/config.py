"""Pipeline's options resolved once: a plan's choices merged with the caller's, defaults filled
in, every combination the runtime cannot run refused with the fix. ``Pipeline`` builds one
``PipelineConfig`` first and then only reads it; where the stages run (devices, process group,
replicas) is not part of it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from partitioner import Plan
from pipetrain.compensation import AUTO, DelayCompensation, parse_option
from pipetrain.planning import load_plan
from pipetrain.stage import LossFn, OptimizerFactory, SchedulerFactory, checkpoint_stop
from pipetrain.update import check_options
from schedules import lookup, names


def check_balance(model: nn.Sequential, balance: Sequence[int]) -> list[int]:
    """``balance`` as a list, refused unless it splits ``model`` (an nn.Sequential) whole."""
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"Pipeline takes an nn.Sequential, got {type(model).__name__}")
    balance = list(balance)
    if not balance or any(not isinstance(b, int) or b < 1 for b in balance):
        raise ValueError(f"balance {balance} must list a positive number of layers per stage")
    if sum(balance) != len(model):
        n, p = len(model), len(balance)
        even = [n // p + (i < n % p) for i in range(p)]
        raise ValueError(
            f"balance {balance} sums to {sum(balance)} but the model has {len(model)} layers; "
            f"make the entries sum to {len(model)}"
            + (f" (e.g. {even})" if min(even) > 0 else "")
        )
    return balance


@dataclass(frozen=True)
class PipelineConfig:
    """What Pipeline trains with (see Pipeline for each option). Build it with ``resolve``,
    which checks it; ``autocast_dtype`` and ``compensation`` are ``precision`` and
    ``delay_compensation`` parsed, ``trace`` falls back on PIPETRAIN_TRACE."""

    balance: tuple[int, ...]
    chunks: int
    schedule: str
    checkpoint: str
    timeout: float
    loss_fn: LossFn | None
    optimizer: OptimizerFactory | None
    lr_scheduler: SchedulerFactory | None
    precision: str
    autocast_dtype: torch.dtype | None
    clip_grad_norm: float | None
    weight_stashing: bool
    weight_prediction: str | None
    compensation: DelayCompensation | str | None  # "auto": resolved per stage (weights.py)
    deferred_batch_norm: bool
    track_memory: bool
    trace: str | os.PathLike[str] | None
    progress: bool | int
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every: int
    planned_ranks: int | None  # the ranks the plan places its stages on, when it decides that

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule never flushes between steps (PipeDream's family)."""
        return lookup(self.schedule).asynchronous

    def check_planned_ranks(self, ranks: int, placed: bool) -> None:
        """Refuse to run a plan's virtual stages on other than its number of ranks, once the
        devices or processes are ``placed`` (known)."""
        planned = self.planned_ranks
        if lookup(self.schedule).multi_stage_per_rank and planned not in (None, ranks) and placed:
            raise ValueError(
                f"the plan runs its {len(self.balance)} {self.schedule} stages on {planned} "
                f"ranks but this pipeline has {ranks}; pass {planned} devices (or run "
                f"{planned} processes per replica)"
            )

    @classmethod
    def resolve(
        cls,
        model: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        plan: str | os.PathLike[str] | Plan | None = None,
        chunks: int | None = None,
        schedule: str | None = None,
        checkpoint: str | None = None,
        loss_fn: LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
        timeout: float = 300.0,
        deferred_batch_norm: bool = False,
        track_memory: bool = False,
        trace: str | os.PathLike[str] | None = None,
        progress: bool | int = False,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        weight_stashing: bool = True,
        weight_prediction: str | None = AUTO,
        precision: str = "fp32",
        clip_grad_norm: float | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        delay_compensation: str | DelayCompensation | None = AUTO,
    ) -> PipelineConfig:
        """The checked configuration of ``Pipeline(model, balance, **options)``."""
        planned_ranks = None
        if plan is not None:
            balance, chunks, schedule, checkpoint, planned_ranks = _from_plan(
                load_plan(plan, model), balance, chunks, schedule, checkpoint
            )
        if balance is None:
            raise ValueError("say how to split the model: pass balance=[...] or plan=...")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
            raise ValueError(
                f"timeout must be a positive number of seconds (how long a stage waits for a "
                f"peer before giving up), got {timeout!r}"
            )
        chunks = 1 if chunks is None else chunks
        schedule = schedule or "1f1b"
        spec = lookup(schedule)
        if not spec.runnable:
            raise ValueError(
                f"schedule {schedule!r} can be validated and simulated (schedules.build) but "
                f"the runtime does not execute it yet; train with one of {names(runnable=True)}"
            )
        _check_asynchronous_options(
            schedule, checkpoint, weight_stashing, weight_prediction, delay_compensation
        )
        compensation = parse_option(delay_compensation)
        checkpoint = checkpoint or spec.checkpoint
        dtype = check_options(
            optimizer, lr_scheduler, precision, clip_grad_norm, schedule, spec.asynchronous
        )
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        checkpoint_stop(checkpoint, chunks)
        return cls(
            balance=tuple(check_balance(model, balance)), chunks=chunks, schedule=schedule,
            checkpoint=checkpoint, timeout=timeout, loss_fn=loss_fn, optimizer=optimizer,
            lr_scheduler=lr_scheduler, precision=precision, autocast_dtype=dtype,
            clip_grad_norm=clip_grad_norm, weight_stashing=weight_stashing,
            weight_prediction=weight_prediction, compensation=compensation,
            deferred_batch_norm=deferred_batch_norm, track_memory=track_memory,
            trace=trace or os.environ.get("PIPETRAIN_TRACE") or None, progress=progress,
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            planned_ranks=planned_ranks,
        )


def _from_plan(
    plan: Plan, balance: Sequence[int] | None, chunks: int | None, schedule: str | None,
    checkpoint: str | None,
) -> tuple[Sequence[int], int, str, str | None, int | None]:
    """The plan's balance, and its micro-batch count, schedule and checkpoint mode where the
    caller left them out (a different balance is refused); and the ranks it runs the stages
    on when its schedule is the one in force."""
    if balance is not None and list(balance) != plan.balance:
        raise ValueError(f"balance {list(balance)} contradicts the plan's {plan.balance}; pass one")
    chunks = plan.microbatches if chunks is None else chunks
    schedule = schedule or plan.schedule
    planned_ranks = plan.pipeline_ranks if schedule == plan.schedule else None
    return plan.balance, chunks, schedule, checkpoint or plan.checkpoint, planned_ranks


def _check_asynchronous_options(
    schedule: str, checkpoint: str | None, weight_stashing: bool,
    weight_prediction: str | None, delay_compensation: object,
) -> None:
    """Recomputation is refused under the asynchronous schedules, their weight options under
    the others."""
    asynchronous = lookup(schedule).asynchronous
    if asynchronous and checkpoint not in (None, "never"):
        raise ValueError(
            f"schedule {schedule!r} keeps each micro-batch's graph on the weights it read; "
            f"activation recomputation (checkpoint={checkpoint!r}) would read the live "
            "weights instead: use checkpoint='never'"
        )
    if not asynchronous and (
        weight_prediction not in (None, AUTO) or not weight_stashing
        or delay_compensation not in (None, AUTO)
    ):
        raise ValueError(
            "weight_stashing, weight_prediction and delay_compensation apply to the "
            f"asynchronous schedules {' and '.join(map(repr, names(asynchronous=True)))}, not "
            f"to {schedule!r}"
        )
