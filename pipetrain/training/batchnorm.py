"""BatchNorm whose running statistics are those of the whole mini-batch, not of each micro-batch.

Each micro-batch is normalised with its own statistics (as plain BatchNorm would on that input),
but the running mean and variance are updated once per mini-batch, from the statistics gathered
over all its micro-batches, so they match plain BatchNorm fed the whole mini-batch.

A BatchNorm may run several times in one forward: at several positions of the model (the same
layer object twice in the ``nn.Sequential``, on one stage or on two) or called twice by a custom
module. Plain BatchNorm updates its running statistics at every call, in call order. So each
call is gathered in a slot of its own, keyed by the stage and the call's index within that
stage's forward of one micro-batch; the same slot of every micro-batch describes the same call
of the whole mini-batch's forward. Once every stage using the norm has ended its ``chunks``
forwards, the slots are committed in (stage, call) order: the order plain BatchNorm's calls run.

Statistics are gathered only inside ``gathering_statistics()``, which the stage enters once for
each micro-batch's real forward, never for its recomputation under activation checkpointing;
leaving it ends that forward for every norm of the stage.
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class _Forward:
    """One micro-batch's forward of ``stage``: how often each norm has been called in it."""

    stage: int
    calls: dict[int, int] = field(default_factory=dict)
    called: dict[int, DeferredBatchNorm] = field(default_factory=dict)

    def call_of(self, norm: DeferredBatchNorm) -> int:
        """The index of this call of ``norm`` within the forward (0 for its first)."""
        index = self.calls.get(id(norm), 0)
        self.calls[id(norm)] = index + 1
        self.called[id(norm)] = norm
        return index


# the stages of one process run in threads of their own, and may share a norm (one lock for
# all: a norm's lock would keep it from being copied)
_lock = threading.Lock()
_forward: ContextVar[_Forward | None] = ContextVar("pipetrain_gathering_statistics", default=None)


@contextmanager
def gathering_statistics(stage: int = 0, module: nn.Module | None = None) -> Iterator[None]:
    """One micro-batch's forward of ``stage``: the DeferredBatchNorms called inside gather its
    statistics. On leaving, the forward ends for every DeferredBatchNorm in ``module`` (the
    stage's layers: a norm this forward did not reach still counts it) and for every one
    called."""
    forward = _Forward(stage)
    token = _forward.set(forward)
    try:
        yield
    finally:
        _forward.reset(token)
        norms = dict(forward.called)
        if module is not None:
            norms.update((id(m), m) for m in _norms_in(module))
        for norm in norms.values():
            norm.forward_ended(stage)


_found: weakref.WeakKeyDictionary[nn.Module, list[DeferredBatchNorm]] = (
    weakref.WeakKeyDictionary()
)


def _norms_in(module: nn.Module) -> list[DeferredBatchNorm]:
    """The DeferredBatchNorms in ``module``, found once (a stage's layers stay as built)."""
    found = _found.get(module)
    if found is None:
        found = [m for m in module.modules() if isinstance(m, DeferredBatchNorm)]
        _found[module] = found
    return found


