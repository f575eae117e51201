"""The key/value cache of a Hugging Face model's blocks on one stage, for generation.

Each stage keeps, per micro-batch, one transformers ``DynamicCache`` made from the model's
config (so each layer's entry is of its kind: a sliding-window layer keeps its window) in the
micro-batch's decode state (pipetrain/runtime/decoding.py). The stage's blocks fill their own
layers' entries of it (a block's attention indexes the cache by its layer number); the entries
of other stages' layers stay empty, so a mask is sized against the block's own entry.
"""

from __future__ import annotations

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
