"""Mixed precision: autocast per stage, and fp16's dynamic loss scale kept equal on every rank.

Each stage runs its forward (and any recomputation) under ``torch.autocast`` on its own device;
parameters, gradients and optimizer state stay fp32. A stage's floating-point outputs leave it in
the autocast dtype, so activations and their gradients cross stage boundaries in half the bytes.

fp16 needs loss scaling (its gradients underflow otherwise): the last stage starts the backward
from ``scale`` instead of 1, every gradient in the pipeline is scaled by it, and before the
optimizer step (pipetrain/runtime/update.py) the gradients are divided by it and checked for
inf/NaN. The check is agreed over every stage and replica, so either every rank steps or none does,
and :class:`LossScaler` then changes the scale the same way everywhere (as ``torch.amp.GradScaler``
does in one process: halve on an overflow, double after ``growth_interval`` clean steps).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
PRECISIONS = tuple(DTYPES)


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` (None for fp32); a clear error for anything else."""
    if precision not in DTYPES:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return DTYPES[precision]


def autocast(
    device: torch.device, dtype: torch.dtype | None, cache: bool = True
) -> AbstractContextManager[Any]:
    """``torch.autocast`` on ``device`` to ``dtype``; nothing for fp32 (None). ``cache=False``
    recasts the weights at each use (a CUDA graph's capture needs that)."""
    if dtype is None:
        return nullcontext()
    return torch.autocast(device.type, dtype=dtype, cache_enabled=cache)


def to_boundary(value: object, dtype: torch.dtype | None) -> object:
    """``value`` (a tensor or a tuple/list of them) with its fp32 tensors cast to ``dtype``,
    as it crosses to the next stage; integer and other tensors pass as they are."""
    if dtype is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.dtype == torch.float32 else value
    if isinstance(value, tuple | list):
        return type(value)(to_boundary(v, dtype) for v in value)
    return value


class LossScaler:
    """fp16's dynamic loss scale, identical on every rank (each rank holds one and feeds every
    one the same all-reduced overflow flag). Defaults are ``torch.amp.GradScaler``'s, and so
    is the bookkeeping: the scale and its count of clean steps are tensors on ``device``,
    updated there (``torch._amp_update_scale_``) so that no step waits for the host to read
    them; ``scale`` and ``clean_steps`` read them (and wait for the device)."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        device: torch.device | str = "cpu",
    ):
        if init_scale <= 0 or growth_factor <= 1 or not 0 < backoff_factor < 1:
            raise ValueError(
                "loss scaling needs init_scale > 0, growth_factor > 1 and 0 < backoff_factor < 1"
            )
        self.tensor = torch.full((), float(init_scale), dtype=torch.float32, device=device)
        # consecutive steps without an overflow since the last change
        self._clean = torch.zeros((), dtype=torch.int32, device=device)
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval

    @property
    def scale(self) -> float:
        return float(self.tensor)

    @property
    def clean_steps(self) -> int:
        return int(self._clean)

    def update(self, found_inf: torch.Tensor) -> None:
        """After a step (``found_inf`` 1.0 on an overflow, a float32 tensor on the scale's
        device or movable there): halve the scale on an overflow, grow it after enough clean
        steps."""
        torch._amp_update_scale_(
            self.tensor, self._clean, found_inf.to(self.tensor.device), self.growth_factor,
            self.backoff_factor, self.growth_interval,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "scale": self.scale, "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
            "clean_steps": self.clean_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.tensor.fill_(float(state["scale"]))
        self._clean.fill_(int(state["clean_steps"]))
        self.growth_factor, self.backoff_factor = state["growth_factor"], state["backoff_factor"]
        self.growth_interval = state["growth_interval"]
