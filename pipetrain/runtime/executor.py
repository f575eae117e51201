"""The interpreter: walks one rank's action list for one mini-batch.

A rank holds one Stage per stage the schedule places on it and hands each action to the Stage it
names. Each action kind is one small method, found through the table ``HANDLERS`` (checked
complete against ``Kind`` at import); a compute method returns the sends its result feeds, and
the loop posts them. Overlap lives here and only here: a send is posted the moment the compute
that produced its tensor ends (never later than the schedule lists it, so it cannot add a
wait), and receives are posted a few actions ahead of where they are waited on, as soon as
their shapes are known. What a message holds, how it is tagged, and how shapes and absent
gradients are announced is the boundary protocol (pipetrain/runtime/boundary.py). Where the
runtime lists an early W (schedules/early.py: the last backward of a stage sends its input
gradients before its W computes the weight gradients), that B's forward is cut so that it can.
A failure names this stage's position in its schedule.

The step is actions too: REDUCE, AGREE and STEP (schedules/action.py) go to the step handler
(pipetrain/runtime/handler.py) the call brings, which also says how messages live across calls:
pipetrain/runtime/update.py's ``Update`` for synchronous lists (messages within a call, the
step agreed by every rank), pipetrain/runtime/inflight.py's ``InFlight`` for asynchronous ones
(messages numbered by global micro-batch and carried from call to call, each STEP an update).
The executor itself never asks which kind of schedule it runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from pipetrain.errors import CommunicationTimeout, PeerError, StageError
from pipetrain.observe.progress import logger
from pipetrain.observe.trace import Recorder
from pipetrain.runtime.boundary import Boundaries, Outgoing
from pipetrain.runtime.handler import Call
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.transport import Transport
from pipetrain.runtime.update import Update
from schedules import Action, Kind, Schedule
from schedules.action import COMPUTE
from schedules.listing import excerpt


class Executor:
    """Runs ``rank``'s list of a validated ``schedule`` on ``stages`` (the Stages the schedule
    places on that rank) over ``transport``, whose peers are ranks."""

    def __init__(
        self,
        stages: Sequence[Stage],
        transport: Transport,
        schedule: Schedule,
        rank: int,
        timeout: float,
        recorder: Recorder | None = None,
        losses_done: Callable[[], None] | None = None,
        call: Call | None = None,
    ):
        """``call`` (pipetrain/runtime/handler.py) holds the step handler, this rank's
        :class:`Carry` (what outlives a call), the global number of the list's micro-batch 0
        and whether it trains; without it, the list trains ``stages`` alone, as a pipeline of
        one rank would (an :class:`Update` of them). ``losses_done`` is called the moment the
        last stage's last forward of the list ends: every loss of the mini-batch is known
        then, before the backwards that follow."""
        self.stages = {stage.index: stage for stage in stages}
        self.call = call if call is not None else Call(Update(stages))
        self.handler, self.carry = self.call.handler, self.call.carry
        self.base, self.training = self.call.base, self.call.training
        self.schedule, self.rank = schedule, rank
        self.transport, self.actions = transport, list(schedule.actions[rank])
        self.timeout, self.recorder = timeout, recorder
        self.compute_time = 0.0  # seconds of forward, backward and weight work in the last run
        self.losses_done = losses_done
        holds_last = any(stage.is_last for stage in stages)  # whose backward starts from it
        self.loss_scale = self.handler.loss_scale() if self.training and holds_last else 1.0
        last_forwards = [
            i for i, a in enumerate(self.actions)
            if a.kind is Kind.FORWARD and self.stages[a.stage].is_last
        ]
        self._losses_at = last_forwards[-1] if last_forwards else -1
        # Each stage's gradient syncs arm before its last action that makes weight gradients
        # (its last B: an early W follows it, and each weight's gradient still arrives once).
        grads = Kind.WEIGHT if schedule.splits_backward else Kind.BACKWARD
        self._arm_at = {
            max(i for i, a in enumerate(self.actions) if a.kind is grads and a.stage == s): s
            for s in self.stages
            if any(a.kind is grads and a.stage == s for a in self.actions)
        }
        # the micro-batch whose forward is cut for its early W (schedules/early.py)
        self._early = schedule.early_weights

    def run(self, inputs: Sequence[object] | None, targets: Sequence[object] | None) -> list[Any]:
        """Execute the whole list. Returns the outputs of every micro-batch on the last stage
        when not training, else an empty list; losses stay in ``stage.losses``."""
        self._inputs, self._targets = inputs, targets
        self.links = Boundaries(  # this call's messages
            self.schedule, self.rank, self.transport, self.call, self.timeout, self._where,
            lambda: self._position,
        )
        self._outputs: list[object] = []
        self._position = 0
        self.compute_time = 0.0
        if self.recorder:
            self.recorder.begin_step()
        with self._weight_casts():
            self._run_actions()
        return self._outputs

    @contextmanager
    def _weight_casts(self) -> Iterator[None]:
        """Under autocast, cast each weight once per call rather than once per micro-batch:
        autocast keeps its casts until the outermost autocast region ends, and holding its
        nesting open across the call (without enabling autocast, so no backward runs under
        it) keeps them for every forward of the call. The casts are bit-identical to fresh
        ones and no forward of a held call follows a change of its weights (a synchronous list
        steps at its end, the casts cleared with the call; asynchronous stages, which step
        between forwards, read weight versions and hold nothing), so results are unchanged;
        one cast per weight is kept alive instead of one per micro-batch in flight. Not with
        CUDA graphs (captured without the cache) or weight versions (each micro-batch reads
        weights of its own)."""
        hold = any(s.autocast_dtype is not None for s in self.stages.values()) and all(
            s.graphs is None and s.versions is None for s in self.stages.values()
        )
        if not hold:
            yield
            return
        torch.autocast_increment_nesting()
        try:
            yield
        finally:
            torch.autocast_decrement_nesting()
            torch.clear_autocast_cache()  # even inside a caller's region: the update follows

    def _run_actions(self) -> None:
        """The loop of :meth:`run`: each action, its receives posted ahead, its sends after."""
        try:
            for position, action in enumerate(self.actions):
                self._position = position
                self.links.prefetch()
                if position in self._arm_at:  # reduce gradients as this action makes them
                    for sync in self.stages[self._arm_at[position]].syncs:
                        sync.arm()
                if action.kind in COMPUTE:
                    self._check_peers(action)
                start = time.perf_counter()
                outgoing = HANDLERS[action.kind](self, action)
                end = time.perf_counter()
                if action.kind in COMPUTE:
                    self.compute_time += end - start
                if self.recorder:
                    self.recorder.record(action, start, end)
                for send in outgoing or ():  # after the span ends: a peer may start at once
                    self._post(*send)
                if position == self._losses_at and self.losses_done:
                    self.losses_done()
            self.links.settle(any(a.kind is Kind.FORWARD for a in self.actions))
        except PeerError as error:
            if isinstance(error, CommunicationTimeout):  # where each rank waits tells a hang
                self._show_place(error)
            self.transport.abort(f"{self._where()} stopped: {error}")
            raise
        except Exception as error:
            self._show_place(error)
            reason = str(error) if isinstance(error, StageError) else repr(error)
            self.transport.abort(f"{self._where()} failed: {reason}")
            raise

    def _check_peers(self, action: Action) -> None:
        """Stop before ``action`` if another stage has stopped (see Transport.raise_if_stopped)."""
        try:
            self.transport.raise_if_stopped()
        except PeerError as error:
            raise PeerError(
                f"{self._where()} stopped before action {self._position + 1} of "
                f"{len(self.actions)} ({action}): {error}"
            ) from error

    def _show_place(self, error: Exception) -> None:
        """Note on ``error`` (shown with its traceback) and log this rank's actions around the
        one that failed, marked."""
        if not self.actions:
            return
        place = excerpt(self.schedule, self.rank, self._position)
        notes = getattr(error, "__notes__", None)
        if not isinstance(notes, list):
            notes = error.__notes__ = []
        notes.append(place)
        logger.error("%s failed:\n%s", self._where(), place)

    def _where(self) -> str:
        """The stage at work (and its rank when a rank holds several stages)."""
        stage = self.actions[self._position].stage if self.actions else self.rank
        rank = "" if self.schedule.one_stage_per_rank else f" (rank {self.rank})"
        return f"stage {stage}{rank}"

    # -- messages ---------------------------------------------------------------------------

    def _do_recv_act(self, action: Action) -> None:
        self.links.receive_activations(action)

    def _do_recv_grad(self, action: Action) -> None:
        self.links.receive_gradients(action)

    def _post(self, action: Action, tensors: list[torch.Tensor], header: bool = False) -> None:
        """Post one of a compute's sends (boundary.py)."""
        self.links.post(action, tensors, header)

    def _do_send(self, action: Action) -> None:
        """Already posted when the compute that made its tensors ended (see the module
        docstring)."""

    # -- compute ----------------------------------------------------------------------------

    def _do_forward(self, action: Action) -> list[Outgoing]:
        i, stage = action.microbatch, self.stages[action.stage]
        if stage.is_first:
            if self._inputs is None:
                raise ValueError("the first stage needs the input: pass x to train_step/eval_step")
            value = self._inputs[i]
            inputs: tuple[torch.Tensor, ...] = ()
        else:
            inputs, value = self.links.activations_in(action)
        target = None
        if stage.is_last and self.training:
            if self._targets is None:
                raise ValueError("the last stage needs the target: pass y to train_step")
            target = self._targets[i]
        cut = self.training and self._early.get(action.stage) == i
        output = stage.forward(self.base + i, inputs, value, target, self.training, cut)
        if not stage.is_last:
            return self.links.activations_out(action, output)
        if not self.training:
            self._outputs.append(output)
        return []

    def _do_backward(self, action: Action) -> list[Outgoing]:
        stage = self.stages[action.stage]
        grads = [] if stage.is_last else self.links.gradients_in(action)
        input_grads = stage.backward(self.base + action.microbatch, grads, self.loss_scale)
        return self.links.gradients_out(action, input_grads, stage.is_first)

    def _do_weight(self, action: Action) -> None:
        """W: a split backward's weight gradients; an early W whose forward could not be cut
        (its layers hold weights inside them) found them in its B already."""
        stage, key = self.stages[action.stage], self.base + action.microbatch
        if stage.weights_pending(key):
            stage.backward_weights(key)

    def _do_reduce(self, action: Action) -> None:
        """REDUCE: this list's sends done, the stage's gradients summed across its replicas
        and tie groups (the step handler's)."""
        self.links.finish_sends()
        self.handler.reduce(self.stages[action.stage])

    def _do_agree(self, action: Action) -> None:
        """AGREE: every rank's agreement on the step (the step handler's; it may wait for the
        other ranks of this process, while they run)."""
        self.handler.agree(
            list(self.stages), lambda: self._check_peers(action), self.timeout, self._where()
        )

    def _do_step(self, action: Action) -> None:
        """STEP: the stage's optimizer update (the step handler's), which touches weights
        only, never a sent tensor."""
        self.handler.update(self.stages[action.stage])


Handler = Callable[[Executor, Action], "list[Outgoing] | None"]
HANDLERS: dict[Kind, Handler] = {
    Kind.FORWARD: Executor._do_forward,
    Kind.BACKWARD: Executor._do_backward,
    Kind.WEIGHT: Executor._do_weight,
    Kind.REDUCE: Executor._do_reduce,
    Kind.AGREE: Executor._do_agree,
    Kind.STEP: Executor._do_step,
    Kind.RECV_ACT: Executor._do_recv_act,
    Kind.RECV_GRAD: Executor._do_recv_grad,
    Kind.SEND_ACT: Executor._do_send,
    Kind.SEND_GRAD: Executor._do_send,
}
"""The method that runs each kind of action."""
if set(HANDLERS) != set(Kind):  # a new Kind needs its handler here
    raise ImportError(f"{__name__} has no handler for {sorted(set(Kind) - set(HANDLERS))}")
