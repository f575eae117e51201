"""Counting the activation bytes a stage keeps between a micro-batch's forward and backward.

Saved-tensor hooks see every tensor autograd saves; parameters are left out (they are not
activations), a tensor saved twice counts once, a view counts its own bytes, and the stage's
inputs count too, since the stage holds them until the backward. Inside a checkpointed region
activation checkpointing's own hooks take over and only the region's inputs reach ours, which is
the point of checkpointing. The micro-batches held at once are checked against the schedule's
promise (``bound``, from :func:`schedules.inflight`), which the planner's memory model relies on.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from pipetrain.errors import PipelineError


@dataclass
class ActivationLedger:
    """Live and peak saved bytes and micro-batches of one stage."""

    param_storages: set[int] = field(default_factory=set)
    live: dict[int, int] = field(default_factory=dict)  # micro-batch -> bytes held
    peak_bytes: int = 0
    peak_microbatches: int = 0
    bound: int | None = None  # the most micro-batches the schedule holds here at once

    @classmethod
    def for_parameters(cls, params: Iterable[torch.Tensor]) -> ActivationLedger:
        """A ledger that leaves ``params`` out (of a sharded one, its local shard)."""
        return cls(param_storages={_local(p).untyped_storage().data_ptr() for p in params})

    @contextmanager
    def recording(self, microbatch: int, inputs: Iterable[torch.Tensor]) -> Iterator[None]:
        """Charge what autograd saves inside this block (and ``inputs``) to ``microbatch``."""
        seen: set[tuple[int, int]] = set()

        def charge(t: torch.Tensor) -> None:
            key = (t.data_ptr(), t.nbytes)
            if key not in seen and t.untyped_storage().data_ptr() not in self.param_storages:
                seen.add(key)
                self.live[microbatch] = self.live.get(microbatch, 0) + t.nbytes

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not _weight(t):
                charge(t)
            return t

        self.live.setdefault(microbatch, 0)
        for t in inputs:
            charge(t)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self.peak_microbatches = max(self.peak_microbatches, len(self.live))
        if self.bound is not None and len(self.live) > self.bound:
            raise PipelineError(
                f"the stage holds {len(self.live)} micro-batches' activations but its schedule "
                f"holds at most {self.bound} (schedules.inflight, which the planner's memory "
                "model uses): the schedule's registry entry and the runtime disagree"
            )
        self.peak_bytes = max(self.peak_bytes, sum(self.live.values()))

    def release(self, microbatch: int) -> None:
        self.live.pop(microbatch, None)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2's sharded weights, ZeRO 2 and 3); any other tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _weight(t: torch.Tensor) -> bool:
    """Whether a saved tensor is a weight or a view of one: a leaf that wants its gradient.
    Under ZeRO 2 and 3 FSDP2 swaps gathered weights in for the forward, whose storages the
    ledger could not know when it was made. (A stage's received inputs are such leaves too;
    they are charged as ``inputs``.)"""
    base = t._base if t._base is not None else t
    return base.is_leaf and base.requires_grad
