"""Models built on the meta device, and one initialization rule whatever the split.

A model built under ``with torch.device("meta"):`` has shapes but no data, so building it costs
nothing. Each rank then gives real tensors to its own layers only (``materialize``), on its own
device, and initializes them by a per-layer rule that does not depend on the split: layer ``i``
runs with torch's generators seeded from ``layer_seed(seed, i)``, and its initialization is
``init(layer)`` or, by default, ``reset_layer``: every submodule's own ``reset_parameters()``,
submodules before the module holding them, so a block's own method has the last word. Any
balance, number of ranks or interleaved placement therefore gives the same weights, and
``init_layers`` applies the same rule to a model built eagerly (a single-process reference).

Rules that make the result independent of the split:

- A tensor shared by several layers (a head tied to the embedding) takes the value its FIRST
  layer gives it; later layers' initialization of it is undone. A rank holding the head but not
  the embedding initializes the embedding's layer on the side, keeps the shared tensor and
  drops the rest.
- Every tensor a layer's rule must fill (parameters and buffers, such as BatchNorm's running
  statistics or a position table) has to be written by it; one left untouched (a buffer
  computed in ``__init__``, which on the meta device has no data) is refused with an error
  naming the layer, the tensor and the fix.
- The generators are forked for each layer, so initializing never changes the caller's random
  stream. Weights agree where the rule ran on the same kind of device (the CPU's and a CUDA
  device's generators draw different numbers).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

import torch
from torch import nn

from pipetrain.layer_tree import LayerTree, layer_tree

InitFn = Callable[[nn.Module], None]
M = TypeVar("M", nn.Sequential, LayerTree)

_Slot = tuple[nn.Module, str, bool]  # a module, a tensor's name in it, whether a parameter


def layer_seed(seed: int, index: int) -> int:
    """The seed of layer ``index`` under the user's ``seed``: a hash, so that neighbouring
    layers' streams are unrelated."""
    digest = hashlib.blake2b(f"pipetrain-layer:{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def is_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (has no data)."""
    return any(t.is_meta for t in _tensors(module))


def _tensors(module: nn.Module) -> Iterator[torch.Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _post_order(module: nn.Module, seen: set[int]) -> Iterator[nn.Module]:
    for child in module.children():
        if id(child) not in seen:
            seen.add(id(child))
            yield from _post_order(child, seen)
    yield module


def reset_layer(layer: nn.Module) -> None:
    """The default rule: every submodule's ``reset_parameters()``, submodules first, then the
    modules that hold them (so a composite's own method overrides its parts' defaults)."""
    for module in _post_order(layer, {id(layer)}):
        reset = getattr(module, "reset_parameters", None)
        if callable(reset):
            reset()


def _slots(layer: nn.Module) -> Iterator[_Slot]:
    """Every (module, name, is-parameter) that holds a tensor in ``layer``, shared ones once per
    holder."""
    for module in layer.modules():
        for name, p in module._parameters.items():
            if p is not None:
                yield module, name, True
        for name, b in module._buffers.items():
            if b is not None:
                yield module, name, False


def _get(slot: _Slot) -> torch.Tensor:
    module, name, is_param = slot
    value = (module._parameters if is_param else module._buffers)[name]
    assert value is not None
    return value


def _set(slot: _Slot, value: torch.Tensor) -> None:
    module, name, is_param = slot
    (module._parameters if is_param else module._buffers)[name] = value  # type: ignore[assignment]


def owners(model: LayerTree) -> dict[int, int]:
    """For every tensor (by id), the first layer that holds it."""
    first: dict[int, int] = {}
    for index, layer in enumerate(model):
        for t in _tensors(layer):
            first.setdefault(id(t), index)
    return first


def _slot_name(layer: nn.Module, slot: _Slot) -> str:
    module, name, _ = slot
    prefix = next((n for n, m in layer.named_modules() if m is module), "")
    return f"{prefix}.{name}" if prefix else name


@dataclass
class _Materialized:
    """Fresh tensors made from meta ones: by the meta tensor's id, the new tensor and the
    version it had when made (an initialization must bump it). ``old`` keeps the meta tensors
    alive, so that their ids stay unique."""

    new: dict[int, torch.Tensor] = field(default_factory=dict)
    made_at: dict[int, int] = field(default_factory=dict)  # id(new) -> its version when made
    old: dict[int, torch.Tensor] = field(default_factory=dict)

    def swap_in(self, layer: nn.Module, device: torch.device) -> list[tuple[_Slot, torch.Tensor]]:
        """Replace every meta tensor of ``layer`` by an empty one on ``device`` (one per meta
        tensor, however many modules share it); return what was replaced."""
        replaced = []
        for slot in list(_slots(layer)):
            meta = _get(slot)
            if not meta.is_meta:
                continue
            fresh = self.new.get(id(meta))
            if fresh is None:
                fresh = torch.empty_like(meta, device=device)
                if slot[2]:
                    fresh = nn.Parameter(fresh, requires_grad=meta.requires_grad)
                self.new[id(meta)], self.old[id(meta)] = fresh, meta
                self.made_at[id(fresh)] = fresh._version
            _set(slot, fresh)
            replaced.append((slot, meta))
        return replaced

    def unwritten(self, layer: nn.Module, owned: Callable[[torch.Tensor], bool]) -> list[str]:
        """Names of ``layer``'s fresh tensors that its rule left as they were made."""
        return [
            _slot_name(layer, slot) for slot in _slots(layer)
            if id(_get(slot)) in self.made_at and owned(_get(slot))
            and _get(slot)._version == self.made_at[id(_get(slot))]
        ]


def _devices(layer: nn.Module) -> list[int]:
    return sorted({t.device.index or 0 for t in _tensors(layer) if t.device.type == "cuda"})


def _initialize(
    model: LayerTree, index: int, seed: int, init: InitFn, first: Mapping[int, int],
) -> None:
    """Layer ``index`` by the rule, its generators forked and seeded for it; tensors that an
    earlier layer owns keep the value they had."""
    layer = model[index]
    kept = [(t, t.detach().clone()) for t in _tensors(layer) if first[id(t)] < index]
    with torch.random.fork_rng(devices=_devices(layer)), torch.no_grad():
        torch.manual_seed(layer_seed(seed, index))
        init(layer)
        for tensor, value in kept:
            tensor.copy_(value)


def init_layers(
    model: M, seed: int, init: InitFn | None = None, device: str | torch.device = "cpu",
) -> M:
    """Initialize every layer of ``model`` by the per-layer rule (see the module docstring), in
    place, and return it: what ``Pipeline(meta_model, init_seed=seed, init=init)`` gives each
    rank's layers, for a model built eagerly, or on the meta device (then materialized whole on
    ``device``)."""
    tree = layer_tree(model, "init_layers")
    if is_meta(tree):
        materialize(tree, dict.fromkeys(range(len(tree)), torch.device(device)), seed, init)
        return model
    first = owners(tree)
    for index in range(len(tree)):
        _initialize(tree, index, seed, init or reset_layer, first)
    return model


def materialize(
    model: LayerTree, where: Mapping[int, torch.device], seed: int | None,
    init: InitFn | None = None, skip: Iterable[int] = (),
) -> dict[int, torch.Tensor]:
    """Give the layers in ``where`` (index -> device) real tensors on their devices, and
    initialize them by the rule from ``seed``, except those in ``skip`` (their values come from
    elsewhere, e.g. a weights file); every other layer stays on the meta device. Returns the
    new tensor of every meta tensor replaced, by the meta tensor's id (to re-point lists that
    still hold the meta ones, such as the tied weights)."""
    first = owners(model)
    made = _Materialized()
    for index in sorted(where):
        made.swap_in(model[index], torch.device(where[index]))
    todo = sorted(set(where) - set(skip))
    if todo and seed is None:
        raise ValueError(
            "the model is on the meta device and no weights were given for layers "
            f"{todo}: pass init_seed=... (each layer is initialized from it and its index) or "
            "weights=... (a safetensors or .pt file of the whole model)"
        )
    local = {id(made.new[id(m)]) for i in todo for m in _meta_of(model[i], made)}
    # A shared tensor takes its first layer's value: that layer is built on the side if absent.
    aside = sorted({first[m] for m, t in made.new.items() if id(t) in local} - set(where))
    borrowed = [made.swap_in(model[i], _device_of_shared(model[i], made)) for i in aside]
    first.update({id(t): first[m] for m, t in made.new.items()})
    try:
        for index in sorted(set(todo) | set(aside)):
            assert seed is not None  # checked above: there is work to do
            _initialize(model, index, seed, init or reset_layer, first)
            check = (lambda t: id(t) in local) if index in aside else (lambda t: True)
            left = made.unwritten(model[index], check)
            if left:
                _refuse(model, index, left, init)
    finally:
        for replaced in borrowed:
            for slot, meta in replaced:
                _set(slot, meta)
    return made.new


def _meta_of(layer: nn.Module, made: _Materialized) -> list[torch.Tensor]:
    """The meta tensors whose fresh replacements ``layer`` now holds."""
    fresh = {id(t) for t in _tensors(layer)}
    return [made.old[m] for m, t in made.new.items() if id(t) in fresh]


def _device_of_shared(layer: nn.Module, made: _Materialized) -> torch.device:
    """Where ``layer``'s tensors that were already made live (it is built next to them)."""
    return next(made.new[id(t)].device for t in _tensors(layer) if id(t) in made.new)


def _refuse(model: LayerTree, index: int, left: list[str], init: InitFn | None) -> None:
    layer = model[index]
    how = "init=..." if init is not None else "the modules' reset_parameters()"
    raise ValueError(
        f"layer {index} ({type(layer).__name__}) built on the meta device: {how} left "
        f"{', '.join(left)} unwritten, so it would hold whatever memory it got. Give the "
        "module that holds it a reset_parameters() that fills it (for a buffer computed in "
        "__init__, compute it there), or pass Pipeline(init=fn) / init_layers(..., init=fn) "
        "with fn(layer) filling every tensor, or weights=... with its values"
    )
