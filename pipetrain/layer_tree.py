"""A model as pipetrain splits it: one module tree and the ordered names of its layers.

A layer's name is its real path in the tree, so the tree's ``state_dict`` keys are the
model's own and every torch utility that resolves a dotted name (``get_submodule``,
``get_parameter``, ``torch.func.functional_call``, FSDP2) finds it. An ``nn.Sequential``'s
layers are named "0", "1", ...; a Hugging Face causal LM's (pipetrain.hf.sequential)
"model.embed_tokens", "model.layers.0", ..., "model.norm", "lm_head". The modules on the way
to a layer are plain containers (:class:`Branch`) holding only the layers below them, so a
slice of the model (a stage's layers) is a tree of its own under the same names.

A layer whose forward does not take what the previous layer returns (a Hugging Face decoder
block takes its attention mask and rotary embedding as keywords) is run through its
:class:`Glue`: a callable outside the parameter tree that calls the layer, so the layer's
hooks (FSDP2's gathers among them) run as on any call of it.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, overload

from torch import nn


class Glue(Protocol):
    """How to run a layer on the value that reaches it: ``glue(layer, value)``. A glue that
    also decodes incrementally (pipetrain/runtime/decoding.py) defines ``decode(layer,
    value, state)``."""

    def __call__(self, layer: nn.Module, value: Any) -> Any: ...


class Branch(nn.Module):
    """A module on the way to layers (the "model" of "model.layers.0"): it holds them under
    their names and is never called."""


class Bound:
    """A layer with its glue, called as the layer would be on the value that reaches it."""

    def __init__(self, glue: Glue, layer: nn.Module):
        self.glue, self.layer = glue, layer
        if callable(getattr(glue, "decode", None)):
            self.decode = self._decode

    def __call__(self, value: Any) -> Any:
        return self.glue(self.layer, value)

    def _decode(self, value: Any, state: Any) -> Any:
        return self.glue.decode(self.layer, value, state)  # type: ignore[attr-defined]


class LayerTree(nn.Module):
    """A model's layers by name in one module tree (see the module docstring). It reads as a
    sequence of its layers: ``len``, iteration and ``tree[i]`` give the layer modules in
    order, ``tree[a:b]`` a tree of those layers (the same modules, under the same names);
    ``bound(i)`` the layer as called, with its glue. Calling the tree runs its layers in
    order. A layer used at several positions is named at each."""

    names: list[str]
    glue: dict[str, Glue]

    def __init__(
        self, layers: Iterable[tuple[str, nn.Module]] = (), glue: Mapping[str, Glue] | None = None,
    ):
        super().__init__()
        self.__dict__["names"] = []
        self.__dict__["glue"] = dict(glue or {})
        for name, layer in layers:
            self._place(name, layer)
        unknown = sorted(set(self.glue) - set(self.names))
        if unknown:
            raise ValueError(f"glue given for {unknown}, which are not layers of this tree")

    def _place(self, name: str, layer: nn.Module) -> None:
        """Register ``layer`` at the path ``name``, making the containers on the way."""
        if not isinstance(layer, nn.Module):
            raise TypeError(f"layer {name!r} is a {type(layer).__name__}, not an nn.Module")
        if name in self.names:
            raise ValueError(f"two layers are named {name!r}: a layer's name is its path")
        if not isinstance(name, str) or "" in name.split("."):
            raise ValueError(f"layer name {name!r} is no path: give dotted names of modules, "
                             "e.g. 'model.layers.0'")
        *path, leaf = name.split(".")
        parent: nn.Module = self
        for depth, part in enumerate(path):
            child = parent._modules.get(part)
            if child is None:
                child = parent._modules[part] = Branch()
            elif not isinstance(child, Branch):
                above = ".".join(path[: depth + 1])
                raise ValueError(f"layer {name!r} would lie inside layer {above!r}: a layer "
                                 "holds no other layer")
            parent = child
        if leaf in parent._modules:
            raise ValueError(f"layer {name!r} would hold the layers under it")
        parent._modules[leaf] = layer
        self.names.append(name)

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[nn.Module]:
        return (self.get_submodule(name) for name in self.names)

    @overload
    def __getitem__(self, index: int) -> nn.Module: ...

    @overload
    def __getitem__(self, index: slice) -> LayerTree: ...

    def __getitem__(self, index: int | slice) -> nn.Module | LayerTree:
        if isinstance(index, slice):
            return self.select(self.names[index])
        return self.get_submodule(self.names[index])

    def positions(self) -> list[tuple[str, nn.Module]]:
        """Every (name, layer) in order."""
        return [(name, self.get_submodule(name)) for name in self.names]

    def bound(self, index: int, layer: nn.Module | None = None) -> Any:
        """Layer ``index`` as called on the value that reaches it: the layer, or the layer
        with its glue; ``layer``: another module in its place (a copy of it)."""
        name = self.names[index]
        glue = self.glue.get(name)
        layer = self.get_submodule(name) if layer is None else layer
        return layer if glue is None else Bound(glue, layer)

    def called(self) -> list[Any]:
        """Every layer as called (:meth:`bound`), in order."""
        return [self.bound(index) for index in range(len(self.names))]

    def select(self, names: Iterable[str]) -> LayerTree:
        """A tree of the same class holding the layers ``names`` (the same modules) and their
        glue, with this tree's other attributes; hooks and registrations start empty."""
        names = list(names)
        made = copy.copy(self)
        nn.Module.__init__(made)
        made.training = self.training
        made.__dict__["names"] = []
        made.__dict__["glue"] = {n: g for n, g in self.glue.items() if n in names}
        for name in names:
            made._place(name, self.get_submodule(name))
        return made

    def forward(self, value: Any) -> Any:
        for layer in self.called():
            value = layer(value)
        return value

    def extra_repr(self) -> str:
        return f"layers: {len(self.names)}"


def layer_tree(model: nn.Module, what: str = "Pipeline") -> LayerTree:
    """``model`` as a LayerTree: itself, or an ``nn.Sequential``'s layers under its keys (the
    same modules, so its state_dict keys are the Sequential's); anything else is refused,
    saying what ``what`` takes."""
    if isinstance(model, LayerTree):
        return model
    if isinstance(model, nn.Sequential):
        tree = LayerTree((k, layer) for k, layer in model._modules.items() if layer is not None)
        tree.training = model.training
        return tree
    raise TypeError(
        f"{what} takes an nn.Sequential (or a LayerTree: pipetrain.hf.sequential(model) for a "
        f"Hugging Face causal LM), got {type(model).__name__}"
    )
