"""Every keyword option of ``Pipeline``, declared once: its name, type, default, check, one
line of doc, the group a user looks for it in, and the part that takes it.

``Pipeline.__init__`` takes them as ``**options`` typed by ``PipelineOptions`` (PEP 692, so
type checkers check a caller's keywords) and shows them to help() and IDEs through a signature
built from this table (:func:`with_options`); ``PipelineConfig`` holds the resolved ones.
tests/runtime/test_options.py fails when ``PipelineOptions``, the config's fields or the Args
section of Pipeline's docstring drift from ``OPTIONS``. Adding an option is one ``Option``
here, its key in ``PipelineOptions``, its Args entry in pipeline.py, and a field in config.py
if the config holds it. Checks here see one option alone; checks across options are
``PipelineConfig.resolve``'s.
"""

from __future__ import annotations

import difflib
import inspect
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict, TypeVar, cast

import torch
import torch.distributed as dist
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from partitioner import Plan
from pipetrain.observe.progress import Progress, progress_option
from pipetrain.runtime.compiled import compile_option
from pipetrain.runtime.cuda_graphs import check_mode
from pipetrain.runtime.sharding import check_level, check_reduce_scatter
from pipetrain.runtime.stage_optimizer import OptimizerFactory, SchedulerFactory
from pipetrain.runtime.stage_slice import LossFn
from pipetrain.training.compensation import AUTO, DelayCompensation, parse_option
from pipetrain.training.lazy import InitFn
from pipetrain.training.precision import autocast_dtype
from schedules.action import Schedule
from schedules.registry import RECOMPUTE_MODES, names

NONFINITE = ("skip", "raise")
PARTS = ("config", "world", "layers")  # PipelineConfig, make_world, LayerSource


