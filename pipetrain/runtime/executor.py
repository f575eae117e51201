"""The interpreter: walks one rank's action list for one mini-batch.

A rank holds one Stage per stage the schedule places on it and hands each action to the Stage it
names. A hand-off between two stages of the same rank is no message: the executor passes the
tensors over in memory exactly as a receive would deliver them (detached, the same gradient
flags), without copying them.

Each action kind is one small method, found through the table ``HANDLERS`` (checked complete
against ``Kind`` at import); a compute method returns the sends its result feeds, and the loop
posts them. Overlap lives here and only here: a send is posted the moment the compute
that produced its tensor ends (never later than the schedule lists it, so it
cannot add a wait), and receives are posted a few actions ahead of where they are waited on, as
soon as their shapes are known. Where the runtime lists an early W (schedules/early.py: the
last backward of a stage sends its input gradients before its W computes the weight gradients),
that B's forward is cut so that it can. Every wait has a timeout and, on failure, names the
peer, the micro-batch and this stage's position in its schedule.

The step is actions too: REDUCE, AGREE and STEP (schedules/action.py) go to the step handler
(pipetrain/runtime/handler.py) the call brings, which also says how messages live across calls:
pipetrain/runtime/update.py's ``Update`` for synchronous lists (messages within a call, the
step agreed by every rank), pipetrain/runtime/inflight.py's ``InFlight`` for asynchronous ones
(messages numbered by global micro-batch and carried from call to call, each STEP an update).
The executor itself never asks which kind of schedule it runs.

Shapes travel in a header before a boundary's first micro-batch of each call, since they may
change between mini-batches. So that the first payload's receive need not wait for the header
(gloo ships a send only once its receive is posted, and a send posted before that leaves when
the sender's transport thread next gets a core: milliseconds, on the pipeline's critical path),
the receiver posts it at once with the previous call's shapes. The sender knows those shapes
too: when they changed, it first sends a stand-in of the old shapes to fill that receive.

A gradient may be absent: a stage whose input got no gradient (a detached path) sends none,
so that the stages before it leave ``.grad`` None and an optimizer skips their weights, as
in plain training. The receiver has posted its receive already, so the message keeps its
tensors (zeros stand in), and where messages stay within a call (the step handler's
``announces_presence``) the gradients of the sending stage's first backward come with a second
header saying which are there, which the receiver waits for at its first gradient receive;
every micro-batch of the call must have the same ones. Across calls (asynchronous schedules)
every gradient is sent (zeros where none flows).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn

import torch

from pipetrain.errors import CommunicationTimeout, PeerError, PipelineError, StageError
from pipetrain.observe.progress import logger
from pipetrain.observe.trace import Recorder
from pipetrain.runtime.handler import Call
from pipetrain.runtime.meta import (
    HEADER_LEN,
    BoundaryMeta,
    TensorMeta,
    decode,
    describe,
    empty_like_meta,
    encode,
    flatten,
    unflatten,
)
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.tags import ACTIVATION, GRADIENT, HEADER, TagLayout
from pipetrain.runtime.transport import Handle, Transport
from pipetrain.runtime.update import Update
from schedules import Action, Kind, Schedule
from schedules.action import COMPUTE, RECVS
from schedules.listing import excerpt

Outgoing = tuple[Action, list[torch.Tensor], bool]  # a send to post: action, tensors, header?
HEADER_META = (TensorMeta((HEADER_LEN,), torch.int64, False),)
RECV_LOOKAHEAD = 2  # receives posted ahead of the one being waited on


def _peer(action: Action) -> int:
    peer = action.peer
    assert peer is not None, f"{action} is not a communication action"
    return peer


def tag(action: Action, layout: TagLayout, header: bool = False) -> int:
    """The first message tag of a communication action (pipetrain/runtime/tags.py): its micro-batch,
    lane and boundary."""
    gradient = action.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
    lane = HEADER if header else GRADIENT if gradient else ACTIVATION
    return layout.tag(action.microbatch, lane, min(action.stage, _peer(action)))


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
        self._cycle = self.handler.cycle(schedule)  # message numbers: see _tag
        self.tags = TagLayout(schedule.stages, self._cycle)
        self._recv_positions = [i for i, a in enumerate(self.actions) if a.kind in RECVS]
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
        # the header of which gradients are there: sent with each stage's first backward,
        # waited for at each stage's first gradient receive (see the module docstring)
        self._first_backward: dict[int, int] = {}
        for ops in schedule.actions.values():
            for a in ops:
                if a.kind is Kind.BACKWARD:
                    self._first_backward.setdefault(a.stage, a.microbatch)
        self._first_recv_grad: dict[int, Action] = {}
        for a in self.actions:
            if a.kind is Kind.RECV_GRAD:
                self._first_recv_grad.setdefault(a.stage, a)

    def run(self, inputs: Sequence[object] | None, targets: Sequence[object] | None) -> list[Any]:
        """Execute the whole list. Returns the outputs of every micro-batch on the last stage
        when not training, else an empty list; losses stay in ``stage.losses``."""
        self._inputs, self._targets = inputs, targets
        self._in_meta: dict[int, BoundaryMeta] = {}  # per stage: what comes from the previous
        self._out_meta: dict[int, BoundaryMeta] = {}  # per stage: what leaves for the next
        self._received: dict[Action, list[torch.Tensor]] = {}
        self._posted: dict[Action, Handle] = {}
        self._guessed: dict[Action, Handle] = {}  # first payloads posted with last call's shapes
        # per stage, which of its outputs' gradients come back this call (see the docstring),
        # as the next stage announced it; and per stage, which input gradients it sends
        self._present: dict[int, tuple[bool, ...]] = {}
        self._presence_posted: dict[Action, Handle] = {}
        self._sent_present: dict[int, tuple[bool, ...]] = {}
        self._sends: list[tuple[Action, Handle]] = []
        self._next_recv = 0
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
                self._prefetch()
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
            feeds = any(a.kind is Kind.FORWARD for a in self.actions)
            self._sends = self.handler.settle(self.carry, self._sends, feeds)
            self._finish_sends()
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

    # -- receives ---------------------------------------------------------------------------

    def _metas(self, action: Action) -> tuple[TensorMeta, ...] | None:
        """Shapes of what ``action`` receives, or None while they are still unknown."""
        if action.kind is Kind.RECV_GRAD:  # its forward's shapes (in this call, or earlier)
            known = self.carry.in_flight.get((action.stage, self.base + action.microbatch))
            return None if known is None else known.grad_metas
        meta = self._in_meta.get(action.stage)
        if action.microbatch == 0 or meta is None:
            return HEADER_META if action.microbatch == 0 else None
        return meta.tensors

    def _prefetch(self) -> None:
        """Post upcoming receives in list order (keeping each link's order) while shapes are
        known and fewer than RECV_LOOKAHEAD are outstanding."""
        while self._next_recv < len(self._recv_positions) and len(self._posted) < RECV_LOOKAHEAD:
            action = self.actions[self._recv_positions[self._next_recv]]
            metas = self._metas(action)
            if metas is None:
                return
            header = metas is HEADER_META
            peer, number = self.schedule.rank_of(_peer(action)), self._tag(action, header)
            last = self.carry.shapes_in.get(action.stage) if header else None
            try:
                self._posted[action] = self.transport.recv(metas, peer, number)
                if self._announces(action, len(metas)):
                    first = Action(action.kind, action.stage, self._first_backward[_peer(action)])
                    self._presence_posted[action] = self.transport.recv(
                        (TensorMeta((len(metas),), torch.int64, False),), peer,
                        self._tag(first, header=True),
                    )
                if last is not None:
                    self._guessed[action] = self.transport.recv(
                        last.tensors, peer, self._tag(action)
                    )
            except PeerError as error:
                self._peer_failed(action, error, "receiving from")
            self._next_recv += 1

    def _announces(self, action: Action, count: int) -> bool:
        """Whether ``action`` (a send or receive of ``count`` gradients) sends or waits for
        the header saying which are there (see the module docstring): on a synchronous
        list whose messages stay within its call (the step handler's ``announces_presence``),
        between ranks, the sender's first backward and the receiver's first gradient
        receive."""
        if action.kind is Kind.SEND_GRAD:
            first = action.microbatch == self._first_backward.get(action.stage)
        else:
            first = action == self._first_recv_grad.get(action.stage)
        return (
            first and count > 0 and self.handler.announces_presence
            and not self.schedule.local(action.stage, _peer(action))
        )

    def _tag(self, action: Action, header: bool = False) -> int:
        """Tagged by global micro-batch number (``base + i``), in the step handler's cycle:
        an asynchronous list's message may cross calls (a synchronous list's base is 0)."""
        number = (self.base + action.microbatch) % self._cycle
        return tag(Action(action.kind, action.stage, number), self.tags, header)

    def _wait(self, action: Action, handle: Handle) -> list[torch.Tensor]:
        try:
            return handle.wait(self.timeout)
        except PeerError as error:
            self._peer_failed(action, error, "waiting for")

    def _peer_failed(self, action: Action, error: PeerError, doing: str) -> NoReturn:
        """Re-raise a transport's PeerError naming this stage, the peer and the micro-batch."""
        where = (
            f"{self._where()} at action {self._position + 1} of "
            f"{len(self.actions)} ({action}) {doing} stage {action.peer} "
            f"on micro-batch {action.microbatch}"
        )
        if isinstance(error, CommunicationTimeout):
            raise CommunicationTimeout(
                f"{where}: nothing arrived within timeout={self.timeout:g} s. The peer is "
                "slow, hung or its schedule differs; raise Pipeline(timeout=...) if it is "
                f"only slow. ({error})"
            ) from error
        raise PeerError(f"{where}: {error}") from error

    def _receive(self, action: Action) -> list[torch.Tensor]:
        self._prefetch()  # every earlier receive is done, so this one is next in line
        handle = self._posted.pop(action, None)
        if handle is None:
            raise PipelineError(
                f"{self._where()}: {action} comes before the forward that fixes its "
                "shapes; the schedule is out of order"
            )
        tensors = self._wait(action, handle)
        if action.kind is Kind.RECV_ACT and action.microbatch == 0:
            meta = self._in_meta[action.stage] = decode(tensors[0])
            last = self.carry.shapes_in.get(action.stage)
            self.carry.shapes_in[action.stage] = meta
            guessed = self._guessed.pop(action, None)
            if guessed is not None:
                tensors = self._wait(action, guessed)  # the payload, or the stand-in
                if meta == last:
                    return tensors
            peer = self.schedule.rank_of(_peer(action))
            tensors = self._wait(action, self.transport.recv(meta.tensors, peer, self._tag(action)))
        return tensors

    def _do_recv_act(self, action: Action) -> None:
        self._accept(action, self._receive(action))

    def _accept(self, action: Action, tensors: list[torch.Tensor]) -> None:
        """Keep a stage's arrived activations (from a message or a stage of this rank)."""
        for t, m in zip(tensors, self._in_meta[action.stage].tensors, strict=True):
            t.requires_grad_(m.requires_grad and self.training)
        self._received[action] = tensors

    def _do_recv_grad(self, action: Action) -> None:
        self._received[action] = self._receive(action)
        presence = self._presence_posted.pop(action, None)
        if presence is not None:
            mask = self._wait(action, presence)[0]
            self._present[action.stage] = tuple(bool(v) for v in mask.tolist())

    # -- compute ----------------------------------------------------------------------------

    def _do_forward(self, action: Action) -> list[Outgoing]:
        i, stage = action.microbatch, self.stages[action.stage]
        if stage.is_first:
            if self._inputs is None:
                raise ValueError("the first stage needs the input: pass x to train_step/eval_step")
            value = self._inputs[i]
            inputs: tuple[torch.Tensor, ...] = ()
        else:
            inputs = tuple(self._received.pop(Action(Kind.RECV_ACT, action.stage, i)))
            value = unflatten(inputs, self._in_meta[action.stage].is_tuple)
        target = None
        if stage.is_last and self.training:
            if self._targets is None:
                raise ValueError("the last stage needs the target: pass y to train_step")
            target = self._targets[i]
        key = self.base + i
        cut = self.training and self._early.get(action.stage) == i
        output = stage.forward(key, inputs, value, target, self.training, cut)
        if stage.is_last:
            if not self.training:
                self._outputs.append(output)
            return []
        tensors, is_tuple = flatten(output, f"stage {stage.index} (micro-batch {i})")
        meta = describe(tensors, is_tuple)
        send = Action(Kind.SEND_ACT, action.stage, i)
        outgoing: list[Outgoing] = []
        known = self._out_meta.get(action.stage)
        if known is None:
            self._out_meta[action.stage] = meta
            last = self.carry.shapes_out.get(action.stage)
            if last != meta or action.stage not in self.carry.headers:
                self.carry.headers[action.stage] = encode(meta)
            outgoing.append((send, [self.carry.headers[action.stage]], True))
            self.carry.shapes_out[action.stage] = meta
            if last not in (None, meta) and not self.schedule.local(action.stage, _peer(send)):
                outgoing.append((send, empty_like_meta(last.tensors, self.transport.device), False))
        elif meta != known:
            raise StageError(
                f"stage {stage.index}: micro-batch {i} produced {meta} but micro-batch 0 "
                f"produced {known}; all micro-batches of a mini-batch must have the "
                "same shapes and dtypes at a stage boundary (shapes may change between "
                "mini-batches)"
            )
        if self.training:  # for the receive of its gradient
            self.carry.in_flight[action.stage, key] = meta
        outgoing.append((send, [t.detach() for t in tensors], False))
        return outgoing

    def _do_backward(self, action: Action) -> list[Outgoing]:
        i, stage = action.microbatch, self.stages[action.stage]
        grads: list[torch.Tensor | None] = []
        if not stage.is_last:
            grads = list(self._received.pop(Action(Kind.RECV_GRAD, action.stage, i)))
            if grads and self.handler.announces_presence:
                present = self._present.get(action.stage)
                if present is None:
                    raise PipelineError(
                        f"{self._where()}: micro-batch {i}'s gradients arrived before the "
                        "header saying which are there; the schedule is out of order"
                    )
                grads = [g if there else None for g, there in zip(grads, present, strict=True)]
        input_grads = stage.backward(self.base + i, grads, self.loss_scale)
        self.carry.in_flight.pop((action.stage, self.base + i), None)
        if stage.is_first:
            return []
        return self._gradients_out(Action(Kind.SEND_GRAD, action.stage, i), input_grads)

    def _gradients_out(
        self, send: Action, grads: list[torch.Tensor | None]
    ) -> list[Outgoing]:
        """The messages of ``send``: its gradients (zeros standing in for absent ones) and,
        where it announces them, which are there (see the module docstring). A stage of this
        rank learns that directly."""
        present = tuple(g is not None for g in grads)
        tensors = [g for g in grads if g is not None]
        if not all(present):  # (never across calls: versioned stages send zeros)
            metas = self._in_meta[send.stage].grad_metas
            device = self.transport.device
            tensors = [
                g if g is not None else torch.zeros(m.shape, dtype=m.dtype, device=device)
                for g, m in zip(grads, metas, strict=True)
            ]
        if not self.handler.announces_presence:
            return [(send, tensors, False)]
        first = self._sent_present.setdefault(send.stage, present)
        if present != first:
            raise StageError(
                f"stage {send.stage}: micro-batch {send.microbatch} has gradients for its "
                f"inputs {[k for k, p in enumerate(present) if p]} but an earlier micro-batch "
                f"for {[k for k, p in enumerate(first) if p]}; every micro-batch of a "
                "mini-batch must backpropagate to the same stage inputs (a detach or "
                "branch that depends on the data cannot cross a stage boundary)"
            )
        if self.schedule.local(send.stage, _peer(send)):
            self._present[_peer(send)] = present
            return [(send, tensors, False)]
        if not self._announces(send, len(grads)):
            return [(send, tensors, False)]
        mask = self.carry.presence.get(present)
        if mask is None:
            mask = torch.tensor(present, dtype=torch.int64, device=self.transport.device)
            self.carry.presence[present] = mask
        return [(send, [mask], True), (send, tensors, False)]

    def _do_weight(self, action: Action) -> None:
        """W: a split backward's weight gradients; an early W whose forward could not be cut
        (its layers hold weights inside them) found them in its B already."""
        stage, key = self.stages[action.stage], self.base + action.microbatch
        if stage.weights_pending(key):
            stage.backward_weights(key)

    def _do_reduce(self, action: Action) -> None:
        """REDUCE: this list's sends done, the stage's gradients summed across its replicas
        and tie groups (the step handler's)."""
        self._finish_sends()
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

    # -- sends ------------------------------------------------------------------------------

    def _post(self, action: Action, tensors: list[torch.Tensor], header: bool = False) -> None:
        peer = _peer(action)
        if self.schedule.local(action.stage, peer):  # the next stage is here: no message
            if action.kind is Kind.SEND_GRAD:
                self._received[action.matching()] = tensors
            elif header:
                self._in_meta[peer] = self._out_meta[action.stage]
            else:
                self._accept(action.matching(), tensors)
            return
        rank = self.schedule.rank_of(peer)
        try:
            handle = self.transport.send(tensors, rank, self._tag(action, header))
        except PeerError as error:
            self._peer_failed(action, error, "sending to")
        self._sends.append((action, handle))

    def _do_send(self, action: Action) -> None:
        """Already posted when the compute that made its tensors ended (see the module
        docstring)."""

    def _finish_sends(self) -> None:
        for action, handle in self._sends:
            self._wait(action, handle)
        self._sends.clear()


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
