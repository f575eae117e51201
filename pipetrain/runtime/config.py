"""Pipeline's options resolved once: a plan's choices merged with the caller's, defaults filled
in, every combination the runtime cannot run refused with the fix. ``Pipeline`` builds one
``PipelineConfig`` first and then only reads it; where the stages run (devices, process group,
replicas) is not part of it, except a plan's copies of the pipeline (``planned_replicas``).
Each option is declared, defaulted and checked alone in pipetrain/runtime/options.py; here its
combinations with the others and the plan are (a schedule's own defaults are its entry in
schedules/registry.py), and it is turned into the numbers the parts use: a stage gets where its
recomputation stops, its loss divisor and its autocast dtype, not the options to derive them
from.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from partitioner import Plan
from pipetrain.layer_tree import LayerTree
from pipetrain.observe.progress import Progress
from pipetrain.runtime.options import checked, renamed
from pipetrain.runtime.planning import load_plan
from pipetrain.runtime.stage import LossFn, OptimizerFactory, SchedulerFactory
from pipetrain.training.compensation import AUTO, DelayCompensation
from pipetrain.training.precision import autocast_dtype
from schedules import DEFAULT_SCHEDULE, Schedule, ScheduleSpec, lookup, names, spec_of, to_csv
from schedules.registry import recompute_below

T = TypeVar("T")


def check_balance(model: LayerTree, balance: Sequence[int]) -> list[int]:
    """``balance`` as a list, refused unless it splits ``model`` whole."""
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
    which checks it; ``autocast_dtype`` and ``loss_scaling`` are ``precision`` parsed,
    ``delay_compensation`` is parsed, ``trace`` falls back on PIPETRAIN_TRACE."""

    balance: tuple[int, ...]
    # the options (pipetrain/runtime/options.py), in its order, as resolved
    chunks: int
    schedule: str  # the name (given lists: theirs, as ``lists`` holds them)
    recompute: str | tuple[str, ...]  # one mode for every stage, or one per stage
    loss_fn: LossFn | None
    optimizer: OptimizerFactory | None
    lr_scheduler: SchedulerFactory | None
    precision: str
    clip_grad_norm: float | None
    nonfinite: str
    weight_stashing: bool
    weight_prediction: str | None
    delay_compensation: DelayCompensation | str | None  # "auto": resolved per stage (weights.py)
    timeout: float
    zero: int  # what replicas shard: 0 nothing .. 3 weights (pipetrain/runtime/sharding.py)
    reduce_scatter: str  # zero 2 and 3: "step" or "microbatch" (sharding.py)
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every: int
    deferred_batch_norm: bool
    cuda_graphs: bool | str  # False, True or "auto" (pipetrain/runtime/cuda_graphs.py)
    compile: bool | tuple[bool, ...]  # torch.compile each layer: every stage, or per stage
    check_batches: bool  # the ranks compare their first step's batches
    track_memory: bool
    trace: str | os.PathLike[str] | None
    progress: Progress | None
    # derived from the options
    autocast_dtype: torch.dtype | None
    loss_scaling: bool  # fp16's dynamic loss scale (pipetrain/training/precision.py)
    planned_ranks: int | None  # the ranks the plan places its stages on, when it decides that
    planned_microbatch: int | None  # the plan's micro-batch size: its times are for it
    planned_replicas: int | None  # the plan's copies of the pipeline: the world's replicas
    lists: Schedule | None  # the lists given as schedule=, unless the registry builds them

    def stage_recompute(self, stage: int) -> str:
        """The recomputation mode of ``stage``."""
        return _of_stage(self.recompute, stage)

    def stage_compile(self, stage: int) -> bool:
        """Whether ``stage``'s layers run through torch.compile (pipetrain/runtime/compiled.py)."""
        return _of_stage(self.compile, stage)

    def recompute_below(self, stage: int) -> int:
        """Where ``stage``'s recomputation stops: its training micro-batches numbered below
        this keep only their inputs and recompute their forward in the backward."""
        return recompute_below(self.stage_recompute(stage), self.chunks)

    @property
    def loss_divisor(self) -> int:
        """The micro-batches of one update, whose mean loss each backward's gradients are
        of: every micro-batch is an update of its own under PipeDream, else the mini-batch."""
        return 1 if self.update_per_microbatch else self.chunks

    @property
    def spec(self) -> ScheduleSpec:
        """What the rest of pipetrain knows of the schedule: its registry entry, or what
        given lists state (schedules.spec_of)."""
        return lookup(self.schedule) if self.lists is None else spec_of(self.lists)

    @property
    def lists_digest(self) -> str | None:
        """Given lists as every rank must hold them alike (their CSV's digest), else None."""
        if self.lists is None:
            return None
        return hashlib.sha256(to_csv(self.lists, communication=True).encode()).hexdigest()[:16]

    @property
    def update_per_microbatch(self) -> bool:
        """Whether every micro-batch is an update of its own (PipeDream)."""
        return self.spec.update_per_microbatch

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule never flushes between steps (PipeDream's family)."""
        return self.spec.asynchronous

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

    def check_ranks(self, ranks: int, placed: bool) -> None:
        """Refuse to run a plan's virtual stages, or given lists, on other than their number
        of ranks, once the devices or processes are ``placed`` (known)."""
        planned = self.planned_ranks
        if self.spec.multi_stage_per_rank and planned not in (None, ranks) and placed:
            raise ValueError(
                f"the plan runs its {len(self.balance)} {self.schedule} stages on {planned} "
                f"ranks but this pipeline has {ranks}; pass {planned} devices (or run "
                f"{planned} processes per replica)"
            )
        if self.lists is not None and self.lists.ranks != ranks and placed:
            raise ValueError(
                f"the schedule's lists place their {self.lists.stages} stages on "
                f"{self.lists.ranks} ranks ({self.lists.placement_text()}) but this pipeline "
                f"has {ranks}; pass {self.lists.ranks} devices (or run {self.lists.ranks} "
                f"processes per replica), or lists for {ranks} ranks"
            )

    @classmethod
    def resolve(
        cls, model: LayerTree, balance: Sequence[int] | None = None, **options: Any
    ) -> PipelineConfig:
        """The checked configuration of ``Pipeline(model, balance, **options)``: the options
        the config holds (options.py) are taken from ``options``, the others ignored."""
        given = renamed(options)
        values = checked("config", given)
        plan = values.pop("plan")
        values["planned_ranks"] = values["planned_microbatch"] = values["planned_replicas"] = None
        if plan is not None:
            plan = load_plan(plan, model)
            values["planned_microbatch"] = plan.microbatch_size
            balance = _from_plan(plan, balance, values, given)
        if balance is None:
            raise ValueError("say how to split the model: pass balance=[...] or plan=...")
        values["lists"] = None
        if isinstance(values["schedule"], Schedule):
            _take_lists(values["schedule"], values, len(balance))
        values["chunks"] = values["chunks"] or 1
        schedule = values["schedule"] = values["schedule"] or DEFAULT_SCHEDULE
        spec = lookup(schedule) if values["lists"] is None else spec_of(values["lists"])
        if not spec.runnable:
            raise ValueError(
                f"schedule {schedule!r} can be validated and simulated (schedules.build) but "
                f"the runtime does not execute it yet; train with one of {names(runnable=True)}"
            )
        _check_asynchronous_options(values, spec.asynchronous)
        # a CUDA graph cannot recompute: with graphs wanted, keep activations unless told
        default = "never" if values["cuda_graphs"] else spec.checkpoint
        values["recompute"] = _per_stage(
            "recompute", values["recompute"] or default, len(balance), "modes", "string"
        )
        values["compile"] = _per_stage("compile", values["compile"], len(balance), "values", "bool")
        if values["cuda_graphs"] and values["compile"] is not False:  # a tuple holds a True
            raise ValueError(
                "cuda_graphs captures each stage's eager forward and backward, and compile "
                "replaces them with compiled code: pass one of cuda_graphs= and compile="
            )
        _check_step_options(values, spec.asynchronous)
        if values["reduce_scatter"] != "step" and values["zero"] < 2:
            raise ValueError(
                f"reduce_scatter={values['reduce_scatter']!r} says when zero 2 and 3 "
                f"reduce-scatter the sharded gradients, but zero={values['zero']} keeps them "
                "whole (all-reduced once per step): pass zero=2 or 3 with it, or leave "
                "reduce_scatter out"
            )
        dtype = values["autocast_dtype"] = autocast_dtype(values["precision"])
        values["loss_scaling"] = dtype is torch.float16
        return cls(balance=tuple(check_balance(model, balance)), **values)


def _per_stage(
    name: str, value: str | bool | Sequence[Any], stages: int, what: str, one: str
) -> Any:
    """Option ``name``'s ``value`` (its members checked by options.py): one for every stage,
    or one per stage (a tuple unless they are all one)."""
    if isinstance(value, str | bool):
        return value
    members = tuple(value)
    if len(members) != stages:
        raise ValueError(
            f"{name} lists {len(members)} {what} for {stages} stages; give one per stage, "
            f"or one {one} for all"
        )
    return members[0] if len(set(members)) == 1 else members


def _of_stage(value: T | tuple[T, ...], stage: int) -> T:
    """A per-stage option's value for ``stage`` (see :func:`_per_stage`)."""
    return value[stage] if isinstance(value, tuple) else value


PLANNED: tuple[tuple[str, str, str, Callable[[Any, int], str]], ...] = (
    # option, the Plan field holding it, the config field taking it, the search's arguments
    # planning for a value (with so many ranks per pipeline)
    ("zero", "zero", "zero", lambda value, ranks: f"--devices N --batch-size B --zero {value}"),
    ("reduce_scatter", "reduce_scatter", "reduce_scatter",
     lambda value, ranks: f"--devices N --batch-size B --reduce-scatter {value}"),
    ("replicas", "data_parallel", "planned_replicas",
     lambda value, ranks: f"--devices {ranks * value} --batch-size B --stages {ranks}"),
)
"""Options a plan sets: its memory and step time are predicted for them, so a different value
given too is refused, as a different balance is."""


def _from_plan(
    plan: Plan, balance: Sequence[int] | None, values: dict[str, Any], given: Mapping[str, Any]
) -> list[int]:
    """The plan's balance (a different one is refused); its micro-batch count, schedule and
    per-stage recomputation modes put in ``values`` where the caller left them out, and the ranks
    it runs the stages on when its schedule is the one in force; its zero level, reduce-scatter
    mode and copies of the pipeline (``planned_replicas``) unless ``given`` contradicts them."""
    if balance is not None and list(balance) != plan.balance:
        raise ValueError(f"balance {list(balance)} contradicts the plan's {plan.balance}; pass one")
    values["chunks"] = plan.microbatches if values["chunks"] is None else values["chunks"]
    values["schedule"] = values["schedule"] or plan.schedule
    values["recompute"] = values["recompute"] or plan.checkpoints
    if values["schedule"] == plan.schedule:
        values["planned_ranks"] = plan.pipeline_ranks
    for option, field, taken, flags in PLANNED:
        planned, value = getattr(plan, field), given.get(option)
        if value not in (None, planned):
            again = flags(value, plan.pipeline_ranks)
            raise ValueError(
                f"{option}={value!r} contradicts the plan's {field} {planned!r}, which its "
                f"memory and step time are predicted for: leave {option}= out to run the "
                f"plan's, or plan for {option}={value!r} (`pipetrain plan PROFILE {again}`)"
            )
        values[taken] = planned
    if plan.data_parallel > 1 and given.get("devices") is not None:
        raise ValueError(
            f"the plan runs {plan.data_parallel} copies of its pipeline, a process per rank, but "
            "devices= runs one copy in this process: start its "
            f"{plan.pipeline_ranks * plan.data_parallel} processes (`pipetrain train`, or "
            "torchrun) without devices=, or plan for one copy"
        )
    return plan.balance


def _take_lists(lists: Schedule, values: dict[str, Any], stages: int) -> None:
    """``lists``, given as schedule=, checked against the stages and micro-batches and put in
    ``values``: as their name where the registry builds them under it, else as lists
    (``lists``, their name in ``schedule``) and their micro-batch count where chunks is
    left out."""
    if lists.stages != stages:
        raise ValueError(
            f"the schedule's lists run {lists.stages} stages but balance has {stages} entries; "
            f"pass a balance of {lists.stages} entries (one per stage) or lists for {stages} "
            "stages"
        )
    if values["chunks"] not in (None, lists.microbatches):
        raise ValueError(
            f"the schedule's lists run {lists.microbatches} micro-batches per mini-batch but "
            f"chunks={values['chunks']}; pass chunks={lists.microbatches} or leave chunks out "
            f"(it defaults to the lists'), or lists for {values['chunks']} micro-batches"
        )
    values["chunks"], values["schedule"] = lists.microbatches, lists.name
    registered = lists.name in names()
    if registered and spec_of(lists) is lookup(lists.name):
        return  # the registry's own lists: run as that name
    if registered:
        raise ValueError(
            f"the schedule's lists are named {lists.name!r} but are not what the registry "
            f"builds under that name at this size; name them otherwise, e.g. "
            "schedules.from_csv(text, name='mine')"
        )
    if lists.asynchronous:
        raise ValueError(
            f"asynchronous lists run only under their registered name, one of "
            f"{names(asynchronous=True)}; {lists.name!r} is none of them"
        )
    values["lists"] = lists


def _check_asynchronous_options(values: Mapping[str, Any], asynchronous: bool) -> None:
    """The asynchronous schedules' weight options are refused under the others; under them,
    recomputation without stashing on a stage that updates between a micro-batch's forward and
    backward (every stage but the last): the weights its forward read are gone by then."""
    schedule, recompute = values["schedule"], values["recompute"]
    modes = [recompute] if recompute is None or isinstance(recompute, str) else recompute[:-1]
    stale = not values["weight_stashing"] and values["weight_prediction"] in (None, AUTO)
    if asynchronous and stale and set(modes) - {None, "never"}:
        raise ValueError(
            f"schedule {schedule!r} with weight_stashing=False keeps no copy of the weights a "
            f"forward read, so a recomputed forward (recompute={recompute!r}) would read the "
            "newer live weights of its backward instead: keep weight_stashing=True "
            "(recomputation then reads the stashed version), or use recompute='never' (without "
            "stashing a stage keeps only its inputs and recomputes at the backward anyway), or "
            "recompute only the last stage, which updates after the backward"
        )
    if not asynchronous and (
        values["weight_prediction"] not in (None, AUTO) or not values["weight_stashing"]
        or values["delay_compensation"] not in (None, AUTO)
    ):
        raise ValueError(
            "weight_stashing, weight_prediction and delay_compensation apply to the "
            f"asynchronous schedules {' and '.join(map(repr, names(asynchronous=True)))}, not "
            f"to {schedule!r}"
        )


def _check_step_options(values: Mapping[str, Any], asynchronous: bool) -> None:
    """Refuse what the optimizer step cannot do (pipetrain/runtime/update.py), naming the
    alternative."""
    schedule = values["schedule"]
    if values["lr_scheduler"] is not None and values["optimizer"] is None:
        raise ValueError("lr_scheduler schedules the optimizer's learning rate: pass optimizer=")
    if asynchronous and values["precision"] == "fp16":
        raise ValueError(
            f"precision='fp16' needs every stage to skip the same update on an overflow, but "
            f"schedule {schedule!r} updates each stage at its own time: use precision='bf16' "
            "(no loss scaling), or a synchronous schedule such as '1f1b' with fp16"
        )
