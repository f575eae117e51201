"""Measure an nn.Sequential layer by layer into a :class:`partitioner.Profile`.

Each layer is timed on its own, on the output the layers before it produced from the sample input
(layer i's output is layer i+1's input), as the pipeline runs it in training: in train mode, with
autograd recording, its input requiring grad exactly when it does in the whole model (a first
layer fed plain data computes no input gradient). Its backward is timed from its output's
gradient with ``torch.autograd.backward(outputs, grads)``, which also accumulates the parameter
gradients as training does; after another forward the backward is timed again split as the
zero-bubble schedules run it, B (the input's gradients, graph kept) and W (the weight
gradients, a second pass) apart (``backward_input``, ``backward_weight``). Times are medians
over ``repeats`` sweeps after ``warmup`` sweeps, a sweep running every layer once in model
order (so a drift in the machine's speed touches all layers alike); on CUDA they come from
CUDA events, elsewhere from ``time.perf_counter`` around synchronous work. Between sweeps
every layer's input and output gradient for the sample batch stay on the device (the
activations of one forward pass, without autograd's intermediates).

Times describe this process's settings: profile with the thread count (``torch.set_num_threads``)
and the batch size each pipeline stage will run with (the planner scales times linearly from the
profiled batch to the micro-batch it plans for, which is only an approximation on a CPU, where
small batches run less efficiently).

On a CPU the allocator matters too: glibc's malloc by default returns the activations freed after
each backward to the operating system and page-faults them back in during the next forward, a
cost that layers timed one at a time (whose memory is reused at once) do not see and that varies
with which layers share a process. Train with an allocator that keeps freed memory (jemalloc or
tcmalloc, or glibc tuned with ``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` and
``MALLOC_MMAP_THRESHOLD_``; see ``benchmarks/plan_quality.py``) for predictions to hold.

A layer whose repeats lay far apart (``LayerCost.spread``, :meth:`partitioner.Profile.noisy`)
was timed on a busy machine, or with threads competing for cores: :func:`profile` warns
(:class:`ProfileNoiseWarning`) naming it, since a time off several-fold moves the plan.

The model is left as it was found: its train/eval mode, its buffers (BatchNorm statistics), its
parameters' ``.grad`` and the random number generators are restored afterwards. With ``device``
the model is moved there (in place) first.
"""

from __future__ import annotations

import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from partitioner import LayerCost, Profile
from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.runtime.planning import layer_signature
from pipetrain.tools.saved import ChainCount, saved_tensors

# Optimizer state per parameter byte: plain SGD keeps nothing, momentum one buffer, Adam two.
OPTIMIZER_STATE = {
    "sgd": 0,
    "momentum": 1,
    "rmsprop": 1,
    "adagrad": 1,
    "adam": 2,
    "adamw": 2,
}


class ProfileNoiseWarning(UserWarning):
    """Some layer's timed repeats lay far apart: its times are not to be trusted."""


def noise_message(profile: Profile, repeats: int, more: str, threads: str) -> str | None:
    """What to say of ``profile``'s noisy layers (None if there are none), with the ways to
    more repeats (``more``) and fewer threads (``threads``) worded for the caller."""
    noisy = profile.noisy()
    if not noisy:
        return None
    named = ", ".join(
        f"layer {i} ({profile.layers[i].name}) {profile.layers[i].spread:.0%}" for i in noisy
    )
    return (
        f"the timed repeats of {named} lay far apart ((slowest - fastest) / median over "
        f"{repeats} repeats): the machine was busy or threads competed for its cores, and "
        f"such times can be off several-fold; profile again with {more}, on a quieter "
        f"machine, or with {threads}"
    )


def spread(times: list[float]) -> float:
    """(slowest - fastest) / median of ``times`` (0 for a single or an all-zero list)."""
    middle = statistics.median(times)
    return (max(times) - min(times)) / middle if middle > 0 else 0.0


def tensors_of(value: object) -> list[torch.Tensor]:
    """The tensors in ``value`` (a tensor or nested tuples, lists and dict values), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in tensors_of(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in tensors_of(item)]
    return []


def _map(value: object, fn: Callable[[torch.Tensor], torch.Tensor]) -> object:
    """``value`` with ``fn`` applied to every tensor in it, structure kept."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple | list):
        return type(value)(_map(item, fn) for item in value)
    if isinstance(value, dict):
        return {key: _map(item, fn) for key, item in value.items()}
    return value


def nbytes(value: object) -> int:
    """Bytes of the tensors in ``value``."""
    return sum(t.numel() * t.element_size() for t in tensors_of(value))


def describe(value: object) -> str:
    """Shapes and dtypes of ``value``'s tensors, for messages."""
    parts = [f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensors_of(value)]
    return parts[0] if len(parts) == 1 else "(" + ", ".join(parts) + ")"


