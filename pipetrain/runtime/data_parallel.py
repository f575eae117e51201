"""Summing gradients across ranks: data-parallel replicas of a stage, and tied weights.

``GradientSync`` all-reduces a set of parameters' gradients over one process group. It is armed
just before a stage's last backward of the mini-batch: from then on each parameter's
post-accumulate hook marks it done, and each bucket's all-reduce starts the moment its last
parameter is done, so communication overlaps the rest of the backward. ``finish`` (before the
optimizer step) launches what is left, waits, and scales. Each parameter's ``.grad`` is a view
into its bucket's flat buffer, so autograd accumulates straight into what is reduced: no copies
in or out (the stage zeroes these gradients in place instead of dropping them).

A parameter that no backward reached on any of the ranks in a step (a detached path, an unused
module, a data-dependent branch no replica's batch took) has no gradient in one process, and
torch's optimizers skip it (no weight decay, no moment update): its zero view must not reach the
optimizer. Each bucket's buffer ends with one presence entry per parameter, reduced with the
gradients (no extra collective): 1 where the parameter's hook fired in a backward of the step
on this rank, else 0. The hooks run on the host, so a rank knows at no cost which parameters
it saw; one it saw has a gradient in one process too. Only a rank that missed some reads their
summed presence back (the one host wait, in such steps only) and drops the gradients no rank
made (``.grad = None`` until :meth:`GradientSync.rebind`, before the next step's backwards).

An asynchronous stage (schedules/asynchronous.py) updates at its own time, once per weight
version, and drops its gradients after each update; its backwards accumulate into the stashed
copies' gradients first (weight_source.py), so no hook on a parameter sees them arrive.
:class:`VersionSync` averages such a stage's gradients over its replicas at the update instead:
one all-reduce of the gradients as they stand, with the same presence entries.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.layer_tree import LayerTree
from pipetrain.runtime import readback

if TYPE_CHECKING:
    from pipetrain.runtime.collectives import Collectives

BUCKET_BYTES = 25 * 2**20  # as DistributedDataParallel's default


class Sync(Protocol):
    """What the executor calls on a stage's gradient reduction: ``arm`` before the stage's
    last backward of the mini-batch, ``finish`` before its optimizer step (GradientSync here,
    sharding.ShardedGradients under ZeRO 2 and 3)."""

    def arm(self) -> None: ...

    def finish(self) -> None: ...

    def rebind(self) -> None:
        """Before a step's first backward: give back the gradients ``finish`` dropped, and
        start noting which ones this step makes."""


class GradientSync:
    """All-reduce (sum, then multiply by ``scale``) the gradients of ``params`` over ``group``;
    ``collectives`` bounds each wait by the pipeline's timeout and names a lost peer."""

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        group: dist.ProcessGroup,
        scale: float,
        collectives: Collectives,
        bucket_bytes: int = BUCKET_BYTES,
        overlap: bool = True,
    ):
        self.group, self.scale, self.collectives = group, scale, collectives
        self.overlap = overlap  # False: reduce everything in finish(), after the backward
        self.buckets: list[list[nn.Parameter]] = []
        size = bucket_bytes
        for p in reversed(list(params)):  # backward produces the last layers' gradients first
            if size + p.numel() * p.element_size() > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self._bucket_of = {id(p): k for k, bucket in enumerate(self.buckets) for p in bucket}
        self.flats = [self._bind(bucket) for bucket in self.buckets]
        self._seen: set[int] = set()  # the parameters whose gradients this rank made this step
        self._dropped: list[tuple[nn.Parameter, torch.Tensor]] = []  # and their views
        self._armed = False
        self._pending: list[int] = []  # parameters still to come, per bucket
        self._launched: dict[int, tuple[dist.Work, torch.Tensor]] = {}
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    @staticmethod
    def _bind(bucket: list[nn.Parameter]) -> torch.Tensor:
        """One zeroed buffer for the bucket: every parameter's gradient becomes a view of it,
        and one presence entry per parameter follows the gradients."""
        size = sum(p.numel() for p in bucket)
        flat = torch.zeros(size + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        offset = 0
        for p in bucket:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat

    def _presence(self, k: int) -> torch.Tensor:
        """Bucket ``k``'s presence entries, one per parameter, after its gradients."""
        return self.flats[k][-len(self.buckets[k]) :]

    def arm(self) -> None:
        """The next backward is the last of the mini-batch: reduce buckets as they complete."""
        if self.overlap:
            self._start()

    def _start(self) -> None:
        self._armed = True
        self._pending = [len(bucket) for bucket in self.buckets]
        self._launched = {}

    def _on_gradient(self, param: torch.Tensor) -> None:
        self._seen.add(id(param))
        if not self._armed:
            return
        k = self._bucket_of[id(param)]
        self._pending[k] -= 1
        if self._pending[k] == 0:
            self._launch(k)

    def _launch(self, k: int) -> None:
        storage = self.flats[k].untyped_storage().data_ptr()
        for p in self.buckets[k]:
            if p.grad is None or p.grad.untyped_storage().data_ptr() != storage:
                raise RuntimeError(
                    "a synchronised parameter's gradient was dropped (zero_grad(set_to_none="
                    "True) or a replaced .grad); its bucket view is gone"
                )
        presence = self._presence(k)
        presence.fill_(1)
        for i, p in enumerate(self.buckets[k]):
            if id(p) not in self._seen:
                presence[i].zero_()
        work = dist.all_reduce(self.flats[k], group=self.group, async_op=True)
        assert work is not None
        self._launched[k] = (work, self.flats[k])

    def finish(self) -> None:
        """Reduce whatever has not been launched yet, wait for all, write the results back."""
        if not self._armed:
            self._start()  # not overlapping, or no backward ran this step
        for k in range(len(self.buckets)):
            if k not in self._launched:
                self._launch(k)
        for work, flat in self._launched.values():
            self.collectives.wait(work, "the gradient all-reduce over the ranks holding "
                                  "copies of these weights", self.group)
            if self.scale != 1.0:
                flat.mul_(self.scale)
        self._armed = False
        self._drop_absent()

    def _drop_absent(self) -> None:
        """Drop the gradients of the parameters no rank's backward reached this step; read
        back only where this rank missed some (every other one is present: it made it)."""
        missed = [
            (k, i) for k, bucket in enumerate(self.buckets)
            for i, p in enumerate(bucket) if id(p) not in self._seen
        ]
        if not missed:
            return
        counts = readback.wait_for(torch.stack([self._presence(k)[i] for k, i in missed]))
        for (k, i), count in zip(missed, counts, strict=True):
            if count == 0:
                p = self.buckets[k][i]
                assert p.grad is not None
                self._dropped.append((p, p.grad))
                p.grad = None

    def rebind(self) -> None:
        """Give the dropped gradients their bucket views back, zeroed (a None ``.grad`` would
        have autograd allocate a fresh tensor outside the bucket); none seen yet this step
        (not even by a step that failed before its end)."""
        for p, view in self._dropped:
            p.grad = view.zero_()
        self._dropped = []
        self._seen = set()


class VersionSync:
    """Average the gradients of an asynchronous stage's ``params`` over its replicas in
    ``group`` (sum, then multiply by ``scale``) once per weight version: ``finish``, just
    before the stage's update, reduces them whole (module docstring); ``collectives`` bounds
    the wait by the pipeline's timeout and names a lost peer."""

    def __init__(
        self, params: Sequence[nn.Parameter], group: dist.ProcessGroup, scale: float,
        collectives: Collectives,
    ):
        self.group, self.scale, self.collectives = group, scale, collectives
        self.by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}  # one buffer per dtype
        for p in params:
            self.by_dtype.setdefault(p.dtype, []).append(p)

    def arm(self) -> None:
        """Nothing: the version's gradients are complete only at its update."""

    def rebind(self) -> None:
        """Nothing: the gradients are the stage's own tensors, not views of a buffer."""

    def finish(self) -> None:
        """All-reduce the gradients the version made; a parameter no replica's backward
        reached keeps no gradient (its optimizer skips it, as in one process)."""
        for params in self.by_dtype.values():
            self._reduce(params)

    def _reduce(self, params: list[nn.Parameter]) -> None:
        """One flat all-reduce of ``params``' gradients (zeros where there is none here) and
        their presence; each gradient becomes a view of the averaged buffer."""
        here = [p.grad is not None for p in params]
        parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel())
                 for p in params]
        presence = torch.tensor(here, dtype=params[0].dtype, device=params[0].device)
        flat = torch.cat([*parts, presence])
        work = dist.all_reduce(flat, group=self.group, async_op=True)
        self.collectives.wait(work, "the gradient all-reduce over this stage's replicas",
                              self.group)
        # the presence summed over the replicas, read only where this rank missed some
        counts = readback.wait_for(flat[-len(params):]) if not all(here) else [1] * len(params)
        if self.scale != 1.0:
            flat.mul_(self.scale)
        offset = 0
        for p, count in zip(params, counts, strict=True):
            p.grad = flat[offset : offset + p.numel()].view_as(p) if count else None
            offset += p.numel()


class JointSync:
    """One reduction shared by several stages of a rank (each calls ``finish`` before its
    step): it runs at the last of them, when every one has made its gradients."""

    def __init__(self, sync: GradientSync, stages: int):
        self.sync, self.stages, self._finished = sync, stages, 0

    def arm(self) -> None:
        """Nothing: the reduction waits for every stage's backward."""

    def finish(self) -> None:
        self._finished += 1
        if self._finished == self.stages:
            self._finished = 0
            self.sync.finish()

    def rebind(self) -> None:
        self.sync.rebind()


def tied_parameters(
    model: LayerTree, balance: Sequence[int]
) -> list[tuple[nn.Parameter, tuple[int, ...]]]:
    """Parameters shared by layers on different stages, each with the stages that use it."""
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    stage_of = {i: s for s in range(len(balance)) for i in range(bounds[s], bounds[s + 1])}
    users: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for i, layer in enumerate(model):
        for p in layer.parameters():
            users.setdefault(id(p), (p, set()))[1].add(stage_of[i])
    return [(p, tuple(sorted(stages))) for p, stages in users.values() if len(stages) > 1]
