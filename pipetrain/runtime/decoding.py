"""How a stage's layers run one step of generation (pipetrain/runtime/generation.py).

A model decodes incrementally when its first layer and every layer after it either defines
``decode(value, state)`` or works on each position alone (a Linear, a norm, Dropout,
Identity). Then each step feeds only the new tokens: the first layer's ``decode`` takes
``(input_ids, attention_mask, position_ids)``, the new tokens (batch, new), the mask of the
whole sequence so far (batch, past + new) and the new tokens' positions, and a layer keeps
what it needs of the earlier steps (a key/value cache) in ``state``, one
:class:`DecodeState` per stage and micro-batch (pipetrain.hf's layers do so). Any other model
is run over the whole sequence at every step: correct, at the cost of recomputing every
earlier position.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from torch import nn

POSITIONWISE = (nn.Linear, nn.LayerNorm, nn.RMSNorm, nn.Dropout, nn.Identity)
"""Layers whose output at a position depends on that position's input alone."""

T = TypeVar("T")


class DecodeState:
    """What one micro-batch's generation keeps on one stage from step to step: whatever its
    layers make once and update at each step (a key/value cache), by key."""

    def __init__(self) -> None:
        self._held: dict[object, Any] = {}

    def held(self, key: object, make: Callable[[], T]) -> T:
        """The value kept under ``key``, made by ``make()`` at its first use."""
        if key not in self._held:
            self._held[key] = make()
        return self._held[key]  # type: ignore[no-any-return]


def decodes(layer: nn.Module) -> bool:
    """Whether ``layer`` can run on the new tokens alone (it defines ``decode``)."""
    return callable(getattr(layer, "decode", None))


def incremental(layers: Iterable[nn.Module]) -> bool:
    """Whether a model of ``layers`` decodes incrementally (see the module docstring)."""
    layers = list(layers)
    return bool(layers) and decodes(layers[0]) and all(
        decodes(layer) or isinstance(layer, POSITIONWISE) for layer in layers
    )


def run_layers(layers: Iterable[nn.Module], value: object, state: DecodeState | None) -> object:
    """``value`` through ``layers``: each that decodes with ``state`` where one is given (an
    incremental step), else by its forward."""
    for layer in layers:
        if state is not None and decodes(layer):
            value = layer.decode(value, state)  # type: ignore[operator]
        else:
            value = layer(value)
    return value
