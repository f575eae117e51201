"""A training step's metrics: the figures ``Pipeline.metrics`` shows (loss, speed, each rank's
bubble and peak memory, the optimizer step's), kept as device tensors until first read."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from pipetrain.observe.progress import Progress, logger, memory_kind, memory_label, peak_memory
from pipetrain.runtime import microbatch
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.update import Update
from pipetrain.runtime.world import World


class StepMetrics:
    """The last step's metrics on this process (see Pipeline's docstring), reported on the
    coordinator by ``progress`` (None: not reported; the ranks' figures are then this
    process's own). Each read first warns of the skipped steps ``update`` (a synchronous
    pipeline's optimizer step) has not yet warned of."""

    def __init__(self, world: World, progress: Progress | None, update: Update | None):
        self.world, self.progress, self.update = world, progress, update
        self._metrics: dict[str, Any] = {}  # device tensors where the device made them
        self._read: dict[str, Any] | None = None  # the same as numbers, once read

    def record(
        self, step: int, loss: torch.Tensor, step_time: float, executors: Sequence[Executor],
        stages: Sequence[Stage], batch: object, extra: dict[str, Any],
    ) -> None:
        """Keep step ``step``'s figures; log and report them where asked (which reads them)."""
        size = microbatch.batch_size(batch, "batch") if batch is not None else None  # type: ignore[arg-type]
        bubbles = [1.0 - e.compute_time / step_time for e in executors]
        memory = [float(peak_memory(s.device)) for s in stages]
        # One figure per device this process tells apart; a CPU's is the whole process's.
        peaks = {memory_label(s.device): m for s, m in zip(stages, memory, strict=True)}
        if self.progress is not None:
            bubbles, memory, peaks = self.world.gather_per_rank(bubbles, memory, peaks)
        self._read = None
        self._metrics = {
            "step": step,
            "loss": loss,
            "step_time": step_time,
            "samples_per_second": size / step_time if size else None,
            "stage_bubble": bubbles,
            "stage_peak_memory": memory,
            "peak_memory": peaks,
            "peak_memory_kind": memory_kind(stages[0].device),
            **extra,
        }
        if logger.isEnabledFor(logging.DEBUG):  # reading the metrics waits for the device
            logger.debug("step %d: %s", step, self.read())
        if self.progress is not None and self.world.placement.is_coordinator:
            self.progress.update(self.read())

    def read(self) -> dict[str, Any]:
        """The figures as numbers (the first read after a step waits for the device)."""
        if self.update is not None:
            self.update.report(wait=True)
        if self._read is None:
            self._read = {k: _number(v) for k, v in self._metrics.items()}
        return self._read


def _number(value: object) -> object:
    """A metric as a number: a 0-d tensor read (the host waits for the device), else as is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value