@dataclass
class _Moments:
    """Count, mean and sum of squared deviations per channel, in float64, merged across
    micro-batches (Chan et al.'s pairwise update: no cancellation of a sum of squares)."""

    count: int
    mean: torch.Tensor
    deviations: torch.Tensor

    @classmethod
    def of(cls, input: torch.Tensor) -> _Moments:
        dims = [d for d in range(input.dim()) if d != 1]
        var, mean = torch.var_mean(input.float(), dims, correction=0)
        count = input.numel() // input.shape[1]
        return cls(count, mean.double(), var.double() * count)

    def merged(self, other: _Moments) -> _Moments:
        count = self.count + other.count
        delta = other.mean - self.mean
        mean = self.mean + delta * (other.count / count)
        deviations = (self.deviations + other.deviations
                      + delta * delta * (self.count * other.count / count))
        return _Moments(count, mean, deviations)


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm of any dimension that commits running statistics once every stage using it
    has ended ``chunks`` forwards (see the module docstring)."""

    def __init__(self, num_features: int, chunks: int, **options: object):
        super().__init__(num_features, **options)  # type: ignore[arg-type]
        self.chunks = chunks
        # the stages whose forwards use it (assign_stages); None: those that ended one
        self.stages: frozenset[int] | None = None
        self._slots: dict[tuple[int, int], _Moments] = {}
        self._ended: dict[int, int] = {}

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.running_mean is None:
            return super().forward(input)
        forward = _forward.get()
        if forward is not None:
            self._gather((forward.stage, forward.call_of(self)), input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _gather(self, slot: tuple[int, int], input: torch.Tensor) -> None:
        moments = _Moments.of(input)
        with _lock:
            held = self._slots.get(slot)
            self._slots[slot] = moments if held is None else held.merged(moments)

    def forward_ended(self, stage: int) -> None:
        """A forward of ``stage`` ended; after each stage's ``chunks``-th, commit the slots."""
        with _lock:
            self._ended[stage] = self._ended.get(stage, 0) + 1
            users = self._ended.keys() if self.stages is None else self.stages
            if all(self._ended.get(s, 0) >= self.chunks for s in users):
                self._commit()

    @torch.no_grad()
    def _commit(self) -> None:
        """Each slot's statistics into the running ones, in (stage, call) order, as plain
        BatchNorm's calls on the whole mini-batch would update them."""
        for _, moments in sorted(self._slots.items(), key=lambda item: item[0]):
            assert self.running_mean is not None and self.running_var is not None
            if self.num_batches_tracked is not None:
                self.num_batches_tracked += 1
            if self.momentum is None:  # cumulative moving average, as plain BatchNorm does
                assert self.num_batches_tracked is not None
                momentum = 1.0 / float(self.num_batches_tracked)
            else:
                momentum = self.momentum
            var = moments.deviations / max(moments.count - 1, 1)
            for running, value in ((self.running_mean, moments.mean), (self.running_var, var)):
                updated = running.double() * (1 - momentum) + value * momentum
                running.copy_(updated.to(running.dtype))
        self._slots.clear()
        self._ended.clear()

    @classmethod
    def convert(cls, module: nn.Module, chunks: int) -> nn.Module:
        """``module`` with every BatchNorm inside (a DeferredBatchNorm too) replaced by a
        DeferredBatchNorm of ``chunks`` that shares its parameters and buffers: its state_dict
        keys stay, and the model sees what training does to them. A module found at several
        places (a layer used twice) becomes one module at each of them, so a BatchNorm runs
        as one DeferredBatchNorm wherever it is called. ``module`` itself is left as it was:
        the modules on the way to a BatchNorm are shallow copies with their own tables of
        children, so a second pipeline of the same model converts with its own ``chunks``."""
        return cls._converted(module, chunks, {})

    @classmethod
    def _converted(cls, module: nn.Module, chunks: int, done: dict[int, nn.Module]) -> nn.Module:
        """``convert``'s walk; ``done`` maps each module already met to its conversion."""
        if id(module) in done:
            return done[id(module)]
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            made: nn.Module = cls._sharing(module, chunks)
        else:
            # every place, a module listed at several: named_children lists it once
            children = {name: child for name, child in module._modules.items()
                        if child is not None}
            converted = {name: cls._converted(child, chunks, done)
                         for name, child in children.items()}
            made = module
            if any(converted[name] is not child for name, child in children.items()):
                made = copy.copy(module)
                made._modules = dict(module._modules)
                made._modules.update(converted)
        done[id(module)] = made
        return made

    @classmethod
    def _sharing(cls, norm: nn.modules.batchnorm._BatchNorm, chunks: int) -> DeferredBatchNorm:
        """A DeferredBatchNorm of ``chunks`` holding ``norm``'s own tables of parameters and
        buffers (the same tensors, also after the stage moves them to its device)."""
        deferred = cls(
            norm.num_features, chunks, eps=norm.eps, momentum=norm.momentum,
            affine=norm.affine, track_running_stats=norm.track_running_stats,
        )
        deferred._parameters = norm._parameters
        deferred._buffers = norm._buffers
        deferred._non_persistent_buffers_set = norm._non_persistent_buffers_set
        return deferred.train(norm.training)


def assign_stages(stages: Mapping[int, nn.Module], here: Collection[int]) -> None:
    """Tell each DeferredBatchNorm in ``stages`` (stage index -> its layers) which stages use
    it, so that it commits once all of them ended their forwards. A norm shared with a stage
    of another process (``here``: this process's stages) is refused: each process would
    commit its own stages' calls alone, and the copies' statistics would drift apart."""
    users: dict[int, tuple[str, DeferredBatchNorm, set[int]]] = {}
    for index, layers in stages.items():
        for name, norm in layers.named_modules():
            if isinstance(norm, DeferredBatchNorm):
                users.setdefault(id(norm), (name, norm, set()))[2].add(index)
    for name, norm, indices in users.values():
        elsewhere = sorted(indices - set(here))
        if elsewhere and indices & set(here):
            raise ValueError(
                f"deferred_batch_norm: the BatchNorm {name!r} is used by stages "
                f"{sorted(indices)}, which run in different processes ({elsewhere} elsewhere); "
                "its running statistics cannot be gathered across processes. Give those "
                "stages to one rank, use a BatchNorm per position, or leave "
                "deferred_batch_norm off"
            )
        norm.stages = frozenset(indices)
