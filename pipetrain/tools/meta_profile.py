"""Profile a model built on the meta device, never holding more than one layer of it.

Bytes come from shapes: parameter bytes from the meta parameters, activation bytes and what
each layer saves for its backward (pipetrain.tools.saved) from a forward pass on the meta
device (no data, no time). Times come from building one layer at a
time: a copy of the layer is materialized on the device (random values, then its modules'
``reset_parameters()``), its forward and backward are timed as ``pipetrain.tools.profiler`` times
them, and the copy is freed before the next layer. With ``reuse_times`` a run of identical
consecutive layers (same class, structure, tensor shapes and input) is timed once: each later
layer of the run records the first one's times and names it in ``timed_as``. A layer's input
is the previous layer's real output where that layer ran, else random values of the meta
output's shape (zeros for integer tensors).

With ``flops_per_second`` nothing is built: a layer's forward and backward times are their
FLOPs (torch.utils.flop_counter, on the meta device) at that rate, for sizing a run on
accelerators this machine does not have (a 70B model on a laptop). Matrix products and
attention are counted, elementwise work (norms, activations, the embedding's lookup) is not,
and the rate is whatever the user says the device sustains: an estimate, named as one in the
profile's device.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
from dataclasses import dataclass, replace
from typing import Any, cast

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from partitioner import LayerCost, Profile
from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.runtime.planning import layer_signature
from pipetrain.tools import profiler
from pipetrain.tools.saved import ChainCount, saved_tensors
from pipetrain.training.lazy import is_meta, reset_layer


def profile(
    model: nn.Sequential | LayerTree, sample_input: object, *, optimizer: str = "adam",
    warmup: int = 2, repeats: int = 5, device: str | torch.device | None = None,
    reuse_times: bool = False, flops_per_second: float | None = None,
) -> Profile:
    """Profile ``model`` per layer (see pipetrain.tools.profiler): a model built on the meta
    device one layer at a time (this module), any other as pipetrain.tools.profiler does.
    ``flops_per_second`` (meta only): each layer's times are its forward's and backward's
    FLOPs at that rate, counted on the meta device, nothing built or run (see the module
    docstring)."""
    model = layer_tree(model, "profile")
    timing = _Timing(warmup, repeats, torch.device(device or "cpu"), reuse_times,
                     flops_per_second)
    if not is_meta(model):
        if reuse_times or flops_per_second is not None:
            raise ValueError(
                "reuse_times and flops_per_second apply to a model built on the meta device; "
                "a built model's layers are each timed (leave them out)"
            )
        return profiler.profile(
            model, sample_input, optimizer=optimizer, warmup=warmup, repeats=repeats,
            device=device,
        )
    if flops_per_second is not None and not flops_per_second > 0:
        raise ValueError(f"flops_per_second must be positive, got {flops_per_second}")
    return _profile_meta(model, sample_input, optimizer, timing)


@dataclass(frozen=True)
class _Timing:
    """How a meta profile gets its times: timed on ``device`` (``warmup``, ``repeats``, a run
    of identical layers once with ``reuse_times``), or counted at ``flops_per_second``."""

    warmup: int
    repeats: int
    device: torch.device
    reuse_times: bool
    flops_per_second: float | None


def _check(model: LayerTree, sample_input: object, optimizer: str, warmup: int,
           repeats: int) -> int:
    """The batch size; the same refusals as pipetrain.tools.profiler."""
    if len(model) == 0:
        raise ValueError("the model has no layers to profile")
    if optimizer not in profiler.OPTIMIZER_STATE:
        raise ValueError(
            f"optimizer must be one of {sorted(profiler.OPTIMIZER_STATE)}, got {optimizer!r}"
        )
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    inputs = profiler.tensors_of(sample_input)
    if not inputs or inputs[0].dim() == 0 or inputs[0].shape[0] < 1:
        raise ValueError(
            "the sample input must be a tensor (or a tuple of tensors) whose first dimension "
            f"is a non-empty batch, got {type(sample_input).__name__}"
        )
    return int(inputs[0].shape[0])


def _key(layer: nn.Module, value: object) -> str:
    """What makes two layers identical for timing: structure, tensor shapes, input shapes."""
    tensors = [f"{n}{tuple(t.shape)}{t.dtype}{t.requires_grad}"
               for n, t in [*layer.named_parameters(), *layer.named_buffers()]]
    return f"{layer!r}|{tensors}|{profiler.describe(value)}"


def _build(layer: nn.Module, device: torch.device) -> nn.Module:
    """A real copy of a meta layer on ``device``, its values random, then its modules' reset."""
    built = copy.deepcopy(layer).to_empty(device=device)
    with torch.no_grad():
        for t in [*built.parameters(), *built.buffers()]:
            if t.is_floating_point():
                t.normal_(0.0, 0.02)
            else:
                t.zero_()
        reset_layer(built)
    return built


def _stand_in(value: object, device: torch.device) -> object:
    """Real values of ``value``'s (meta) shapes: normal floats, integer zeros."""
    def make(t: torch.Tensor) -> torch.Tensor:
        if t.is_floating_point():
            return torch.randn(t.shape, dtype=t.dtype, device=device)
        return torch.zeros(t.shape, dtype=t.dtype, device=device)
    return profiler._map(value, make)


