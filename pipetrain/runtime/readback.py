"""Reading a step's device values on the host without making the host wait for the device.

A figure of the step (whether it was skipped and why) is a small tensor on the device;
``float()`` or ``.tolist()`` on it would block the host until the device got there (a host
sync on CUDA, which stops the host from queueing the next step's work). :class:`HostCopy`
starts the copy to pinned host memory behind the step's work and says whether it has landed;
only reading it before then waits. On a CPU the tensor is already on the host: nothing waits.
"""

from __future__ import annotations

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


def wait_for(tensor: torch.Tensor) -> list[Any]:
    """``tensor``'s values on the host now, the host waiting for the device (a host sync on
    CUDA): for a read the step cannot go on without (data_parallel.py's presence)."""
    return tensor.tolist()
