"""The plan: the contract between planning and running, as a dataclass and a JSON file.

JSON format (``version`` 1; times in seconds, sizes in bytes)::

    {
      "format": "pipetrain-plan", "version": 1,
      "schedule": "1f1b", "stages": 2, "microbatches": 8, "microbatch_size": 32,
      "checkpoint": "never", "device": "...", "solver": "dp",
      "balance": [3, 2],
      "stage_to_rank": [0, 1],             (or [[0, 1], [2]] when a stage is replicated)
      "bottleneck": 0.012, "step_time": 0.11, "bubble_fraction": 0.11,
      "samples_per_second": 2327.3,
      "host": {"cores": null, "overhead": 0.0},   (optional; this is its default)
      "per_stage": [
        {"layers": [0, 3], "ranks": [0], "names": ["0", "1", "2"], "param_counts": [10, 0, 20],
         "forward_time": 0.004, "backward_time": 0.008, "compute_time": 0.012,
         "allreduce_time": 0.0, "transfer_time": 0.0004, "transfer_bytes": 1048576,
         "memory_bytes": 123456789, "weight_time": 0.004, "checkpoint": "never"},
        ...
      ]
    }

``layers`` is the half-open range of layer indices of the stage. Per-stage times are seconds per
micro-batch (a replicated stage's replicas take turns, so its times are divided by the number of
ranks); ``compute_time`` is forward + backward + the all-reduce amortised over the step's
micro-batches, ``allreduce_time`` the all-reduce once per step; ``transfer_time`` and
``transfer_bytes`` describe one activation message to the next stage; ``weight_time`` (optional,
0 when absent) is the part of ``backward_time`` that computes weight gradients, which the
zero-bubble schedules run apart (see ``partitioner.costs.weight_gradient_share``). The plan's
``checkpoint`` is what the planner was asked ("never", "auto" or "always"); each stage's
``checkpoint`` is what it chose for that stage, "never" or "always" (recompute the forward in
backward: ``backward_time`` includes it); a file without it (older) means the plan's own. Under
"interleaved" several stages share a rank (``stage_to_rank`` [0, 1, 0, 1]: 2 ranks).
``host`` says what the prediction assumed beyond the profile (see :class:`Host`).
Optional (their defaults when absent): ``reduce_scatter`` ("step"), ``zero`` (0: the
``Pipeline(zero=)`` the memory counts) and ``data_parallel`` (1: how many copies of the whole
pipeline run in data parallel, each ``microbatches`` micro-batches of ``microbatch_size``; the
run takes ``pipeline ranks x data_parallel`` processes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, get_type_hints

from partitioner.errors import PlanFileError, PlanMismatchError
from partitioner.fields import typed
from partitioner.units import format_bytes

FORMAT = "pipetrain-plan"
VERSION = 1
FIX = "re-run `pipetrain profile` and `pipetrain plan` for this model"
STAGE_MODES = ("never", "always")  # a stage keeps its activations, or recomputes them


@dataclass(frozen=True)
class StagePlan:
    """One stage: its layers, its devices and what the cost model predicts for it."""

    layers: tuple[int, int]  # [first, stop)
    ranks: list[int]
    names: list[str]
    param_counts: list[int]
    forward_time: float
    backward_time: float
    compute_time: float
    allreduce_time: float
    transfer_time: float
    transfer_bytes: int
    memory_bytes: int
    weight_time: float = 0.0  # the part of backward_time that computes weight gradients (W)
    checkpoint: str = "never"  # "always": the stage recomputes its forward in backward


@dataclass(frozen=True)
class Host:
    """What the prediction assumed of where the stages run, beyond the profile: ``cores``, the
    processors the stage processes share on one host (None: a device per stage), and
    ``overhead``, the runtime's own seconds per action (see ``partitioner.planner.predict``)."""

    cores: int | None = None
    overhead: float = 0.0

    def __post_init__(self) -> None:
        if self.cores is not None and self.cores < 1:
            raise ValueError(f"cores must be at least 1 (or None), got {self.cores}")
        if self.overhead < 0:
            raise ValueError(f"overhead must be >= 0 seconds, got {self.overhead}")

    def describe(self) -> str:
        """What the prediction assumed, as a clause for a summary line ('' by default)."""
        said = [f"stages sharing {self.cores} cores"] if self.cores is not None else []
        if self.overhead:
            said.append(f"runtime overhead {self.overhead * 1e3:.3f} ms per action")
        return f" ({'; '.join(said)})" if said else ""