def _leaves(value: object, flags: list[bool]) -> object:
    """``value``'s tensors requiring grad where ``flags`` say (as in the model)."""
    grads = iter(flags)
    return profiler._map(value, lambda t: t.requires_grad_(next(grads)))


_TIMES = ("forward", "backward", "backward_input", "backward_weight")


def _times(layer: LayerCost) -> dict[str, Any]:
    """``layer``'s measured times, by name, for a layer that reuses them."""
    return {what: getattr(layer, what) for what in _TIMES}


def _time(model: LayerTree, index: int, name: str, value: object, flags: list[bool],
          timing: _Timing) -> tuple[dict[str, Any], object]:
    """Median seconds of one materialized copy of layer ``index`` (forward, backward and the
    split backward's B and W, as :class:`LayerCost` names them), and its output (detached)."""
    built = _build(model[index], timing.device)
    run = profiler._LayerRun(index, name, (built, model.bound(index, built)), value, flags)
    output: object = None
    for sweep in range(timing.warmup + timing.repeats):
        output = run.run(timing.device, record=sweep >= timing.warmup)
    times = {what: statistics.median(getattr(run, what)) for what in _TIMES}
    return times, profiler._map(output, lambda t: t.detach())


def _profile_meta(
    model: LayerTree, sample_input: object, optimizer: str, timing: _Timing,
) -> Profile:
    batch_size = _check(model, sample_input, optimizer, timing.warmup, timing.repeats)
    names, counts = layer_signature(model)
    tied = profiler.tied_bytes(model)
    meta = profiler._map(sample_input, lambda t: t.to("meta"))
    real = profiler._map(sample_input, lambda t: t.to(timing.device))
    flags = [t.requires_grad for t in profiler.tensors_of(sample_input)]
    layers: list[LayerCost] = []
    previous: tuple[str, LayerCost] | None = None
    modes = [m.training for m in model.modules()]
    chain = ChainCount()
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        model.train()
        for index, (name, layer) in enumerate(zip(names, model, strict=True)):
            record = saved_tensors(layer.parameters())
            try:
                given = _leaves(meta, flags)
                counter = FlopCounterMode(display=False) if timing.flops_per_second else None
                with record.recording(), counter or contextlib.nullcontext():
                    output = model.bound(index)(given)
                if counter is not None:  # forward and backward FLOPs
                    counted = (counter.get_total_flops(), _backward_flops(layer, output))
            except Exception as error:
                raise ValueError(
                    f"layer {index} ({name}) cannot run on the meta device (on an input of "
                    f"{profiler.describe(meta)}): {type(error).__name__}: {error}; profile the "
                    "model built on a real device"
                ) from error
            chain.add(record, profiler.tensors_of(given), profiler.tensors_of(output))
            key = _key(layer, meta)
            params = list(layer.parameters())
            trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
            cost = LayerCost(
                name=name, forward=0.0, backward=0.0,
                activation_bytes=profiler.nbytes(output), param_count=counts[index],
                param_bytes=sum(p.numel() * p.element_size() for p in params),
                optimizer_state_bytes=profiler.OPTIMIZER_STATE[optimizer] * trained,
                tied_bytes=tied[index], saved_bytes=chain.counts[-1][0],
                saved_input_bytes=chain.counts[-1][1],
            )
            if counter is not None:
                rate = cast(float, timing.flops_per_second)
                layers.append(replace(cost, forward=counted[0] / rate, backward=counted[1] / rate))
            elif timing.reuse_times and previous is not None and previous[0] == key:
                timed = previous[1]
                layers.append(replace(cost, **_times(timed),
                                      timed_as=timed.timed_as or timed.name))
                real = _stand_in(output, timing.device)
            else:
                times, real = _time(model, index, name, real, flags, timing)
                layers.append(replace(cost, **times))
            previous = (key, layers[-1])
            flags = [t.requires_grad for t in profiler.tensors_of(output)]
            meta = profiler._map(output, lambda t: t.detach())
    for module, mode in zip(model.modules(), modes, strict=True):
        module.training = mode
    return Profile(device=_described(timing), batch_size=batch_size, layers=layers,
                   input_bytes=profiler.nbytes(sample_input))


def _backward_flops(layer: nn.Module, output: object) -> int:
    """The FLOPs of ``output``'s backward through ``layer`` on the meta device (the gradients
    it leaves on the layer's parameters are dropped)."""
    outs = [t for t in profiler.tensors_of(output) if t.requires_grad]
    with FlopCounterMode(display=False) as counted:
        if outs:
            torch.autograd.backward(outs, [torch.empty_like(t) for t in outs])
    for p in layer.parameters():
        p.grad = None
    return int(counted.get_total_flops())


def _described(timing: _Timing) -> str:
    """The profile's device: where it was timed, or the rate its FLOPs were counted at."""
    if timing.flops_per_second is not None:
        return (f"{timing.flops_per_second:.3g} FLOP/s (estimated: FLOPs counted on the meta "
                "device)")
    return profiler.device_name(timing.device) + " (built on the meta device, a layer at a time)"
