"""How a weights file's keys become a model's ``state_dict`` keys.

A file saved from the model itself holds the model's keys, one tensor each (:func:`same`). A
checkpoint written by another program may not: a Hugging Face hub checkpoint of a
mixture-of-experts model holds one tensor per expert where transformers' model holds one for
all of them, and renames keys between releases (GPT-NeoX's ``embed_out``, now ``lm_head``). A
layout says, for a file's index, which file keys make which model keys: groups, each with its
file keys (sources), the model keys it makes with their dtype and shape (targets), and how it
makes them. A group that only keeps or renames one key has no ``make``: its bytes are read
straight into the model's tensor, a block of rows at a time; a group that converts has its
sources read whole and made into its targets, one group at a time.

A model names its layout by a ``checkpoint_layout`` attribute (pipetrain.hf.sequential's
layers carry transformers' own conversions); a model without one reads files in its own keys.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

# (dtype, shape) of a tensor in a file or a model, by key
Index = dict[str, tuple[torch.dtype, tuple[int, ...]]]
Make = Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Group:
    """File keys ``sources`` making the model keys ``targets`` (each with its dtype and
    shape); ``make`` None: one key kept or renamed, its tensor as it is in the file."""

    sources: Index
    targets: Index
    make: Make | None = None


class Layout(Protocol):
    """The groups of a file's keys, from its index (every key with its dtype and shape)."""

    def groups(self, index: Index) -> list[Group]: ...


def same(index: Index) -> list[Group]:
    """Each key of the file is the model's key of the same name."""
    return [Group({key: entry}, {key: entry}) for key, entry in index.items()]


def groups(model: nn.Module, index: Index) -> list[Group]:
    """The groups of ``index`` for ``model``: by its ``checkpoint_layout``, or :func:`same`."""
    layout: Layout | None = getattr(model, "checkpoint_layout", None)
    return layout.groups(index) if layout is not None else same(index)