@dataclass(frozen=True)
class Plan:
    """How to cut a model into stages and place them, with the predicted step."""

    schedule: str
    stages: int
    microbatches: int
    microbatch_size: int
    checkpoint: str
    balance: list[int]
    stage_to_rank: list[int] | list[list[int]]
    per_stage: list[StagePlan]
    bottleneck: float
    step_time: float
    bubble_fraction: float
    samples_per_second: float
    device: str = ""
    solver: str = "dp"
    host: Host = field(default_factory=Host)
    reduce_scatter: str = "step"  # zero 2 and 3: Pipeline(reduce_scatter=) the plan counts
    zero: int = 0  # Pipeline(zero=) the plan counts: what replicated stages shard
    data_parallel: int = 1  # copies of the whole pipeline, each on its own micro-batches
    version: int = VERSION

    @property
    def names(self) -> list[str]:
        """Layer names in model order."""
        return [name for stage in self.per_stage for name in stage.names]

    @property
    def param_counts(self) -> list[int]:
        """Parameter count of each layer in model order."""
        return [count for stage in self.per_stage for count in stage.param_counts]

    @property
    def checkpoints(self) -> list[str]:
        """Each stage's recomputation mode, "never" or "always"."""
        return [stage.checkpoint for stage in self.per_stage]

    @property
    def pipeline_ranks(self) -> int:
        """How many ranks run one pipeline (fewer than stages under "interleaved")."""
        return len({rank for stage in self.per_stage for rank in stage.ranks})

    def ranks(self, stage: int) -> list[int]:
        """The ranks that run ``stage`` (more than one when it is replicated)."""
        return list(self.per_stage[stage].ranks)

    def check_model(self, names: list[str], param_counts: list[int]) -> None:
        """Raise PlanMismatchError unless the model has the planned layers: same count, names
        and parameter counts, in order."""
        if len(names) != len(param_counts):
            raise ValueError(f"got {len(names)} names but {len(param_counts)} parameter counts")
        want_names, want_counts = self.names, self.param_counts
        if len(names) != len(want_names):
            raise PlanMismatchError(
                f"the model has {len(names)} layers but the plan was made for "
                f"{len(want_names)} layers; {FIX}"
            )
        problems = []
        for i, (got, want) in enumerate(zip(names, want_names, strict=True)):
            if got != want:
                problems.append(f"layer {i} is named {got!r} in the model but {want!r} in the plan")
                break
        for i, (got_n, want_n) in enumerate(zip(param_counts, want_counts, strict=True)):
            if got_n != want_n:
                problems.append(
                    f"layer {i} ({names[i]!r}) has {got_n:,} parameters in the model but "
                    f"{want_n:,} in the plan"
                )
                break
        if problems:
            raise PlanMismatchError("; ".join(problems) + f"; {FIX}")

    def table(self) -> str:
        """The stages as a text table for people."""
        rows = [
            f"{'stage':>5} {'layers':>11} {'ranks':>8} {'params':>12} {'compute ms':>10} "
            f"{'send ms':>8} {'memory':>11} {'recompute':>9}"
        ]
        for t, s in enumerate(self.per_stage):
            ranks = ",".join(map(str, s.ranks))
            rows.append(
                f"{t:>5} {s.layers[0]:>5}-{s.layers[1] - 1:<5} {ranks:>8} "
                f"{sum(s.param_counts):>12,} {s.compute_time * 1e3:>10.3f} "
                f"{s.transfer_time * 1e3:>8.3f} {format_bytes(s.memory_bytes):>11} "
                f"{'yes' if s.checkpoint == 'always' else 'no':>9}"
            )
        rows.append(
            f"bottleneck {self.bottleneck * 1e3:.3f} ms, step {self.step_time * 1e3:.3f} ms, "
            f"bubble {self.bubble_fraction:.1%}, {self.samples_per_second:,.1f} samples/s"
            + self.host.describe()
        )
        return "\n".join(rows)

    def to_json(self) -> str:
        """The plan as the documented JSON text."""
        data = {"format": FORMAT, "version": self.version, **asdict(self)}
        for stage in data["per_stage"]:
            stage["layers"] = list(stage["layers"])
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by :meth:`to_json`; a clear PlanFileError otherwise."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise PlanFileError(f"plan is not valid JSON: {err}") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise PlanFileError(f"not a {FORMAT!r} file")
        if data.get("version") != VERSION:
            raise PlanFileError(
                f"plan version {data.get('version')!r} is not supported (this pipetrain reads "
                f"version {VERSION}); re-run `pipetrain plan`"
            )
        values = _typed_fields(cls, data, "plan", skip=("per_stage", "host"),
                               optional=("reduce_scatter", "zero", "data_parallel"))
        stages = [
            _stage_from_dict(s, t, values["checkpoint"])
            for t, s in enumerate(typed(data, "per_stage", list, "plan", PlanFileError))
        ]
        return cls(**{**values, "per_stage": stages, "host": _host_from_dict(data.get("host"))})

    def save(self, path: str | Path) -> None:
        """Write the plan as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan from the JSON file at ``path``."""
        try:
            return cls.from_json(Path(path).read_text())
        except PlanFileError as err:
            raise PlanFileError(f"{path}: {err}") from None


