"""Running one action list on this process's ranks: the mini-batch split into micro-batches
on the devices that read them, one executor per rank here, run by the World; a failure stops
the pipeline for good (its stages are left mid-step)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pipetrain.errors import PipelineError
from pipetrain.observe.progress import logger
from pipetrain.observe.trace import Recorder
from pipetrain.runtime import microbatch
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.handler import Call, Carry, StepHandler, WithinCall
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.world import World
from schedules import Schedule


class Runner:
    """Runs lists of one schedule on ``stages`` (this process's, in stage order) in ``world``,
    ``chunks`` micro-batches a mini-batch; ``recorders`` (one per rank here, or None) trace
    the training lists."""

    def __init__(
        self, world: World, stages: Sequence[Stage], chunks: int, timeout: float,
        recorders: list[Recorder | None],
    ):
        self.world, self.stages, self.chunks, self.timeout = world, list(stages), chunks, timeout
        self.recorders = recorders
        self._carry = [Carry() for _ in world.transports]  # per rank here, across calls
        self.failed: str | None = None  # why the pipeline stopped, once it has
        self.outputs: list[Any] = []  # the last rank's outputs of the last list run

    def _split(self, value: object, what: str, stage: Stage) -> list[Any] | None:
        """``value`` as ``stage``'s micro-batches. A batch it refuses (one chunks does not
        divide) stops the ranks of other processes too, with the reason: they have no batch to
        check (a middle stage, or any stage in evaluation) and would wait out the timeout."""
        if value is None:
            return None
        try:
            batch = microbatch.to_device(value, stage.device)  # type: ignore[arg-type]
            return microbatch.scatter(batch, self.chunks, what)
        except (TypeError, ValueError) as error:
            if self.world.stop_peers(f"stage {stage.index} refused its batch: {error}"):
                self.stop(error)
            raise

    def run(
        self, schedule: Schedule, x: object, y: object, handler: StepHandler | None,
        base: int = 0, losses_done: Callable[[], None] | None = None,
    ) -> list[Executor]:
        """Run ``schedule``: training with ``handler`` as the step handler of its lists
        (pipetrain/runtime/handler.py; see Executor for ``base`` and ``losses_done``), or, with
        None, evaluating; the last rank's outputs land in ``outputs``. Returns the executors
        that ran."""
        self.check()
        training = handler is not None
        first, last = self.stages[0], self.stages[-1]
        inputs = self._split(x, "x", first) if first.is_first else None
        targets = self._split(y, "y", last) if last.is_last else None
        by_index = {stage.index: stage for stage in self.stages}
        executors = [
            Executor(
                [by_index[s] for s in schedule.stages_on(rank)], transport, schedule, rank,
                self.timeout, recorder if training else None, losses_done,
                Call(handler if handler is not None else WithinCall(), carry, base, training),
            )
            for rank, transport, recorder, carry in zip(
                self.world.placement.ranks, self.world.transports, self.recorders, self._carry,
                strict=True,
            )
        ]
        try:
            self.outputs = self.world.run(executors, inputs, targets, training)
            return executors
        except Exception as error:
            self.stop(error)
            logger.error("pipeline failed: %s", self.failed)
            raise

    def check(self) -> None:
        """Refuse to run once the pipeline has stopped after a failure."""
        if self.failed:
            raise PipelineError(
                f"this pipeline stopped after a failure ({self.failed}); build a new one "
                "(and reload a checkpoint) to go on"
            )

    def save_trace(self, folder: Path) -> list[Path]:
        """Write the recorders' records under ``folder``."""
        return [r.save(folder) for r in self.recorders if r is not None]

    def stop(self, error: Exception) -> None:
        """Note that the pipeline stopped on ``error``: no list runs any more."""
        self.failed = f"{type(error).__name__}: {error}"