def device_name(device: torch.device) -> str:
    """A readable name of ``device`` for the profile: the GPU's name, or the CPU's and the
    number of threads torch uses."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = "cpu"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = f"cpu ({line.split(':', 1)[1].strip()})"
                break
    except OSError:
        pass
    return f"{name}, {torch.get_num_threads()} threads"


def _model_device(model: nn.Module) -> torch.device:
    for tensor in [*model.parameters(), *model.buffers()]:
        return tensor.device
    return torch.device("cpu")


class _Clock:
    """Marks points in time; ``spans()`` gives the seconds between consecutive marks."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(torch.cuda.current_stream(self.device))
            self.marks.append(event)
            return
        if self.device.type != "cpu":  # another accelerator (mps, xpu, ...): wait for it
            backend = getattr(torch, self.device.type, None)
            if backend is not None and hasattr(backend, "synchronize"):
                backend.synchronize()
        self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [
                a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)
            ]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


@contextmanager
def _preserved(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Restore the model's mode, buffers and gradients and the RNG state afterwards. The
    gradients are set aside (``.grad`` is None while profiling), since the profiling backwards
    would otherwise accumulate into the very tensors that are restored."""
    modes = [m.training for m in model.modules()]
    buffers = [b.detach().clone() for b in model.buffers()]
    grads = [p.grad for p in model.parameters()]
    devices: list[int] = []
    if device.type == "cuda":
        devices = [torch.cuda.current_device() if device.index is None else device.index]
    with torch.random.fork_rng(devices=devices):
        try:
            for p in model.parameters():
                p.grad = None
            yield
        finally:
            for module, mode in zip(model.modules(), modes, strict=True):
                module.training = mode
            with torch.no_grad():
                for b, saved in zip(model.buffers(), buffers, strict=True):
                    b.copy_(saved)
            for p, g in zip(model.parameters(), grads, strict=True):
                p.grad = g


class _LayerRun:
    """One layer (the module, and how it is called: with its glue), the input it gets in the
    model (as leaves that require grad exactly where the model's tensors do), random gradients
    for its outputs, and its timings."""

    def __init__(self, index: int, name: str, layer: tuple[nn.Module, Callable[[object], object]],
                 value: object, flags: list[bool]):
        self.index, self.name, (self.layer, self.call) = index, name, layer
        grad_flags = iter(flags)
        self.leaves = _map(value, lambda t: t.detach().requires_grad_(next(grad_flags)))
        self.grads: list[torch.Tensor] | None = None
        self.forward: list[float] = []
        self.backward: list[float] = []
        self.backward_input: list[float] = []
        self.backward_weight: list[float] = []

    def run(self, device: torch.device, record: bool, chain: ChainCount | None = None) -> object:
        """Forward and backward once (timed into the lists if ``record``); the output. With
        ``chain``, what the forward saves for the backward is counted into it."""
        try:
            # A fresh copy per run: an in-place layer must not change the stored input.
            inputs = _map(self.leaves, lambda t: t.clone())
            for t in tensors_of(self.leaves):
                t.grad = None
            clock = _Clock(device)
            clock.mark()
            if chain is None:
                output = self.call(inputs)
            else:
                saved = saved_tensors(self.layer.parameters())
                with saved.recording():
                    output = self.call(inputs)
                chain.add(saved, tensors_of(inputs), tensors_of(output))
            clock.mark()
            outs = [t for t in tensors_of(output) if t.requires_grad]
            if self.grads is None:  # made once, outside the timing
                self.grads = [torch.randn_like(t) for t in outs]
            if outs:
                torch.autograd.backward(outs, self.grads)
            clock.mark()
        except Exception as error:
            raise ValueError(
                f"layer {self.index} ({self.name}) failed on an input of "
                f"{describe(self.leaves)}: {type(error).__name__}: {error}"
            ) from error
        if record:
            spans = clock.spans()
            self.forward.append(spans[0])
            self.backward.append(spans[1] if outs else 0.0)
            self._split(device)
        return output

    def _split(self, device: torch.device) -> None:
        """Time the backward split as the zero-bubble schedules run it (a stage's cut layer,
        pipetrain/runtime/split_backward.py), after another forward: B, the input's gradients
        with the graph kept and no weight gradient; then W, the weight gradients from the
        same output gradients, through the layer's graph again."""
        inputs = _map(self.leaves, lambda t: t.clone())
        outs = [t for t in tensors_of(self.call(inputs)) if t.requires_grad]
        wanted = [t for t in tensors_of(inputs) if t.requires_grad]
        weights = [p for p in self.layer.parameters() if p.requires_grad]
        clock = _Clock(device)
        clock.mark()
        if outs and wanted:
            torch.autograd.grad(outs, wanted, self.grads, retain_graph=True, allow_unused=True)
        clock.mark()
        if outs and weights:
            torch.autograd.backward(outs, self.grads, inputs=weights)
        clock.mark()
        b, w = clock.spans()
        self.backward_input.append(b if outs and wanted else 0.0)
        self.backward_weight.append(w if outs and weights else 0.0)


def profile(
    model: nn.Sequential | LayerTree,
    sample_input: object,
    *,
    optimizer: str = "adam",
    warmup: int = 2,
    repeats: int = 5,
    device: str | torch.device | None = None,
) -> Profile:
    """Profile every layer of ``model`` on ``sample_input`` (one batch: its first tensor's
    dimension 0 is the batch size); see the module docstring for what is measured.

    ``optimizer`` sets the optimizer state per parameter: "sgd" none, "momentum", "rmsprop"
    and "adagrad" one copy of the parameters, "adam" and "adamw" two. ``device``: where to run
    (the model is moved there); by default where the model's parameters are. A layer that
    fails raises ValueError naming the layer and the input it was given. Noisy timings warn
    (:class:`ProfileNoiseWarning`), naming the layers.
    """
    model = layer_tree(model, "profile")
    if len(model) == 0:
        raise ValueError("the model has no layers to profile")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZER_STATE)}, got {optimizer!r}")
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    where = _model_device(model) if device is None else torch.device(device)
    if device is not None:
        model.to(where)
    inputs = tensors_of(sample_input)
    if not inputs or inputs[0].dim() == 0:
        raise ValueError(
            "the sample input must be a tensor (or a tuple of tensors) whose first dimension "
            f"is the batch, got {type(sample_input).__name__}"
        )
    batch_size = int(inputs[0].shape[0])
    if batch_size < 1:
        raise ValueError("the sample input's batch (dimension 0) is empty")
    value = _map(sample_input, lambda t: t.to(where))
    names, counts = layer_signature(model)
    runs: list[_LayerRun] = []
    with _preserved(model, where), torch.enable_grad():
        model.train()
        # Sweep 0 passes the sample through the layers in order and keeps every layer's input;
        # each further sweep runs every layer once more, so drifts in the machine's speed
        # touch all layers alike and each layer runs after its predecessor, as in training.
        flags = [t.requires_grad for t in tensors_of(value)]
        outputs = []
        chain = ChainCount()
        for index, name in enumerate(names):
            runs.append(_LayerRun(index, name, (model[index], model.bound(index)), value, flags))
            output = runs[-1].run(where, record=warmup == 0, chain=chain)
            outputs.append(nbytes(output))
            flags = [t.requires_grad for t in tensors_of(output)]
            value = _map(output, lambda t: t.detach())
        for sweep in range(1, warmup + repeats):
            for run in runs:
                run.run(where, record=sweep >= warmup)
    result = Profile(
        device=device_name(where),
        batch_size=batch_size,
        layers=_layer_costs(
            runs, counts, outputs, OPTIMIZER_STATE[optimizer], tied_bytes(model), chain.counts
        ),
        input_bytes=sum(t.numel() * t.element_size() for t in inputs),
    )
    more = max(2 * repeats, 10)
    said = noise_message(
        result, repeats, f"more repeats (repeats={more})", "fewer threads (torch.set_num_threads)"
    )
    if said is not None:
        warnings.warn(said, ProfileNoiseWarning, stacklevel=2)
    return result