def _typed_fields(
    cls: type, data: dict[str, Any], where: str, skip: tuple[str, ...] = (),
    optional: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The fields of dataclass ``cls`` read from ``data``, each of the type ``cls`` declares;
    those named in ``optional`` take their default when absent."""
    hints = get_type_hints(cls)
    return {
        f.name: typed(
            data, f.name, hints[f.name], where, PlanFileError,
            *((f.default,) if f.name in optional else ()),
        )
        for f in fields(cls)
        if f.name not in skip
    }


def _host_from_dict(data: Any) -> Host:
    if data is None:
        return Host()
    if not isinstance(data, dict):
        raise PlanFileError(f"plan's host must be an object, got {data!r}")
    hints = get_type_hints(Host)
    values = {
        f.name: typed(data, f.name, hints[f.name], "plan's host", PlanFileError, f.default)
        for f in fields(Host)
    }
    try:
        return Host(**values)
    except ValueError as err:
        raise PlanFileError(f"plan's host {data!r} is not valid: {err}") from None


def _stage_from_dict(data: Any, index: int, checkpoint: str) -> StagePlan:
    """Stage ``index`` of a plan file; without a checkpoint mode of its own (a file older than
    per-stage recomputation) it takes the plan's ``checkpoint``."""
    if not isinstance(data, dict):
        raise PlanFileError(f"stage {index} must be an object")
    if "checkpoint" not in data and checkpoint in STAGE_MODES:
        data = {**data, "checkpoint": checkpoint}
    values = _typed_fields(StagePlan, data, f"stage {index}", optional=("weight_time",))
    if values["checkpoint"] not in STAGE_MODES:
        raise PlanFileError(
            f"stage {index}'s checkpoint must be one of {STAGE_MODES}, got "
            f"{values['checkpoint']!r}; {FIX}"
        )
    values["layers"] = tuple(values["layers"])
    return StagePlan(**values)
