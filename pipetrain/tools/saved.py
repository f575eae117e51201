"""What a layer's forward saves for its backward, in bytes, for the planner's memory model.

Saved-tensor hooks see every tensor autograd keeps (as pipetrain.observe.memory's ledger does
for a running stage); parameters (and views of them) are left out, a tensor saved twice
counts once, and the saved tensors that are the layer's own inputs or outputs are told apart:
along a chain, a layer's input is the output of the layer before, so where that layer saved
it already the later layer's copy is no new memory. Works on real and meta tensors (on the
meta device tensors have no storage to compare: identity is by tensor object and view base).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def _root(t: torch.Tensor) -> object:
    """What makes two saved tensors one allocation: the storage, or on the meta device (no
    storage) the tensor a view was taken of."""
    if t.device.type == "meta":
        return id(t._base if t._base is not None else t)
    return t.untyped_storage().data_ptr()


def _allocation(t: torch.Tensor) -> int:
    """Bytes of the allocation ``t`` keeps alive: its storage's (a view holds all of it)."""
    if t.device.type == "meta":
        return (t._base if t._base is not None else t).nbytes
    return t.untyped_storage().nbytes()


@dataclass
class SavedTensors:
    """The tensors one forward saved, each allocation once, parameters left out."""

    excluded: set[object]
    saved: dict[object, int] = field(default_factory=dict)  # allocation -> bytes

    @contextmanager
    def recording(self) -> Iterator[None]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            key = _root(t)
            if key not in self.excluded:
                self.saved[key] = _allocation(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield

    def among(self, tensors: Iterable[torch.Tensor]) -> int:
        """Bytes of the saved allocations that are among ``tensors``."""
        keys = {_root(t) for t in tensors}
        return sum(size for key, size in self.saved.items() if key in keys)

    @property
    def total(self) -> int:
        return sum(self.saved.values())


def saved_tensors(parameters: Iterable[torch.Tensor]) -> SavedTensors:
    """A recorder that leaves ``parameters`` (a layer's) out."""
    return SavedTensors(excluded={_root(p) for p in parameters})


@dataclass
class ChainCount:
    """Per layer along a chain, (saved_bytes, saved_input_bytes) as the profile records them:
    a saved input that the layer before saved as its output counts there, not here."""

    previous_output: int = 0  # bytes of its own output the layer before saved
    counts: list[tuple[int, int]] = field(default_factory=list)

    def add(self, record: SavedTensors, inputs: Iterable[torch.Tensor],
            outputs: Iterable[torch.Tensor]) -> None:
        own_input = record.among(inputs)
        new_input = max(own_input - self.previous_output, 0)
        self.counts.append((record.total - own_input + new_input, new_input))
        self.previous_output = record.among(outputs)
