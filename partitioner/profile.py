"""Per-layer costs of a model, as measured once and planned many times.

Units everywhere in the planner: SECONDS for time, BYTES for sizes. A profile describes one batch
of ``batch_size`` samples on the profiled device; the planner scales times and activation sizes
linearly to the micro-batch it plans for.

JSON format (``version`` 1)::

    {
      "format": "pipetrain-profile",
      "version": 1,
      "device": "NVIDIA A100-SXM4-40GB",
      "batch_size": 32,
      "input_bytes": 19267584,
      "layers": [
        {"name": "0", "forward": 0.0012, "backward": 0.0025, "activation_bytes": 102760448,
         "param_count": 1792, "param_bytes": 7168, "optimizer_state_bytes": 14336,
         "spread": 0.08},
        ...
      ],
      "boundaries": null
    }

A layer may also carry ``"timed_as": "NAME"``: its times are those measured on the layer NAME
(an identical block earlier in the same run, timed once by a profile of a meta-device model),
and ``"tied_bytes": N`` (0 when absent): N of its ``param_bytes`` are weights that another
layer holds too (a token embedding and the head reading it), which ZeRO 2 and 3 keep whole on
every replica when the two layers are on different stages. ``"saved_bytes": N`` (absent in
older profiles: the planner then counts ``activation_bytes``) is what the layer's forward saves
for its backward, parameters left out, counted once along the chain (a layer's input that the
layer before already saved as its output is that layer's), and ``"saved_input_bytes": N`` the
part of it that is the layer's input: a stage starting at the layer holds its received input
instead. ``"forward_fixed"`` and ``"backward_fixed"`` (0 when absent) are the seconds of each
time that do not grow with the batch (:func:`with_fixed_times` fits them from two profiles).
``"backward_input"`` and ``"backward_weight"`` (absent in older profiles: the planner then
takes half the backward each) are the seconds of the layer's backward split as the zero-bubble
schedules run it, B (input gradients, the graph kept) and W (weight gradients) apart; on a CPU
their sum exceeds ``backward`` (two passes through the layer's graph).

``boundaries`` is null for a chain (the tensor that crosses the cut after layer i is layer i's
output) or a list of ``L - 1`` records ``{"sources": [i, ...], "allowed": true}``: the layers
whose outputs cross the cut after layer i (a branched graph), and whether the cut may be used.
``spread`` (optional, 0 when absent) is how far the timed repeats of a layer's forward +
backward lay apart: (slowest - fastest) / median.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, get_type_hints

from partitioner.errors import ProfileError
from partitioner.fields import typed

FORMAT = "pipetrain-profile"
VERSION = 1
NOISY_SPREAD = 0.5  # repeats further apart than half their median: the machine was busy
NOISY_SHARE = 0.02  # ... in a layer that is at least this share of the model's time


@dataclass(frozen=True)
class LayerCost:
    """One layer's costs for a batch of the profile's ``batch_size``.

    ``forward``/``backward`` are seconds; ``activation_bytes`` is the size of this layer's output
    (what is stashed for backward and what crosses a stage boundary after it);
    ``optimizer_state_bytes`` is e.g. 2 x ``param_bytes`` for Adam in fp32; ``spread`` is
    (slowest - fastest) / median of the timed repeats' forward + backward (0: one repeat, or
    not measured), large when the machine was busy while profiling. ``timed_as`` names the
    layer whose measured times this one reuses (an identical block earlier in the same run of
    blocks, timed once), or is None where the layer was timed itself. ``tied_bytes``: the part
    of ``param_bytes`` that another layer holds too (a tied weight). ``saved_bytes``: what its
    forward saves for the backward (None: not measured, read as ``activation_bytes``), of which
    ``saved_input_bytes`` is its input. ``forward_fixed``/``backward_fixed``: the part of
    each time that does not grow with the batch (per-call overhead: launching, dispatching
    small ops), from profiles at two batch sizes (:func:`with_fixed_times`); the planner
    scales only the rest with the micro-batch (0: all of it, times proportional to samples).
    ``backward_input``/``backward_weight``: the backward split into B and W as the
    split-backward schedules run it, timed apart (None: not measured, W read as half the
    backward).
    """

    name: str
    forward: float
    backward: float
    activation_bytes: int
    param_count: int
    param_bytes: int
    optimizer_state_bytes: int = 0
    spread: float = 0.0
    timed_as: str | None = None
    tied_bytes: int = 0
    saved_bytes: int | None = None
    saved_input_bytes: int = 0
    forward_fixed: float = 0.0
    backward_fixed: float = 0.0
    backward_input: float | None = None
    backward_weight: float | None = None

    @property
    def kept_bytes(self) -> int:
        """What a micro-batch's forward of this layer leaves for its backward: the measured
        ``saved_bytes``, or (older profiles) the output."""
        return self.activation_bytes if self.saved_bytes is None else self.saved_bytes

    def __post_init__(self) -> None:
        for what in ("forward", "backward"):
            if not getattr(self, what) >= 0:
                raise ValueError(f"layer {self.name!r}: {what} time must be >= 0 seconds")
            if not 0 <= getattr(self, f"{what}_fixed") <= getattr(self, what):
                raise ValueError(f"layer {self.name!r}: {what}_fixed is the part of its "
                                 f"{what} time that does not grow with the batch: 0 to it")
        if (self.backward_input is None) != (self.backward_weight is None):
            raise ValueError(f"layer {self.name!r}: backward_input and backward_weight are "
                             "measured together: give both or neither")
        for what in ("backward_input", "backward_weight"):
            if getattr(self, what) is not None and not getattr(self, what) >= 0:
                raise ValueError(f"layer {self.name!r}: {what} must be >= 0 seconds")
        if not self.spread >= 0:
            raise ValueError(f"layer {self.name!r}: spread must be >= 0, got {self.spread}")
        for what in ("activation_bytes", "param_count", "param_bytes", "optimizer_state_bytes",
                     "tied_bytes", "saved_input_bytes"):
            if getattr(self, what) < 0:
                raise ValueError(f"layer {self.name!r}: {what} must be >= 0")
        if self.saved_bytes is not None and self.saved_bytes < 0:
            raise ValueError(f"layer {self.name!r}: saved_bytes must be >= 0")
        if self.saved_input_bytes > self.kept_bytes:
            raise ValueError(
                f"layer {self.name!r}: saved_input_bytes ({self.saved_input_bytes}) is part of "
                f"saved_bytes ({self.kept_bytes}): it cannot exceed it"
            )
        if self.tied_bytes > self.param_bytes:
            raise ValueError(
                f"layer {self.name!r}: tied_bytes ({self.tied_bytes}) is part of param_bytes "
                f"({self.param_bytes}): it cannot exceed it"
            )


@dataclass(frozen=True)
class Boundary:
    """The cut after one layer of a branched graph: the layers whose outputs cross it."""

    sources: tuple[int, ...]
    allowed: bool = True


@dataclass(frozen=True)
class Profile:
    """Measured costs of every layer, in execution order, for one batch of ``batch_size``."""

    device: str
    batch_size: int
    layers: list[LayerCost]
    input_bytes: int = 0
    boundaries: list[Boundary] | None = None
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")
        if not self.layers:
            raise ValueError("a profile needs at least one layer")
        if self.boundaries is not None:
            n = len(self.layers)
            if len(self.boundaries) != n - 1:
                raise ValueError(f"{n} layers have {n - 1} boundaries, got {len(self.boundaries)}")
            for cut, boundary in enumerate(self.boundaries):
                if any(not 0 <= s <= cut for s in boundary.sources):
                    raise ValueError(
                        f"boundary after layer {cut} names a source that is not before it: "
                        f"{boundary.sources}"
                    )

    @property
    def names(self) -> list[str]:
        """Layer names in order."""
        return [layer.name for layer in self.layers]

    def crossing(self, cut: int) -> tuple[int, ...]:
        """Indices of the layers whose outputs cross the cut after layer ``cut``."""
        if self.boundaries is None:
            return (cut,)
        return self.boundaries[cut].sources

    def noisy(self, limit: float = NOISY_SPREAD, share: float = NOISY_SHARE) -> list[int]:
        """The layers whose repeats spread more than ``limit`` (relative) and that weigh at
        least ``share`` of the model's forward + backward: their times may be off enough to
        move a plan (a tiny layer's relative jitter does not matter)."""
        total = sum(layer.forward + layer.backward for layer in self.layers)
        return [
            i for i, layer in enumerate(self.layers)
            if layer.spread > limit and layer.forward + layer.backward >= share * total
        ]

    def cut_allowed(self, cut: int) -> bool:
        """Whether a stage may end after layer ``cut``."""
        return self.boundaries is None or self.boundaries[cut].allowed

    def to_json(self) -> str:
        """The profile as the documented JSON text."""
        data: dict[str, Any] = {
            "format": FORMAT,
            "version": self.version,
            "device": self.device,
            "batch_size": self.batch_size,
            "input_bytes": self.input_bytes,
            "layers": [_layer_dict(layer) for layer in self.layers],
            "boundaries": None
            if self.boundaries is None
            else [{"sources": list(b.sources), "allowed": b.allowed} for b in self.boundaries],
        }
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Profile:
        """Read a profile written by :meth:`to_json`; a clear ProfileError otherwise."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ProfileError(f"profile is not valid JSON: {err}") from None
        if not isinstance(data, dict):
            raise ProfileError("profile JSON must be an object")
        return _profile_from_dict(data)

    def save(self, path: str | Path) -> None:
        """Write the profile as JSON to ``path``."""
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        """Read a profile from the JSON file at ``path``."""
        try:
            return cls.from_json(Path(path).read_text())
        except ProfileError as err:
            raise ProfileError(f"{path}: {err}") from None


def _layer_dict(layer: LayerCost) -> dict[str, Any]:
    """A layer as JSON; ``timed_as`` only where times were reused, ``tied_bytes`` only where
    weights are tied, the saved bytes only where measured (files stay as they were)."""
    data = asdict(layer)
    for key in ("timed_as", "saved_bytes", "backward_input", "backward_weight"):
        if data[key] is None:
            del data[key]
    for key in ("tied_bytes", "saved_input_bytes", "forward_fixed", "backward_fixed"):
        if not data[key]:
            del data[key]
    return data


def _require(
    data: Mapping[str, Any], key: str, hint: Any, where: str, default: Any = MISSING
) -> Any:
    return typed(data, key, hint, where, ProfileError, default)


def _layer_from_dict(data: Any, index: int) -> LayerCost:
    where = f"layer {index}"
    if not isinstance(data, dict):
        raise ProfileError(f"{where} must be an object")
    hints = get_type_hints(LayerCost)
    values = {
        f.name: _require(data, f.name, hints[f.name], where, f.default) for f in fields(LayerCost)
    }
    try:
        return LayerCost(**values)
    except ValueError as err:
        raise ProfileError(str(err)) from None


def _boundaries_from_list(data: Any) -> list[Boundary] | None:
    if data is None:
        return None
    if not isinstance(data, list):
        raise ProfileError("field 'boundaries' must be null or a list")
    out = []
    for cut, item in enumerate(data):
        where = f"boundary {cut}"
        if not isinstance(item, dict):
            raise ProfileError(f"{where} must be an object")
        sources: list[int] = _require(item, "sources", list[int], where)
        allowed: bool = _require(item, "allowed", bool, where, True)
        out.append(Boundary(tuple(sources), allowed))
    return out


def _profile_from_dict(data: Mapping[str, Any]) -> Profile:
    if data.get("format", FORMAT) != FORMAT:
        raise ProfileError(f"this is a {data.get('format')!r} file, not a {FORMAT!r} file")
    version = _require(data, "version", int, "profile")
    if version != VERSION:
        raise ProfileError(
            f"profile version {version} is not supported (this pipetrain reads version "
            f"{VERSION}); re-run `pipetrain profile` with this version of pipetrain"
        )
    layers = _require(data, "layers", list, "profile")
    try:
        return Profile(
            device=_require(data, "device", str, "profile"),
            batch_size=_require(data, "batch_size", int, "profile"),
            layers=[_layer_from_dict(layer, i) for i, layer in enumerate(layers)],
            input_bytes=_require(data, "input_bytes", int, "profile", 0),
            boundaries=_boundaries_from_list(data.get("boundaries")),
            version=version,
        )
    except ValueError as err:
        if isinstance(err, ProfileError):
            raise
        raise ProfileError(str(err)) from None


def with_fixed_times(profile: Profile, other: Profile) -> Profile:
    """``profile`` with each layer's ``forward_fixed``/``backward_fixed`` fitted from
    ``other``, the same model profiled at another batch size: time = fixed + per-sample x
    samples through the two measurements, the fixed part clipped to [0, the time at the
    smaller batch] (a layer whose times did not grow with the batch is all fixed; one that
    grew faster than its samples, none)."""
    if len(profile.layers) != len(other.layers) or profile.batch_size == other.batch_size:
        raise ValueError("with_fixed_times needs the same layers profiled at two batch sizes")
    a, b = profile.batch_size, other.batch_size
    small = min(a, b)

    def fixed(ta: float, tb: float) -> float:
        per_sample = (tb - ta) / (b - a)
        at_small = ta if a == small else tb
        return min(max(ta - per_sample * a, 0.0), at_small, ta)

    layers = [
        replace(mine, forward_fixed=fixed(mine.forward, theirs.forward),
                backward_fixed=fixed(mine.backward, theirs.backward))
        for mine, theirs in zip(profile.layers, other.layers, strict=True)
    ]
    return replace(profile, layers=layers)
