"""The cost model: what one stage costs per micro-batch, in time and in memory.

Everything here is per micro-batch of ``microbatch_size`` samples. A profile measured a batch of
``batch_size``; times and activation bytes are scaled by ``microbatch_size / batch_size`` (assumed
linear), activation bytes rounded up to whole bytes, except a layer's fixed time (the profile's
``forward_fixed``/``backward_fixed``, fitted from two batch sizes), which does not scale.
Parameters do not scale.

Time of stage t holding layers [i, j) on ``r`` replicas of speed ``v``::

    compute(t) = sum(fwd + bwd + c fwd)[i:j] / (v * r)  +  allreduce(t) / m
    allreduce(t) = n (r - 1) / r * param_bytes[i:j] / bandwidth      (ring, per step)

with n = 2 ring passes (an all-reduce, or at zero 2 and 3 a reduce-scatter and an all-gather)
once per step, except at zero 2 and 3 with ``reduce_scatter="microbatch"``: a reduce-scatter
per micro-batch and one all-gather, n = m + 1.
    link(t)    = 2 * cut_bytes[j] / bandwidth(t -> t+1)               (activation + gradient)
    cost(t)    = max(compute(t), link(t))

Communication overlaps computation (the runtime posts sends asynchronously and the simulator
charges a message only as latency on its link), so a link is a pipeline resource of its own: per
micro-batch it carries one activation forward and one gradient back. The all-reduce of a
replicated stage runs once per mini-batch of ``m`` micro-batches; it is amortised over them.
Where the whole pipeline is copied ``data_parallel`` = d times (each copy runs every micro-batch
of its share of the batch), r above is r d in the all-reduce and the sharding, not in the work.

Memory of one device of stage t, with ``k`` micro-batches in flight (``inflight``)::

    never:  weights[i:j] + k * (cut_bytes[i] + activation_bytes[i:j] - input_bytes[i])
    always: weights[i:j] + k * cut_bytes[i] + activation_bytes[i:j] - input_bytes[i]

``activation_bytes`` is what a layer's forward saves for its backward (the profile's
``saved_bytes``, or its output where a profile did not measure that), ``input_bytes[i]`` the
part of it that is layer i's input (``saved_input_bytes``, at most ``cut_bytes[i]``): a stage
starting at layer i keeps that once, as the input it received.
``weights`` is parameters + gradients (same size) + optimizer state, each divided by the stage's
replicas where ``zero`` shards it (1: the optimizer state; 2: and the gradients; 3: and the
parameters: ZeRO, pipetrain/runtime/sharding.py; the gradients only where they are
reduce-scattered per micro-batch, ``reduce_scatter="microbatch"``: reduced once per step, a
step holds them whole until its last backward), except that at 2 and 3 a tied weight
(``tied_bytes``: held by another layer too) stays whole with its gradient and optimizer state,
as the runtime keeps a weight tied across stages; ``cut_bytes[i]`` is what the
stage receives (its input, kept for backward); with recomputation ("always", c = 1 above) only
that input is kept per micro-batch and one micro-batch's activations are rebuilt at a time, in
its backward, which runs the stage's forward again. ``checkpoint="auto"`` lets each stage take
either mode: the solvers pick per stage, recomputing only where a memory cap needs it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from partitioner.profile import LayerCost, Profile
from schedules import DEFAULT_SCHEDULE, Schedule, build, lookup
from schedules import inflight as schedule_inflight
from schedules.validate import validate

CHECKPOINT = ("never", "auto", "always")
REDUCE_SCATTER = ("step", "microbatch")  # when zero 2 and 3 reduce the gradients (docstring)
Values = Sequence[float] | np.ndarray  # one number per layer (or per position)


_Key = tuple[object, int, int, int]
_BUILT: dict[_Key, Schedule] = {}
_BUILT_MOST = 1024  # schedules kept; the cache starts over past this many
_VALID: set[_Key] = set()  # the keys of _BUILT validated
_INFLIGHT: dict[_Key, tuple[int, ...]] = {}  # schedules.inflight of each kept schedule


def pipeline_schedule(
    schedule: str, stages: int, microbatches: int, virtual_stages: int = 2, *,
    checked: bool = True,
) -> Schedule:
    """The schedule ``schedule`` for ``stages`` stages, validated (``checked``; a caller that
    only counts along the lists, before a plan that simulates them, may leave that to the
    simulation). A schedule that puts several stages on a rank ("interleaved") runs them as
    ``virtual_stages`` stages per rank on ``stages / virtual_stages`` ranks, stage s on rank
    s mod ranks.

    Each is generated and validated once and then kept (a search plans many splits under the
    same schedule), so what this returns needs no validating again (``simulate(...,
    validated=True)``); a schedule registered again under the same name is generated anew."""
    key = _key(schedule, stages, microbatches, virtual_stages)
    built = _BUILT.get(key)
    if built is None:
        built = _generate(schedule, stages, microbatches, virtual_stages)
        if len(_BUILT) >= _BUILT_MOST:
            forget_schedules()
        _BUILT[key] = built
    if checked and key not in _VALID:
        validate(built)
        _VALID.add(key)
    return built


def _key(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> _Key:
    """What a kept schedule is kept by: its entry (one registered again is another) and size."""
    spec = lookup(schedule)
    return spec, stages, microbatches, virtual_stages if spec.multi_stage_per_rank else 0


def forget_schedules() -> None:
    """Drop the schedules :func:`pipeline_schedule` keeps, and what was counted along them."""
    _BUILT.clear()
    _VALID.clear()
    _INFLIGHT.clear()


def _generate(schedule: str, stages: int, microbatches: int, virtual_stages: int) -> Schedule:
    """:func:`pipeline_schedule`'s schedule, generated."""
    if not lookup(schedule).multi_stage_per_rank:
        return build(schedule, stages, microbatches)
    if virtual_stages < 1 or stages % virtual_stages:
        v = max(virtual_stages, 1)
        near = sorted({max(stages // v, 1) * v, (stages // v + 1) * v})
        raise ValueError(
            f"schedule {schedule!r} puts virtual_stages={virtual_stages} stages on each rank, "
            f"so stages must be a positive multiple of it, got stages={stages}; use "
            f"{' or '.join(map(str, near))} stages, or a virtual stage count that divides "
            f"{stages}"
        )
    return build(schedule, stages, microbatches, ranks=stages // virtual_stages)


def inflight(
    schedule: str, stages: int, microbatches: int, virtual_stages: int = 2
) -> list[int]:
    """Micro-batches whose activations stage s holds at once (GPipe m, 1F1B min(m, S - s),
    PipeDream S - s across calls): the schedule's registry entry says, or counts it along the
    generated lists (:func:`schedules.inflight`), per stage even where stages share a rank.
    The lists are validated where a plan simulates them, not here: a search counts along
    many it never simulates."""
    key = _key(schedule, stages, microbatches, virtual_stages)
    if key not in _INFLIGHT:
        built = pipeline_schedule(schedule, stages, microbatches, virtual_stages, checked=False)
        _INFLIGHT[key] = schedule_inflight(built)
    return list(_INFLIGHT[key])


def weight_gradient_share(backward: float, param_count: int) -> float:
    """The W (weight-gradient) part of a layer's ``backward`` where the profile did not time
    B and W apart: the zero-bubble paper's assumption (Qi et al. 2023), B and W cost the same,
    half the backward each, for a layer with parameters; a layer without any has no W."""
    return backward / 2 if param_count > 0 else 0.0


def split_backward_time(layer: LayerCost, backward: float) -> tuple[float, float]:
    """A layer's B + W and its W, where ``backward`` is its whole backward at the planned
    micro-batch, for a schedule that splits the backward. A profile that timed B and W apart
    (``backward_input``, ``backward_weight``) gives their sum's ratio to the whole backward
    (two autograd passes cost more than one: on a CPU 1.3-1.8x) and W's share of it, applied
    at the planned micro-batch; an older one, :func:`weight_gradient_share` of ``backward``."""
    if layer.backward_input is None or layer.backward_weight is None:
        return backward, weight_gradient_share(backward, layer.param_count)
    apart = layer.backward_input + layer.backward_weight
    if apart <= 0:
        return backward, 0.0
    total = backward * apart / layer.backward if layer.backward > 0 else apart
    return total, total * (layer.backward_weight / apart)  # a share <= 1: W <= B + W


@dataclass(frozen=True)
class Problem:
    """The planner's input: per-layer costs of one micro-batch and per-stage resources.

    Positions 0..L name the cuts: position p lies before layer p. ``cut_bytes[p]`` is what
    crosses it per micro-batch (p = 0: the input; p = L: nothing) and ``allowed[p]`` says whether a
    stage may start or end there.
    """

    forward: np.ndarray  # (L,) seconds
    backward: np.ndarray  # (L,) seconds, the whole backward
    weight_gradient: np.ndarray  # (L,) seconds: the W part of backward (zero-bubble schedules)
    weight_bytes: np.ndarray  # (L,) int64: parameters + gradients + optimizer state
    activation_bytes: np.ndarray  # (L,) int64
    param_bytes: np.ndarray  # (L,) int64, what a replicated stage all-reduces
    tied_bytes: np.ndarray  # (L,) int64, the part of param_bytes another layer holds too
    cut_bytes: np.ndarray  # (L + 1,) int64
    allowed: np.ndarray  # (L + 1,) bool
    inflight: tuple[int, ...]  # (S,)
    checkpoint: str = "never"  # "never", "always" or "auto" (each stage either, as it needs)
    speed: tuple[float, ...] = ()  # (S,) compute speed relative to the profiled device
    memory: tuple[int | None, ...] = ()  # (S,) bytes per device, None = no cap
    bandwidth: tuple[float, ...] = ()  # (S - 1,) bytes/s of the link to the next stage
    devices: int = 0  # >= S; more than S replicates stages
    microbatches: int = 1
    allreduce_bandwidth: float = math.inf
    zero: int = 0  # what a replicated stage shards over its replicas (module docstring)
    reduce_scatter: str = "step"  # zero 2 and 3: gradients reduced per step or micro-batch
    data_parallel: int = 1  # copies of the whole pipeline, each running every micro-batch
    # (L,) int64 or None (zeros): the part of a layer's activation_bytes that is its input,
    # which a stage starting at the layer holds once as the input it received (cut_bytes)
    input_bytes: np.ndarray | None = None
    # forwards a recomputing stage's backward runs again: 2 where the schedule splits the
    # backward (B and W each backpropagate the checkpointed forward, which rebuilds it each
    # time), except in the first stage, whose input wants no gradient: its B has nothing to do
    recomputes: int = 1

    def ring(self, replicas: int) -> int:
        """Devices that all-reduce (and under ``zero`` shard) a stage on ``replicas`` replicas:
        its replicas in every copy of the pipeline."""
        return replicas * self.data_parallel

    @property
    def sharded_gradients(self) -> bool:
        """Whether a step holds only the shards of its gradients (zero 2 and 3, reduced per
        micro-batch)."""
        return self.zero >= 2 and self.reduce_scatter == "microbatch"

    @property
    def ring_passes(self) -> int:
        """Ring passes of a stage's parameter bytes per step (module docstring's n)."""
        return self.microbatches + 1 if self.sharded_gradients else 2

    def rebuilds(self, stage: int) -> int:
        """Forwards the backward of ``stage`` runs again where it recomputes."""
        return 1 if stage == 0 else self.recomputes

    @property
    def layers(self) -> int:
        """Number of layers L."""
        return len(self.forward)

    @property
    def stages(self) -> int:
        """Number of stages S."""
        return len(self.inflight)

    @property
    def cost(self) -> np.ndarray:
        """Forward + backward seconds of each layer."""
        total: np.ndarray = self.forward + self.backward
        return total

    @property
    def modes(self) -> tuple[bool, ...]:
        """The recomputation choices a stage may take (True: recompute its forward in backward)."""
        return {"never": (False,), "always": (True,), "auto": (False, True)}[self.checkpoint]


def _layer_array(values: Values | None, layers: int, kind: type, what: str) -> np.ndarray:
    """``values`` (zeros when None) as one non-negative ``kind`` per layer."""
    arr: np.ndarray = (
        np.zeros(layers, dtype=kind) if values is None else np.asarray(values, dtype=kind)
    )
    if arr.shape != (layers,):
        raise ValueError(f"{what} needs {layers} values, one per layer, got {arr.shape}")
    if (arr < 0).any():
        raise ValueError(f"{what} must be >= 0")
    return arr


def _cut_arrays(
    cut_bytes: Values | None, allowed: Sequence[bool] | np.ndarray | None, layers: int
) -> tuple[np.ndarray, np.ndarray]:
    """(bytes crossing, cut allowed) at positions 0..L; the ends are always allowed."""
    n = layers
    cuts = np.zeros(n + 1, dtype=np.int64) if cut_bytes is None else np.asarray(cut_bytes)
    ok = np.ones(n + 1, dtype=bool) if allowed is None else np.asarray(allowed, dtype=bool).copy()
    if cuts.shape != (n + 1,) or ok.shape != (n + 1,):
        raise ValueError(f"cut_bytes and allowed need {n + 1} values (positions 0..{n})")
    if (cuts < 0).any():
        raise ValueError("cut_bytes must be >= 0")
    ok[0] = ok[n] = True
    return cuts.astype(np.int64), ok


def _stage_resources(
    stages: int,
    inflight: Sequence[int] | None,
    memory: int | None | Sequence[int | None],
    bandwidth: float | Sequence[float],
    speed: Sequence[float] | None,
    devices: int | None,
) -> tuple[list[int], list[int | None], list[float], list[float], int]:
    """:func:`make_problem`'s per-stage resources, one value each (one per link for the
    bandwidths; a value given once applies to all), and the device count, checked."""
    flight = [1] * stages if inflight is None else [int(k) for k in inflight]
    mem = list(memory) if isinstance(memory, Sequence) else [memory] * stages
    bw = (
        [float(bandwidth)] * (stages - 1) if isinstance(bandwidth, int | float) else list(bandwidth)
    )
    spd = [1.0] * stages if speed is None else [float(v) for v in speed]
    if not len(flight) == len(mem) == len(spd) == stages or len(bw) != stages - 1:
        raise ValueError(f"per-stage inputs need {stages} values ({stages - 1} for links)")
    if any(v <= 0 for v in spd) or any(b <= 0 for b in bw):
        raise ValueError("speeds and bandwidths must be > 0")
    count = stages if devices is None else devices
    if count < stages:
        raise ValueError(f"{stages} stages need at least {stages} devices, got {count}")
    if count > stages and not (len(set(spd)) == 1 and len(set(mem)) == 1 and len(set(bw)) <= 1):
        raise ValueError("replicating stages needs identical devices and links")
    return flight, mem, bw, spd, count


def _check_sharing(zero: int, reduce_scatter: str, data_parallel: int, replicated: bool) -> None:
    """Refuse a ZeRO level, reduce-scatter mode or copy count :class:`Problem` cannot take."""
    if isinstance(zero, bool) or zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3 (what replicas shard), got {zero!r}")
    if reduce_scatter not in REDUCE_SCATTER:
        raise ValueError(f"reduce_scatter must be one of {REDUCE_SCATTER}, got {reduce_scatter!r}")
    if data_parallel < 1 or (data_parallel > 1 and replicated):
        raise ValueError(f"data_parallel copies the whole pipeline: >= 1 and with one device "
                         f"per stage (no stage replicated), got {data_parallel}")


def make_problem(
    forward: Values,
    backward: Values | None = None,
    *,
    stages: int,
    weight_gradient: Values | None = None,
    weight_bytes: Values | None = None,
    activation_bytes: Values | None = None,
    param_bytes: Values | None = None,
    tied_bytes: Values | None = None,
    cut_bytes: Values | None = None,
    allowed: Sequence[bool] | np.ndarray | None = None,
    inflight: Sequence[int] | None = None,
    checkpoint: bool | str = False,
    speed: Sequence[float] | None = None,
    memory: int | None | Sequence[int | None] = None,
    bandwidth: float | Sequence[float] = math.inf,
    devices: int | None = None,
    microbatches: int = 1,
    allreduce_bandwidth: float | None = None,
    zero: int = 0,
    reduce_scatter: str = "step",
    data_parallel: int = 1,
) -> Problem:
    """A validated Problem; omitted byte arrays are zero, omitted cuts all allowed, per-stage
    resources given once apply to every stage. ``cut_bytes``/``allowed`` have L + 1 entries.
    ``weight_gradient`` is the part of each layer's backward that computes weight gradients
    (zero when omitted: the whole backward is input gradient); ``tied_bytes`` the part of
    each layer's ``param_bytes`` that another layer holds too. ``checkpoint``: "never",
    "always" or "auto" (True and False: "always" and "never")."""
    n = len(forward)
    if n < 1:
        raise ValueError("nothing to split: no layers")
    mode = checkpoint if isinstance(checkpoint, str) else ("always" if checkpoint else "never")
    if mode not in CHECKPOINT:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT}, got {checkpoint!r}")
    if not 1 <= stages:
        raise ValueError(f"stages must be >= 1, got {stages}")
    fwd = _layer_array(forward, n, float, "forward")
    bwd = _layer_array(backward, n, float, "backward")
    wgrad = _layer_array(weight_gradient, n, float, "weight_gradient")
    if (wgrad > bwd).any():
        raise ValueError("weight_gradient is part of backward: it cannot exceed it")
    params = _layer_array(param_bytes, n, np.int64, "param_bytes")
    tied = _layer_array(tied_bytes, n, np.int64, "tied_bytes")
    if (tied > params).any():
        raise ValueError("tied_bytes is part of param_bytes: it cannot exceed it")
    cuts, ok = _cut_arrays(cut_bytes, allowed, n)
    if microbatches < 1:
        raise ValueError(f"a step needs at least one micro-batch, got {microbatches}")
    flight, mem, bw, spd, count = _stage_resources(
        stages, inflight, memory, bandwidth, speed, devices
    )
    _check_sharing(zero, reduce_scatter, data_parallel, count > stages)
    return Problem(
        forward=fwd,
        backward=bwd,
        weight_gradient=wgrad,
        weight_bytes=_layer_array(weight_bytes, n, np.int64, "weight_bytes"),
        activation_bytes=_layer_array(activation_bytes, n, np.int64, "activation_bytes"),
        param_bytes=params,
        tied_bytes=tied,
        cut_bytes=cuts,
        allowed=ok,
        inflight=tuple(flight),
        checkpoint=mode,
        speed=tuple(spd),
        memory=tuple(None if m is None else int(m) for m in mem),
        bandwidth=tuple(bw),
        devices=count,
        microbatches=microbatches,
        allreduce_bandwidth=float(
            allreduce_bandwidth if allreduce_bandwidth is not None else (bw[0] if bw else math.inf)
        ),
        zero=zero,
        reduce_scatter=reduce_scatter,
        data_parallel=data_parallel,
    )


def _time_at(seconds: float, fixed: float, scale: float) -> float:
    """A layer's time at ``scale`` times the profiled batch: its fixed part, and the rest
    in proportion."""
    return fixed + (seconds - fixed) * scale


def _scaled(values: Sequence[int], num: int, den: int) -> np.ndarray:
    """``values * num / den`` rounded up, exactly, as int64."""
    arr = np.asarray(values, dtype=np.int64)
    return -((-arr * num) // den)


def problem_from_profile(
    profile: Profile,
    *,
    stages: int,
    microbatches: int,
    microbatch_size: int | None = None,
    schedule: str = DEFAULT_SCHEDULE,
    checkpoint: str = "never",
    virtual_stages: int = 2,
    speed: Sequence[float] | None = None,
    memory: int | None | Sequence[int | None] = None,
    bandwidth: float | Sequence[float] = math.inf,
    devices: int | None = None,
    zero: int = 0,
    reduce_scatter: str = "step",
    data_parallel: int = 1,
) -> Problem:
    """The Problem of splitting ``profile`` for micro-batches of ``microbatch_size`` samples
    (default: the profile's batch size) under ``schedule`` (with ``virtual_stages`` stages per
    rank if it is "interleaved"). Each layer's B and W times, for a schedule that splits the
    backward, are :func:`split_backward_time`'s.
    ``data_parallel``: copies of the whole pipeline, each on its own share of the batch, that
    all-reduce (and under ``zero`` shard) every stage's weights together."""
    if checkpoint not in CHECKPOINT:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT}, got {checkpoint!r}")
    size = profile.batch_size if microbatch_size is None else microbatch_size
    if size < 1:
        raise ValueError(f"microbatch_size must be >= 1, got {size}")
    layers = profile.layers
    scale = size / profile.batch_size
    act = _scaled([layer.kept_bytes for layer in layers], size, profile.batch_size)
    saved_input = _scaled([layer.saved_input_bytes for layer in layers], size, profile.batch_size)
    cut = np.zeros(len(layers) + 1, dtype=np.int64)
    cut[0] = _scaled([profile.input_bytes], size, profile.batch_size)[0]
    output = _scaled([layer.activation_bytes for layer in layers], size, profile.batch_size)
    if profile.boundaries is None:  # a chain: layer p - 1's output crosses cut p
        cut[1:-1] = output[:-1]
    else:
        for p, boundary in enumerate(profile.boundaries, 1):
            cut[p] = output[list(boundary.sources)].sum()
    allowed = [True] + [profile.cut_allowed(p) for p in range(len(layers) - 1)] + [True]
    forward = [_time_at(layer.forward, layer.forward_fixed, scale) for layer in layers]
    whole = [_time_at(layer.backward, layer.backward_fixed, scale) for layer in layers]
    if lookup(schedule).split_backward:
        backward, weight = zip(*map(split_backward_time, layers, whole), strict=True)
    else:
        backward = tuple(whole)
        weight = tuple(map(weight_gradient_share, whole, [la.param_count for la in layers]))
    problem = make_problem(
        forward,
        list(backward),
        stages=stages,
        weight_gradient=list(weight),
        weight_bytes=[2 * layer.param_bytes + layer.optimizer_state_bytes for layer in layers],
        activation_bytes=act,
        param_bytes=[layer.param_bytes for layer in layers],
        tied_bytes=[layer.tied_bytes for layer in layers],
        cut_bytes=cut,
        allowed=allowed,
        inflight=inflight(schedule, stages, microbatches, virtual_stages),
        checkpoint=checkpoint,
        speed=speed,
        memory=memory,
        bandwidth=bandwidth,
        devices=devices,
        microbatches=microbatches,
        allreduce_bandwidth=float(bandwidth) if isinstance(bandwidth, int | float) else None,
        zero=zero,
        reduce_scatter=reduce_scatter,
        data_parallel=data_parallel,
    )
    return replace(problem, input_bytes=saved_input,
                   recomputes=2 if lookup(schedule).split_backward else 1)


# --- the canonical formulas; the solvers and the plan all evaluate stages through these ---


def compute_prefix(
    problem: Problem, stage: int, replicas: int = 1, recompute: bool = False
) -> np.ndarray:
    """Q with compute(stage on layers [i, j)) = Q[j] - Q[i] (seconds, all-reduce amortised);
    ``recompute`` adds the forwards that the backward runs again."""
    rebuilt = problem.rebuilds(stage) * problem.forward
    work = problem.cost + rebuilt if recompute else problem.cost
    per_layer = work / (problem.speed[stage] * replicas)
    ring = problem.ring(replicas)
    if ring > 1:
        share = problem.ring_passes * (ring - 1) / ring / (
            problem.allreduce_bandwidth * problem.microbatches
        )
        per_layer = per_layer + problem.param_bytes * share
    return np.concatenate(([0.0], np.cumsum(per_layer)))


def link_time(problem: Problem, stage: int) -> np.ndarray:
    """Seconds per micro-batch the link after ``stage`` is busy if the stage ends at each
    position: one activation forward and one gradient back."""
    if stage >= problem.stages - 1:
        return np.zeros(problem.layers + 1)
    return 2.0 * problem.cut_bytes / problem.bandwidth[stage]


def held_weight_bytes(problem: Problem, replicas: int = 1) -> np.ndarray:
    """Per layer, the parameter, gradient and optimizer bytes one device of a stage on
    ``replicas`` replicas holds: what ``problem.zero`` shards is divided by them (rounded
    up). At 2 and 3 a tied weight, its gradient and its optimizer state (its share of the
    layer's, by bytes) stay whole: the runtime keeps a weight tied across stages out of the
    shards. The planner cannot tell here whether the layers sharing it land on one stage
    (where the runtime would not keep it whole), so it counts it whole wherever it is.
    Beside what a step holds whole, FSDP2 (zero 2, 3) keeps the shards: at 2 each weight's
    shard beside the gathered weight the step runs on, and under "step" each gradient's
    shard, which the reduce-scatter writes while the whole gradient is still held (measured:
    benchmarks/plan_accuracy_zero.py)."""
    params = problem.param_bytes
    optimizer = problem.weight_bytes - 2 * params
    tied = problem.tied_bytes if problem.zero >= 2 else np.zeros_like(params)
    tied_state = optimizer * tied // np.maximum(params, 1)  # tied is 0 where params is
    ring = problem.ring(replicas)
    divisors = [ring if problem.zero >= 3 else 1,
                ring if problem.sharded_gradients else 1,
                ring if problem.zero >= 1 else 1]
    sharded = (params - tied, params - tied, optimizer - tied_state)
    held: np.ndarray = 2 * tied + tied_state + sum(
        -(-part // d) for part, d in zip(sharded, divisors, strict=True)
    )
    shard = -(-(params - tied) // ring) if ring > 1 else np.zeros_like(params)
    beside = (problem.zero == 2) + (problem.zero >= 2 and not problem.sharded_gradients)
    total: np.ndarray = (held + beside * shard).astype(np.int64)
    return total


def memory_terms(
    problem: Problem, stage: int, recompute: bool = False, replicas: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(H, g) with memory(stage on layers [i, j)) = H[j] + g[i], bytes, int64; ``recompute``
    keeps one micro-batch's activations instead of ``inflight``'s; on ``replicas`` replicas
    the weights ``problem.zero`` shards are divided among them."""
    k = problem.inflight[stage]
    copies = 1 if recompute else k
    kept = problem.activation_bytes * copies
    weights = held_weight_bytes(problem, replicas) if problem.zero else problem.weight_bytes
    head = np.concatenate(([0], np.cumsum(weights + kept))).astype(np.int64)
    tail = k * problem.cut_bytes - head
    if problem.input_bytes is not None:  # the first layer's saved input is the received one
        tail[:-1] -= copies * np.minimum(problem.input_bytes, problem.cut_bytes[:-1])
    return head, tail


@dataclass(frozen=True)
class StageCost:
    """One stage of a split, evaluated by the cost model."""

    start: int
    stop: int
    replicas: int
    forward: float  # seconds per micro-batch on one of its devices, divided by replicas
    backward: float  # the whole backward, the recomputed forwards included when recompute
    weight: float  # the part of backward that computes weight gradients (W), with its rebuild
    compute: float  # forward + backward + amortised all-reduce
    allreduce: float  # seconds per mini-batch
    link: float  # seconds the outgoing link is busy per micro-batch (0 for the last stage)
    message: float  # seconds one activation message takes on the outgoing link
    send_bytes: int  # bytes of that message (0 for the last stage)
    memory: int  # bytes on one device
    recompute: bool = False  # whether its backward recomputes the forward (checkpoint "always")

    @property
    def cost(self) -> float:
        """The stage's share of the bottleneck: max(compute, link)."""
        return max(self.compute, self.link)


class _Terms:
    """:func:`memory_terms` and :func:`compute_prefix` of one problem, each computed once per
    distinct input: stages alike (the same in-flight count, the same speed) share them."""

    def __init__(self, problem: Problem) -> None:
        self.problem = problem
        self._memory: dict[tuple[int, bool, int], tuple[np.ndarray, np.ndarray]] = {}
        self._prefix: dict[tuple[float, int, bool], np.ndarray] = {}

    def memory(self, stage: int, recompute: bool, replicas: int) -> tuple[np.ndarray, np.ndarray]:
        key = (self.problem.inflight[stage], recompute, replicas)
        if key not in self._memory:
            self._memory[key] = memory_terms(self.problem, stage, recompute, replicas)
        return self._memory[key]

    def prefix(self, stage: int, replicas: int, recompute: bool) -> np.ndarray:
        key = (self.problem.speed[stage], replicas, recompute)
        if key not in self._prefix:
            self._prefix[key] = compute_prefix(self.problem, stage, replicas, recompute)
        return self._prefix[key]

    def fits(self, stage: int, start: int, stop: int, replicas: int = 1) -> bool:
        """Whether the stage on layers [start, stop) on ``replicas`` replicas fits its
        device's memory cap keeping its activations."""
        cap = self.problem.memory[stage]
        head, tail = self.memory(stage, False, replicas)
        return cap is None or int(head[stop] + tail[start]) <= cap


def evaluate(
    problem: Problem,
    bounds: Sequence[int],
    replicas: Sequence[int] | None = None,
    recompute: Sequence[bool] | None = None,
) -> list[StageCost]:
    """Cost of each stage of the split whose stage t holds layers [bounds[t], bounds[t + 1]).

    ``recompute`` says per stage whether it recomputes; by default as ``problem.checkpoint``
    says, and under "auto" only a stage that does not fit its memory cap otherwise (keeping
    activations is never slower, so this is the fastest choice that fits)."""
    reps = [1] * problem.stages if replicas is None else list(replicas)
    if len(bounds) != problem.stages + 1 or len(reps) != problem.stages:
        raise ValueError(f"a split into {problem.stages} stages needs {problem.stages + 1} bounds")
    terms = _Terms(problem)
    if recompute is None:
        recompute = [
            problem.checkpoint == "always"
            or (problem.checkpoint == "auto"
                and not terms.fits(t, bounds[t], bounds[t + 1], reps[t]))
            for t in range(problem.stages)
        ]
    out = []
    for t in range(problem.stages):
        i, j, r, again = bounds[t], bounds[t + 1], reps[t], bool(recompute[t])
        divisor = problem.speed[t] * r
        head, tail = terms.memory(t, again, r)
        grads = float(problem.param_bytes[i:j].sum())
        prefix = terms.prefix(t, r, again)
        last = t == problem.stages - 1
        forward = float(problem.forward[i:j].sum()) / divisor
        out.append(
            StageCost(
                start=i,
                stop=j,
                replicas=r,
                forward=forward,
                backward=float(problem.backward[i:j].sum()) / divisor
                + (problem.rebuilds(t) * forward if again else 0),
                weight=float(problem.weight_gradient[i:j].sum()) / divisor
                + ((problem.rebuilds(t) - 1) * forward if again else 0),  # W's own rebuild
                compute=float(prefix[j] - prefix[i]),
                allreduce=problem.ring_passes * (1 - 1 / problem.ring(r)) * grads
                / problem.allreduce_bandwidth,
                link=0.0 if last else float(link_time(problem, t)[j]),
                message=0.0 if last else float(problem.cut_bytes[j]) / problem.bandwidth[t],
                send_bytes=0 if last else int(problem.cut_bytes[j]),
                memory=int(head[j] + tail[i]),
                recompute=again,
            )
        )
    return out
