"""Pipeline's options resolved once: a plan's choices merged with the caller's, defaults filled
in, every combination the runtime cannot run refused with the fix. ``Pipeline`` builds one
``PipelineConfig`` first and then only reads it; where the stages run (devices, process group,
replicas) is not part of it. Each option is checked and defaulted here and nowhere else (a
schedule's own defaults are its entry in schedules/registry.py), and turned into the numbers
the parts use: a stage gets where its recomputation stops, its loss divisor and its autocast
dtype, not the options to derive them from.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim.lr_scheduler import ReduceLROnPlateau

from partitioner import Plan
from pipetrain.observe.progress import Progress, progress_option
from pipetrain.runtime.cuda_graphs import check_mode
from pipetrain.runtime.planning import load_plan
from pipetrain.runtime.sharding import check_level
from pipetrain.runtime.stage import LossFn, OptimizerFactory, SchedulerFactory
from pipetrain.training.compensation import AUTO, DelayCompensation, parse_option
from pipetrain.training.precision import autocast_dtype
from schedules import lookup, names
from schedules.registry import RECOMPUTE_MODES

NONFINITE = ("skip", "raise")


def recompute_below(mode: str, microbatches: int) -> int:
    """Micro-batches numbered below this recompute their forward in the backward under
    checkpoint ``mode`` (torchgpipe's modes), with ``microbatches`` per mini-batch."""
    stops = {"never": 0, "except_last": microbatches - 1, "always": microbatches}
    if mode not in stops:
        raise ValueError(f"checkpoint must be one of {RECOMPUTE_MODES}, got {mode!r}")
    return stops[mode]


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
    which checks it; ``autocast_dtype``, ``loss_scaling`` and ``compensation`` are
    ``precision`` and ``delay_compensation`` parsed, ``trace`` falls back on PIPETRAIN_TRACE."""

    balance: tuple[int, ...]
    chunks: int
    schedule: str
    checkpoint: str | tuple[str, ...]  # one mode for every stage, or one per stage
    timeout: float
    loss_fn: LossFn | None
    optimizer: OptimizerFactory | None
    lr_scheduler: SchedulerFactory | None
    precision: str
    autocast_dtype: torch.dtype | None
    loss_scaling: bool  # fp16's dynamic loss scale (pipetrain/training/precision.py)
    clip_grad_norm: float | None
    nonfinite: str
    weight_stashing: bool
    weight_prediction: str | None
    compensation: DelayCompensation | str | None  # "auto": resolved per stage (weights.py)
    deferred_batch_norm: bool
    track_memory: bool
    trace: str | os.PathLike[str] | None
    progress: Progress | None
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every: int
    planned_ranks: int | None  # the ranks the plan places its stages on, when it decides that
    planned_microbatch: int | None = None  # the plan's micro-batch size: its times are for it
    cuda_graphs: bool | str = False  # False, True or "auto" (pipetrain/runtime/cuda_graphs.py)
    check_batches: bool = True  # the ranks compare their first step's batches
    zero: int = 0  # what replicas shard: 0 nothing .. 3 weights (pipetrain/runtime/sharding.py)

    def stage_checkpoint(self, stage: int) -> str:
        """The recomputation mode of ``stage``."""
        return self.checkpoint if isinstance(self.checkpoint, str) else self.checkpoint[stage]

    def recompute_below(self, stage: int) -> int:
        """Where ``stage``'s recomputation stops: its training micro-batches numbered below
        this keep only their inputs and recompute their forward in the backward."""
        return recompute_below(self.stage_checkpoint(stage), self.chunks)

    @property
    def loss_divisor(self) -> int:
        """The micro-batches of one update, whose mean loss each backward's gradients are
        of: every micro-batch is an update of its own under PipeDream, else the mini-batch."""
        return 1 if lookup(self.schedule).update_per_microbatch else self.chunks

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule never flushes between steps (PipeDream's family)."""
        return lookup(self.schedule).asynchronous

    def check_trainable(self) -> None:
        """Refuse to train without an optimizer (the weights would never change, silently) or
        a loss function. Built without them, a pipeline still evaluates: that is legitimate,
        so the refusal comes at the first train_step, not at construction."""
        missing = [name for name, value in (("optimizer", self.optimizer),
                                            ("loss_fn", self.loss_fn)) if value is None]
        if missing:
            raise ValueError(
                f"train_step needs {' and '.join(missing)}, and this pipeline was built without: "
                "pass Pipeline(..., loss_fn=torch.nn.functional.cross_entropy, "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)); without them a "
                "pipeline can only evaluate (eval_step)"
            )

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
        checkpoint: str | Sequence[str] | None = None,
        loss_fn: LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
        timeout: float = 300.0,
        deferred_batch_norm: bool = False,
        track_memory: bool = False,
        trace: str | os.PathLike[str] | None = None,
        progress: bool | Progress = False,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        weight_stashing: bool = True,
        weight_prediction: str | None = AUTO,
        precision: str = "fp32",
        clip_grad_norm: float | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        delay_compensation: str | DelayCompensation | None = AUTO,
        cuda_graphs: bool | str = False,
        nonfinite: str = "skip",
        check_batches: bool = True,
        zero: int = 0,
    ) -> PipelineConfig:
        """The checked configuration of ``Pipeline(model, balance, **options)``."""
        _check_checkpoint_type(checkpoint)
        planned_ranks = planned_microbatch = None
        if plan is not None:
            plan = load_plan(plan, model)
            planned_microbatch = plan.microbatch_size
            balance, chunks, schedule, checkpoint, planned_ranks = _from_plan(
                plan, balance, chunks, schedule, checkpoint
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
        # a CUDA graph cannot recompute: with graphs wanted, keep activations unless told
        graphs = check_mode(cuda_graphs)
        modes = _checkpoint_modes(
            checkpoint or ("never" if graphs else spec.checkpoint), len(balance)
        )
        dtype = _check_step_options(
            optimizer, lr_scheduler, precision, clip_grad_norm, schedule, spec.asynchronous
        )
        _check_loss_fn(loss_fn)
        _check_nonfinite(nonfinite)
        if not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
        return cls(
            balance=tuple(check_balance(model, balance)), chunks=chunks, schedule=schedule,
            checkpoint=modes, timeout=timeout, loss_fn=loss_fn, optimizer=optimizer,
            lr_scheduler=lr_scheduler, precision=precision, autocast_dtype=dtype,
            loss_scaling=dtype is torch.float16,
            clip_grad_norm=clip_grad_norm, nonfinite=nonfinite, weight_stashing=weight_stashing,
            weight_prediction=weight_prediction, compensation=compensation,
            deferred_batch_norm=deferred_batch_norm, track_memory=track_memory,
            trace=trace or os.environ.get("PIPETRAIN_TRACE") or None,
            progress=progress_option(progress),
            checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            planned_ranks=planned_ranks, planned_microbatch=planned_microbatch,
            cuda_graphs=graphs, check_batches=bool(check_batches), zero=check_level(zero),
        )


def _checkpoint_modes(checkpoint: str | Sequence[str], stages: int) -> str | tuple[str, ...]:
    """``checkpoint`` checked: one mode, or one per stage (a tuple unless they are all one)."""
    if isinstance(checkpoint, str):
        recompute_below(checkpoint, 1)
        return checkpoint
    modes = tuple(checkpoint)
    if len(modes) != stages:
        raise ValueError(
            f"checkpoint lists {len(modes)} modes for {stages} stages; give one per stage, "
            "or one string for all"
        )
    for mode in modes:
        recompute_below(mode, 1)
    return modes[0] if len(set(modes)) == 1 else modes


def _from_plan(
    plan: Plan, balance: Sequence[int] | None, chunks: int | None, schedule: str | None,
    checkpoint: str | Sequence[str] | None,
) -> tuple[Sequence[int], int, str, str | Sequence[str], int | None]:
    """The plan's balance, and its micro-batch count, schedule and per-stage checkpoint modes
    where the caller left them out (a different balance is refused); and the ranks it runs
    the stages on when its schedule is the one in force."""
    if balance is not None and list(balance) != plan.balance:
        raise ValueError(f"balance {list(balance)} contradicts the plan's {plan.balance}; pass one")
    chunks = plan.microbatches if chunks is None else chunks
    schedule = schedule or plan.schedule
    planned_ranks = plan.pipeline_ranks if schedule == plan.schedule else None
    return plan.balance, chunks, schedule, checkpoint or plan.checkpoints, planned_ranks


def _check_loss_fn(loss_fn: object) -> None:
    """Refuse a ``loss_fn`` that cannot be called on (output, target) now, not at the first
    step inside the last stage."""
    if isinstance(loss_fn, type):
        raise TypeError(
            f"loss_fn is the class {loss_fn.__name__}, not a loss: pass an instance, "
            f"loss_fn={loss_fn.__name__}(), or a function of (output, target)"
        )
    if loss_fn is not None and not callable(loss_fn):
        raise TypeError(
            f"loss_fn must be a function of (output, target) returning a scalar tensor, got "
            f"{type(loss_fn).__name__}: e.g. loss_fn=torch.nn.functional.cross_entropy"
        )


def _check_checkpoint_type(checkpoint: object) -> None:
    """Refuse a ``checkpoint`` that is neither a mode nor a list or tuple of modes (a
    TypeError naming the accepted values), before anything iterates over it."""
    modes = ", ".join(repr(m) for m in RECOMPUTE_MODES)
    if checkpoint is None or isinstance(checkpoint, str):
        return
    if not isinstance(checkpoint, list | tuple):
        raise TypeError(
            f"checkpoint must be one of {modes} (a str) or a list of one per stage, got "
            f"{type(checkpoint).__name__} {checkpoint!r}"
        )
    for i, mode in enumerate(checkpoint):
        if not isinstance(mode, str):
            raise TypeError(
                f"checkpoint[{i}] must be one of {modes} (a str), got "
                f"{type(mode).__name__} {mode!r}"
            )


def _check_asynchronous_options(
    schedule: str, checkpoint: str | Sequence[str] | None, weight_stashing: bool,
    weight_prediction: str | None, delay_compensation: object,
) -> None:
    """Recomputation is refused under the asynchronous schedules, their weight options under
    the others."""
    modes = [checkpoint] if checkpoint is None or isinstance(checkpoint, str) else checkpoint
    asynchronous = lookup(schedule).asynchronous
    if asynchronous and set(modes) - {None, "never"}:
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


def _check_step_options(
    optimizer: object, lr_scheduler: object, precision: str, max_norm: float | None,
    schedule: str, asynchronous: bool,
) -> torch.dtype | None:
    """Refuse what the optimizer step cannot do (pipetrain/runtime/update.py), naming the
    alternative; return the autocast dtype of ``precision``."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "optimizer is an optimizer instance, but each stage builds its own from its "
            "parameters: pass a factory: optimizer=lambda params: torch.optim.SGD(params, ...)"
        )
    if optimizer is not None and not callable(optimizer):
        raise TypeError(
            f"optimizer must be a factory of the stage's parameters, got "
            f"{type(optimizer).__name__}: optimizer=lambda params: torch.optim.SGD(params, ...)"
        )
    if isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler | ReduceLROnPlateau) or (
        lr_scheduler is not None and not callable(lr_scheduler)
    ):
        raise TypeError(
            "lr_scheduler must be a factory of each stage's optimizer, got "
            f"{type(lr_scheduler).__name__}: pass lr_scheduler=lambda optimizer: "
            "torch.optim.lr_scheduler.LambdaLR(optimizer, ...)"
        )
    if lr_scheduler is not None and optimizer is None:
        raise ValueError("lr_scheduler schedules the optimizer's learning rate: pass optimizer=")
    dtype = autocast_dtype(precision)
    if max_norm is not None and (
        isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0
    ):
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {max_norm!r}")
    if asynchronous and precision == "fp16":
        raise ValueError(
            f"precision='fp16' needs every stage to skip the same update on an overflow, but "
            f"schedule {schedule!r} updates each stage at its own time: use precision='bf16' "
            "(no loss scaling), or a synchronous schedule such as '1f1b' with fp16"
        )
    if asynchronous and max_norm is not None:
        raise ValueError(
            f"clip_grad_norm needs the whole model's gradients of one update, but schedule "
            f"{schedule!r} updates each stage at its own time: use a synchronous schedule "
            "such as '1f1b' or 'interleaved' to clip, or drop clip_grad_norm"
        )
    return dtype


def _check_nonfinite(mode: object) -> None:
    """Refuse an unknown ``nonfinite`` mode, naming the choices."""
    if mode not in NONFINITE:
        raise ValueError(
            f"nonfinite must be 'skip' (skip a step whose loss or gradients are not finite, "
            f"with a warning) or 'raise' (stop with NonFiniteError), got {mode!r}"
        )
