"""BatchNorm whose running statistics are those of the whole mini-batch, not of each micro-batch.

Each micro-batch is normalised with its own statistics (as plain BatchNorm would on that input),
but the running mean and variance are updated once per mini-batch, from the statistics gathered
over all its micro-batches, so they match plain BatchNorm fed the whole mini-batch. Statistics
are gathered only inside ``gathering_statistics()``, which the stage enters for a micro-batch's
real forward, never for its recomputation under activation checkpointing.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

_gathering: ContextVar[bool] = ContextVar("pipetrain_gathering_statistics", default=False)


@contextmanager
def gathering_statistics() -> Iterator[None]:
    token = _gathering.set(True)
    try:
        yield
    finally:
        _gathering.reset(token)


class DeferredBatchNorm(nn.modules.batchnorm._BatchNorm):
    """BatchNorm of any dimension that commits running statistics every ``chunks`` calls."""

    def __init__(self, num_features: int, chunks: int, **options: object):
        super().__init__(num_features, **options)  # type: ignore[arg-type]
        self.chunks = chunks
        self._sum: torch.Tensor | None = None
        self._squares: torch.Tensor | None = None
        self._count = 0
        self._seen = 0

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or self.running_mean is None:
            return super().forward(input)
        if _gathering.get():
            self._gather(input.detach())
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    def _gather(self, input: torch.Tensor) -> None:
        dims = [d for d in range(input.dim()) if d != 1]
        total, squares = input.sum(dims), (input * input).sum(dims)
        self._sum = total if self._sum is None else self._sum + total
        self._squares = squares if self._squares is None else self._squares + squares
        self._count += input.numel() // input.shape[1]
        self._seen += 1
        if self._seen == self.chunks:
            self._commit()

    @torch.no_grad()
    def _commit(self) -> None:
        assert self._sum is not None and self._squares is not None
        assert self.running_mean is not None and self.running_var is not None
        mean = self._sum / self._count
        var = (self._squares / self._count - mean * mean) * self._count / max(self._count - 1, 1)
        if self.momentum is None:  # cumulative moving average, as plain BatchNorm does
            assert self.num_batches_tracked is not None
            momentum = 1.0 / float(self.num_batches_tracked + 1)
        else:
            momentum = self.momentum
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(var.to(self.running_var.dtype), momentum)
        if self.num_batches_tracked is not None:
            self.num_batches_tracked += 1
        self._sum = self._squares = None
        self._count = self._seen = 0

    @classmethod
    def convert(cls, module: nn.Module, chunks: int) -> nn.Module:
        """``module`` with every BatchNorm inside (a DeferredBatchNorm too) replaced by a
        DeferredBatchNorm of ``chunks`` that shares its parameters and buffers: its state_dict
        keys stay, and the model sees what training does to them. ``module`` itself is left as
        it was: the modules on the way to a BatchNorm are shallow copies with their own tables
        of children, so a second pipeline of the same model converts with its own ``chunks``."""
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            return cls._sharing(module, chunks)
        children = dict(module.named_children())
        converted = {name: cls.convert(child, chunks) for name, child in children.items()}
        if all(converted[name] is child for name, child in children.items()):
            return module
        twin = copy.copy(module)
        twin._modules = dict(module._modules)
        twin._modules.update(converted)
        return twin

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
