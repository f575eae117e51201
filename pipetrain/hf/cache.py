"""The key/value cache of a Hugging Face model's blocks on one stage, for generation.

Each stage keeps, per micro-batch, one transformers ``DynamicCache`` made from the model's
config (so each layer's entry is of its kind: a sliding-window layer keeps its window) in the
micro-batch's decode state (pipetrain/runtime/decoding.py). The stage's blocks fill their own
layers' entries of it (a block's attention indexes the cache by its layer number); the entries
of other stages' layers stay empty, so a mask is sized against the block's own entry.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from torch import nn

from pipetrain.runtime.decoding import DecodeState

CACHE_ARGUMENTS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""The names a block's forward takes its cache by, newest transformers first."""


def cache_argument(block: nn.Module) -> str | None:
    """The name ``block``'s forward takes its cache by; None where it takes none."""
    names = inspect.signature(type(block).forward).parameters
    return next((n for n in CACHE_ARGUMENTS if n in names), None)


def stage_cache(state: DecodeState, key: object, config: Any) -> Any:
    """The cache of one stage's blocks of the model ``key`` names, for the micro-batch
    ``state`` belongs to: made at the first step, from ``config``."""

    def make() -> Any:
        import transformers

        return transformers.DynamicCache(config=config)

    return state.held(key, make)


class OneLayer:
    """Layer ``layer``'s entry of a stage's ``cache`` as a cache of that one layer, for
    transformers' mask builders: they size a mask against the first layer of its kind in the
    cache they are given (its ``is_sliding`` list) or the one ``layer_idx`` names, and a
    stage's cache holds only its own layers. Per-layer lists read as this layer's alone; a
    method taking ``layer_idx`` is asked about this layer."""

    def __init__(self, cache: Any, layer: int):
        self.cache, self.layer = cache, layer

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.cache, name)
        if isinstance(value, list | tuple) and len(value) == len(self.cache.layers):
            return [value[self.layer]]
        if callable(value) and "layer_idx" in inspect.signature(value).parameters:
            return functools.partial(self._at_layer, value)
        return value

    def _at_layer(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(method).bind_partial(*args, **kwargs)
        bound.arguments["layer_idx"] = self.layer
        return method(*bound.args, **bound.kwargs)
