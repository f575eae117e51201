"""An asynchronous pipeline between train_step calls: the calls since the last flush, the
micro-batches fed so far, each call's action list, and the mini-batch's loss on its way from
the last stage to every rank. A synchronous pipeline keeps none of it in flight (its counters
stay 0).

:class:`InFlight` is also the step handler of the asynchronous lists (pipetrain/runtime/
handler.py): their micro-batches outlive a call, so messages are numbered by global micro-batch
(``cycle``), a call waits only for the previous call's sends and carries its own (``settle``),
every gradient is sent (zeros where none flows), and each STEP updates its stage at once: its
gradients averaged over its replicas first (data_parallel.VersionSync) and, with
``clip_grad_norm``, clipped by the stage's own norm (:meth:`InFlight.update` says why)."""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from pipetrain.errors import PeerError, PipelineError
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.handler import Carry, Pending
from pipetrain.runtime.runner import Runner
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.update import stepped_parameters
from pipetrain.runtime.world import SentLoss, World
from schedules import Schedule, drain, for_call


class InFlight:
    """What an asynchronous ``schedule`` keeps across the calls of this process's ``stages``,
    and the step handler of its lists (module docstring)."""

    announces_presence = False  # a gradient may arrive in a later call: zeros stand in

    def __init__(
        self, schedule: Schedule, chunks: int, world: World, stages: Sequence[Stage],
        max_norm: float | None = None,
    ):
        self.schedule, self.chunks, self.world = schedule, chunks, world
        self.max_norm = max_norm  # clip_grad_norm: per stage (update)
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
        executors = runner.run(self.call_list(), x, y, self, self.fed, self.report_loss)
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

    def cycle(self, schedule: Schedule) -> int:
        """Global micro-batch numbers modulo this: more than a message can be in flight."""
        return schedule.microbatches + schedule.stages

    def settle(self, carry: Carry, sends: list[Pending], feeds: bool) -> list[Pending]:
        """A send may be received in the peer's NEXT call (a backward of this call's last
        micro-batches), so a call waits only for the sends of the previous one, which the peer
        has received by now, and carries its own. A flush (no forwards) waits for everything:
        its peer receives all of it in the flush."""
        previous, carry.sends = carry.sends, []
        if feeds:
            carry.sends = sends
            return previous
        return previous + sends

    def loss_scale(self) -> float:
        return 1.0  # no fp16 loss scale under asynchronous schedules (refused at build)

    def reduce(self, stage: Stage) -> None:
        raise PipelineError(f"stage {stage.index}: an asynchronous list has no REDUCE")

    def agree(
        self, stages: Collection[int], check: Callable[[], None], timeout: float, where: str
    ) -> None:
        raise PipelineError(f"{where}: an asynchronous list has no AGREE")

    def update(self, stage: Stage) -> None:
        """STEP: the stage's update, at once (its micro-batches in flight read their own
        weight versions): the version's gradients averaged over the stage's replicas, then
        clipped to ``max_norm`` by their own norm, as ``torch.nn.utils.clip_grad_norm_`` on
        the stage's weights. Per stage, because the stages of one version do not update at
        the same moment: the last stage updates a mini-batch's version while the first has
        its backwards still to run, so a norm over the whole model would stall every stage
        until the first's backward is done, and bring back the flush the schedule removes."""
        for sync in stage.syncs:
            sync.finish()
        if self.max_norm is not None:
            torch.nn.utils.clip_grad_norm_(stepped_parameters(stage), self.max_norm)
        stage.step()

    def drain(self) -> Schedule:
        """The list that runs every in-flight micro-batch's backward."""
        return drain(self.schedule, self.calls)

    def flushed(self) -> None:
        """Nothing is in flight now: the next call warms up again."""
        self.calls = 0