def _as_given(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Option:
    """One keyword option. ``type`` is the annotation Pipeline's signature shows (as written
    in ``PipelineOptions``); ``check(value)`` refuses a bad value with the fix and returns it as the
    taking part holds it; ``part`` is one of PARTS."""

    name: str
    type: str
    default: Any
    doc: str
    group: str
    check: Callable[[Any], Any] = _as_given
    part: str = "config"


def _chunks(chunks: object) -> object:
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    return chunks


def _schedule(schedule: object) -> object:
    """Refuse a ``schedule`` that is neither a name nor lists (its name is checked with the
    other options, in config.py)."""
    if schedule is not None and not isinstance(schedule, str | Schedule):
        raise ValueError(
            f"schedule must be a registered name, one of {names()}, or a schedules.Schedule "
            f"(schedules.from_csv(text), say), got {type(schedule).__name__}"
        )
    return schedule


def _recompute(recompute: object) -> object:
    """Refuse a ``recompute`` that is neither a mode nor a list or tuple of modes."""
    modes = ", ".join(repr(m) for m in RECOMPUTE_MODES)
    if recompute is None:
        return None
    if not isinstance(recompute, str | list | tuple):
        raise TypeError(
            f"recompute must be one of {modes} (a str) or a list of one per stage, got "
            f"{type(recompute).__name__} {recompute!r}"
        )
    for i, mode in enumerate([recompute] if isinstance(recompute, str) else recompute):
        where = "recompute" if isinstance(recompute, str) else f"recompute[{i}]"
        if not isinstance(mode, str):
            raise TypeError(f"{where} must be one of {modes} (a str), got "
                            f"{type(mode).__name__} {mode!r}")
        if mode not in RECOMPUTE_MODES:
            raise ValueError(f"{where} must be one of {RECOMPUTE_MODES}, got {mode!r}")
    return recompute


def _loss_fn(loss_fn: object) -> object:
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
    return loss_fn


def _optimizer(optimizer: object) -> object:
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
    return optimizer


def _lr_scheduler(lr_scheduler: object) -> object:
    if isinstance(lr_scheduler, LRScheduler | ReduceLROnPlateau) or (
        lr_scheduler is not None and not callable(lr_scheduler)
    ):
        raise TypeError(
            "lr_scheduler must be a factory of each stage's optimizer, got "
            f"{type(lr_scheduler).__name__}: pass lr_scheduler=lambda optimizer: "
            "torch.optim.lr_scheduler.LambdaLR(optimizer, ...)"
        )
    return lr_scheduler


def _precision(precision: object) -> object:
    autocast_dtype(precision)  # type: ignore[arg-type]  # refuses an unknown one
    return precision


def _clip_grad_norm(max_norm: object) -> object:
    if max_norm is not None and (
        isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or not max_norm > 0
    ):
        raise ValueError(f"clip_grad_norm must be a positive number or None, got {max_norm!r}")
    return max_norm


def _nonfinite(mode: object) -> object:
    if mode not in NONFINITE:
        raise ValueError(
            f"nonfinite must be 'skip' (skip a step whose loss or gradients are not finite, "
            f"with a warning) or 'raise' (stop with NonFiniteError), got {mode!r}"
        )
    return mode


def _timeout(timeout: object) -> object:
    if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not timeout > 0:
        raise ValueError(
            f"timeout must be a positive number of seconds (how long a stage waits for a "
            f"peer before giving up), got {timeout!r}"
        )
    return timeout


def _trace(folder: object) -> object:
    """The folder, else the PIPETRAIN_TRACE environment variable's, else None (off)."""
    return folder or os.environ.get("PIPETRAIN_TRACE") or None


SPLIT, TRAINING, STEP, ASYNC = "split", "training", "the step", "asynchronous schedules"
PLACEMENT, LAYERS, SAVING, RUNNING, OBSERVE = (
    "placement", "layer values", "saving", "execution", "observation"
)

OPTIONS: tuple[Option, ...] = (
    Option("plan", "str | os.PathLike[str] | Plan | None", None,
           "a ``partitioner.Plan`` or its JSON file (from ``pipetrain plan``)", SPLIT),
    Option("chunks", "int | None", None, "micro-batches per mini-batch", SPLIT, _chunks),
    Option("schedule", "str | Schedule | None", None,
           "the schedule's name in schedules/registry.py, or its lists (a ``schedules.Schedule``)",
           SPLIT, _schedule),
    Option("recompute", "str | Sequence[str] | None", None, "activation recomputation", SPLIT,
           _recompute),
    Option("loss_fn", "LossFn | None", None,
           "``loss_fn(output, target)``, a scalar, on the last stage", TRAINING, _loss_fn),
    Option("optimizer", "OptimizerFactory | None", None,
           "a factory, ``lambda params: torch.optim.AdamW(params, ...)``", TRAINING, _optimizer),
    Option("lr_scheduler", "SchedulerFactory | None", None,
           "a factory, ``lambda optimizer: ...``: one learning-rate schedule per stage "
           "optimizer", TRAINING, _lr_scheduler),
    Option("precision", "str", "fp32", '"fp32" (default), "bf16" or "fp16"', STEP, _precision),
    Option("clip_grad_norm", "float | None", None,
           "clip by the norm of the whole model's gradients (asynchronous: each stage's)",
           STEP, _clip_grad_norm),
    Option("nonfinite", "str", "skip",
           'synchronous schedules: "skip" (default) skips a step whose loss or gradients are '
           "not finite on any stage", STEP, _nonfinite),
    Option("weight_stashing", "bool", True,
           "asynchronous schedules: a micro-batch's forward and backward read one weight "
           "version", ASYNC),
    Option("weight_prediction", "str | None", AUTO,
           'asynchronous schedules: "momentum", "spectrain" or "msnag" run both passes on the '
           "weights predicted", ASYNC),
    Option("delay_compensation", "str | DelayCompensation | None", AUTO,
           'async: "spike", "lag-lr", "lag-momentum", "pipemare", "error-feedback", several '
           'joined by "+", or a DelayCompensation', ASYNC, parse_option),
    Option("devices", "Sequence[str | torch.device] | None", None,
           "one device per rank to run every stage in this process", PLACEMENT, part="world"),
    Option("group", "dist.ProcessGroup | None", None, "the process group of the job",
           PLACEMENT, part="world"),
    Option("replicas", "int | None", None, "data-parallel copies of the pipeline", PLACEMENT,
           part="world"),
    Option("timeout", "float", 300.0,
           "seconds a stage waits for a peer before it raises CommunicationTimeout", PLACEMENT,
           _timeout),
    Option("zero", "int", 0, "what each stage's data-parallel replicas shard among them",
           PLACEMENT, check_level),
    Option("reduce_scatter", "str", "step",
           "when zero 2 and 3 reduce-scatter each stage's gradients", PLACEMENT,
           check_reduce_scatter),
    Option("init_seed", "int | None", None, "the per-layer initialization rule's seed", LAYERS,
           part="layers"),
    Option("init", "InitFn | None", None,
           "``init(layer)``, the rule's initialization of one layer", LAYERS, part="layers"),
    Option("weights", "str | os.PathLike[str] | None", None,
           "a whole-model ``.safetensors`` or ``.pt`` file, keys as in ``model.state_dict()``",
           LAYERS, part="layers"),
    Option("checkpoint_dir", "str | os.PathLike[str] | None", None,
           "resume from the newest checkpoint in this folder, if any", SAVING),
    Option("checkpoint_every", "int", 0,
           "with ``checkpoint_dir``, save a checkpoint there every this many steps", SAVING),
    Option("deferred_batch_norm", "bool", False,
           "make BatchNorm's running statistics those of the whole mini-batch", RUNNING),
    Option("cuda_graphs", "bool | str", False,
           "True captures each stage's training forward and backward as CUDA graphs", RUNNING,
           check_mode),
    Option("compile", "bool | Sequence[bool]", False,
           "True runs each layer of every stage through ``torch.compile``; or a list of one "
           "bool per stage", RUNNING, compile_option),
    Option("check_batches", "bool", True,
           "on the first step, and the first after a resume, the ranks compare the batches "
           "they were given", RUNNING, bool),
    Option("track_memory", "bool", False, "count the bytes each stage saves for backward",
           OBSERVE),
    Option("trace", "str | os.PathLike[str] | None", None,
           "a folder where each rank writes the actions it ran, with times", OBSERVE, _trace),
    Option("progress", "bool | Progress", False,
           "True prints each step's metrics on the first rank", OBSERVE, progress_option),
)
BY_NAME = {option.name: option for option in OPTIONS}


class PipelineOptions(TypedDict, total=False):
    """``Pipeline``'s keyword options as a type checker reads them: OPTIONS' names and types,
    in its order (tests/runtime/test_options.py holds them equal)."""

    plan: str | os.PathLike[str] | Plan | None
    chunks: int | None
    schedule: str | Schedule | None
    recompute: str | Sequence[str] | None
    loss_fn: LossFn | None
    optimizer: OptimizerFactory | None
    lr_scheduler: SchedulerFactory | None
    precision: str
    clip_grad_norm: float | None
    nonfinite: str
    weight_stashing: bool
    weight_prediction: str | None
    delay_compensation: str | DelayCompensation | None
    devices: Sequence[str | torch.device] | None
    group: dist.ProcessGroup | None
    replicas: int | None
    timeout: float
    zero: int
    reduce_scatter: str
    init_seed: int | None
    init: InitFn | None
    weights: str | os.PathLike[str] | None
    checkpoint_dir: str | os.PathLike[str] | None
    checkpoint_every: int
    deferred_batch_norm: bool
    cuda_graphs: bool | str
    compile: bool | Sequence[bool]
    check_batches: bool
    track_memory: bool
    trace: str | os.PathLike[str] | None
    progress: bool | Progress
    checkpoint: str | Sequence[str] | None  # deprecated: RENAMED, the old name of recompute


Init = TypeVar("Init", bound=Callable[..., None])


def with_options(init: Init) -> Init:
    """``init`` (``Pipeline.__init__``, which takes ``**options``) shown with every option of
    OPTIONS in its place, keyword-only, with its default and type, as help(), IDEs and
    ``inspect.signature`` list them."""
    own = inspect.signature(init)
    head = [p for p in own.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    keywords = [
        inspect.Parameter(o.name, inspect.Parameter.KEYWORD_ONLY, default=o.default,
                          annotation=o.type)
        for o in OPTIONS
    ]
    cast(Any, init).__signature__ = own.replace(parameters=[*head, *keywords])
    return init


RENAMED = {"checkpoint": "recompute"}
"""Options renamed, old name -> new: the old name still works, with a FutureWarning, for one
release (CHANGELOG.md says which). ``checkpoint`` was activation recomputation, beside
``checkpoint_dir`` and ``checkpoint_every``, which save."""


def renamed(given: Mapping[str, Any]) -> dict[str, Any]:
    """``given`` with each old name of RENAMED replaced by its new one, warning that the
    old name goes; both names at once are refused."""
    options = dict(given)
    for old, new in RENAMED.items():
        if old not in options:
            continue
        if new in options:
            raise TypeError(f"Pipeline() got both {old}= and {new}=; {old}= is the old name "
                            f"of {new}=: pass {new}= only")
        warnings.warn(f"Pipeline(..., {old}=...) is now {new}=...; the old name goes in the "
                      "next release", FutureWarning, stacklevel=3)
        options[new] = options.pop(old)
    return options


def refuse_unknown(given: Mapping[str, Any]) -> None:
    """Refuse keywords that are no option, as Python refuses an unexpected keyword argument,
    with the closest option's name."""
    unknown = [name for name in given if name not in BY_NAME]
    if not unknown:
        return
    named = []
    for name in unknown:
        close = difflib.get_close_matches(name, BY_NAME, n=1)
        named.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    raise TypeError(
        f"Pipeline() got an unexpected keyword argument {', '.join(named)}; its options are "
        f"{', '.join(BY_NAME)}"
    )


def checked(part: str, given: Mapping[str, Any]) -> dict[str, Any]:
    """Every option ``part`` takes, from ``given`` (an option left out: its default), each
    checked alone and as the part holds it. A keyword that is no option is refused
    (:func:`refuse_unknown`); one another part takes is left to it."""
    refuse_unknown(given)
    return {o.name: o.check(given.get(o.name, o.default)) for o in OPTIONS if o.part == part}
