"""An asynchronous pipeline between train_step calls: the calls since the last flush, the
micro-batches fed so far, each call's action list, and the mini-batch's loss on its way from
the last stage to every rank. A synchronous pipeline keeps none of it in flight (its counters
stay 0)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from pipetrain.errors import PeerError
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.runner import Runner
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.world import SentLoss, World
from schedules import Schedule, drain, for_call


class InFlight:
    """What an asynchronous ``schedule`` keeps across the calls of this process's ``stages``."""

    def __init__(self, schedule: Schedule, chunks: int, world: World, stages: Sequence[Stage]):
        self.schedule, self.chunks, self.world = schedule, chunks, world
        self.stages = list(stages)
        self.last = stages[-1]  # the last stage here: it reports the loss if it is the last
        self.calls = 0  # train_steps since the last flush
        self.fed = 0  # micro-batches fed so far (their global numbers)
        self._lists: dict[int, Schedule] = {}
        self._loss: SentLoss | None = None  # on its way

    @property
    def active(self) -> bool:
        """Whether micro-batches are still in the pipeline."""
        return self.schedule.asynchronous and self.calls > 0

    def call_list(self) -> Schedule:
        """The list of the next call since the last flush (cached: from the call at which
        every stage's warm-up is over, the lists are all the same)."""
        call = min(self.calls, -(-self.schedule.stages // self.chunks))
        if call not in self._lists:
            self._lists[call] = for_call(self.schedule, call)
        return self._lists[call]

    def train(
        self, runner: Runner, x: object, y: object, step: int
    ) -> tuple[torch.Tensor, dict[str, Any], float, list[Executor]]:
        """Train step ``step``: this call's list, then the mini-batch's loss once here
        (averaged over replicas; on the device, unread). Returns the loss, the step's metrics,
        its time (not counting the wait for the loss) and the executors that ran."""
        start = time.perf_counter()
        self._loss = None
        for stage in self.stages:
            stage.losses.clear()
        executors = runner.run(self.call_list(), x, y, True, self.fed, self.report_loss)
        self.calls += 1
        self.fed += self.chunks
        if self._loss is None:  # ranks without the last stage
            self.report_loss()
        step_time = time.perf_counter() - start
        sent, self._loss = self._loss, None
        assert sent is not None, "report_loss ran"
        try:
            return self.world.received_loss(sent), {"grad_norm": None}, step_time, executors
        except PeerError as failure:
            runner.stop(failure)
            late = f"the loss of step {step} did not arrive: {failure}"
            raise type(failure)(late) from failure

    def report_loss(self) -> None:
        """Start handing the last stage's mean loss of the mini-batch to every rank. The last
        stage's executor calls it the moment its last forward ends (``losses_done``), the
        other ranks after their list: the first stage need not wait for the last stage's
        backwards before it feeds the next mini-batch."""
        if self.last.is_last:
            loss = torch.stack(list(self.last.losses.values())).mean(dtype=torch.float64)
        else:
            loss = torch.zeros((), dtype=torch.float64, device=self.last.device)
        self._loss = self.world.share_loss(loss)

    def drain(self) -> Schedule:
        """The list that runs every in-flight micro-batch's backward."""
        return drain(self.schedule, self.calls)

    def flushed(self) -> None:
        """Nothing is in flight now: the next call warms up again."""
        self.calls = 0