def tied_bytes(model: LayerTree) -> list[int]:
    """Per layer, the bytes of its parameters that another layer holds too (a tied weight, or
    a layer used at several positions): ZeRO 2 and 3 keep such a weight whole on every
    replica where the layers holding it are on different stages."""
    holders: dict[int, int] = {}
    for layer in model:
        for p in layer.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    return [
        sum(p.numel() * p.element_size() for p in layer.parameters() if holders[id(p)] > 1)
        for layer in model
    ]


def _layer_costs(
    runs: list[_LayerRun], counts: list[int], outputs: list[int], state_factor: int,
    tied: list[int], saved: list[tuple[int, int]],
) -> list[LayerCost]:
    """Each timed layer's costs: median times, their spread, output, weight, tied and saved
    bytes."""
    layers = []
    for run, count, size, shared, (kept, kept_input) in zip(
        runs, counts, outputs, tied, saved, strict=True
    ):
        params = list(run.layer.parameters())
        param_bytes = sum(p.numel() * p.element_size() for p in params)
        trained = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
        layers.append(
            LayerCost(
                name=run.name,
                forward=statistics.median(run.forward),
                backward=statistics.median(run.backward),
                backward_input=statistics.median(run.backward_input),
                backward_weight=statistics.median(run.backward_weight),
                activation_bytes=size,
                param_count=count,
                param_bytes=param_bytes,
                optimizer_state_bytes=state_factor * trained,
                spread=spread([f + b for f, b in zip(run.forward, run.backward, strict=True)]),
                tied_bytes=shared,
                saved_bytes=kept,
                saved_input_bytes=kept_input,
            )
        )
    return layers
