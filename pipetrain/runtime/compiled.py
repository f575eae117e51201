"""``compile=True``: each layer of a stage run through ``torch.compile``.

Each layer (a transformer block, a Linear) is compiled on its own, as torchtitan compiles each
transformer block, rather than the stage's slice whole:

- the stage runs its slice layer by layer (stage_module.py): it names the layer a failure came
  from, and under a split backward it places an alias after each layer, which a whole-slice
  graph would have to trace through or break at;
- identical blocks run one compiled graph (the layers' code is one, their weights are inputs),
  so compile time is that of each kind of layer once, however many blocks a stage holds and
  wherever the plan cuts;
- FSDP2 (``zero=2``/``3``) shards each layer and gathers its weights in hooks around its call,
  which stay outside the compiled code, between layers.

A layer's compiled forward is one autograd node whose backward (AOTAutograd's, compiled too)
computes its input and weight gradients together. A split backward cannot take the first
without the second, so a compiled stage backpropagates whole in B and its W finds its weight
gradients there already (split_backward.py; docs/design.md says what was measured).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pipetrain.layer_tree import LayerTree


def compile_option(value: object) -> object:
    """Refuse a ``compile`` that is neither a bool nor a list or tuple of one per stage."""
    members = value if isinstance(value, list | tuple) else [value]
    if not members or any(not isinstance(v, bool) for v in members):
        raise TypeError(
            f"compile must be True, False or a list of one bool per stage, got {value!r}"
        )
    return value


def inductor_refusal(device: torch.device) -> str | None:
    """Why inductor cannot compile for ``device`` here, with the fix; None where it can: on a
    CPU it builds C++ (a compiler: g++, or the one CXX names), on a GPU triton kernels."""
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as error:  # torch's InvalidCxxCompiler, or its search failing
            return (
                f"compile=True on {device} needs a C++ compiler for inductor's CPU backend "
                f"({type(error).__name__}): install g++ (or set CXX), or pass compile=False"
            )
        return None
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            return (f"compile=True on {device} needs triton for inductor's GPU kernels: "
                    "pip install triton, or pass compile=False")
    return None


def compiled_calls(layers: LayerTree) -> list[Callable[..., object]]:
    """One compiled call per layer (a layer at several positions compiled once): the layer's
    own ``__call__``, with its glue where it has one (pipetrain/layer_tree.py), under
    ``torch.compile``, so its hooks run as before, its parameters stay its own and the model's
    keys are unchanged (the compiled wrapper is held, not registered)."""
    made: dict[int, Callable[..., object]] = {}
    calls = layers.called()
    for layer, call in zip(layers, calls, strict=True):
        if id(layer) not in made:
            made[id(layer)] = torch.compile(call if call is layer else call.__call__)
    return [made[id(layer)] for layer in layers]
