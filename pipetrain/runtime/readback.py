"""Reading a step's device values on the host without making the host wait for the device.

A figure of the step (whether it was skipped and why) is a small tensor on the device;
``float()`` or ``.tolist()`` on it would block the host until the device got there (a host
sync on CUDA, which stops the host from queueing the next step's work). :class:`HostCopy`
starts the copy to pinned host memory behind the step's work and says whether it has landed;
only reading it before then waits. On a CPU the tensor is already on the host: nothing waits.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch


class HostCopy:
    """A copy of ``tensor`` on its way to the host, started now on its device's stream."""

    def __init__(self, tensor: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if tensor.device.type != "cuda":  # a CPU's tensor is on the host (others: a copy now)
            self._host = tensor if tensor.device.type == "cpu" else tensor.cpu()
            return
        with torch.cuda.device(tensor.device):
            self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._host.copy_(tensor, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        """Whether the copy has landed (reading it now waits for nothing)."""
        return self._event is None or self._event.query()

    def values(self) -> list[Any]:
        """The values, waiting for the copy if it has not landed yet."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


class StepLoss(torch.Tensor):
    """The loss ``train_step`` returns: a 0-d tensor on the device that made it, read (the
    one host sync) only when the caller reads it: ``float(loss)``, ``loss.item()``,
    ``f"{loss:.4f}"``, ``round(loss, 4)``, a comparison. It also counts as a real number
    (``numbers.Real``), so that number-minded code such as ``pytest.approx`` or
    ``math.isclose`` takes it as one."""

    __len__ = None  # type: ignore[assignment]  # a scalar, not a sequence: no len(), and not taken for a collection

    def __format__(self, spec: str) -> str:
        return format(self.item(), spec)

    def __round__(self, ndigits: int | None = None) -> float | int:
        """``round(loss, 3)``: as on the float it holds (an int without ``ndigits``)."""
        return round(float(self.item()), ndigits)

    def __trunc__(self) -> int:
        return math.trunc(self.item())

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Saved (torch.save, pickle) as the plain tensor it holds, so that a file of losses
        loads anywhere, ``torch.load(weights_only=True)`` included."""
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> StepLoss:
        return step_loss(self.clone())

    @property
    def imag(self) -> float:  # type: ignore[override]
        """A real number's imaginary part, as ``numbers.Real`` has it."""
        return 0.0


numbers.Real.register(StepLoss)


def step_loss(value: torch.Tensor) -> StepLoss:
    """``value`` (a 0-d tensor) as the loss a step returns, without copying or reading it."""
    return value.detach().as_subclass(StepLoss)
