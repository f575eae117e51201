"""The boundary message protocol: what a rank's stages send each other across a stage boundary
in one call of its list, and how the executor (executor.py) posts and waits for it.

A message is tagged by its micro-batch (global: ``base + i``, in the step handler's cycle),
lane (activation, gradient, header) and boundary (pipetrain/runtime/tags.py). A hand-off
between two stages of the same rank is no message: the tensors pass in memory exactly as a
receive would deliver them (detached, the same gradient flags), without copying them.

Shapes travel in a header before a boundary's first micro-batch of each call, since they may
change between mini-batches. So that the first payload's receive need not wait for the header
(gloo ships a send only once its receive is posted, and a send posted before that leaves when
the sender's transport thread next gets a core: milliseconds, on the pipeline's critical path),
the receiver posts it at once with the previous call's shapes. The sender knows those shapes
too: when they changed, it first sends a stand-in of the old shapes to fill that receive.
Receives are posted in list order (each link keeps its order), RECV_LOOKAHEAD ahead of the
one waited on, as soon as their shapes are known.

A gradient may be absent: a stage whose input got no gradient (a detached path) sends none,
so that the stages before it leave ``.grad`` None and an optimizer skips their weights, as
in plain training. The receiver has posted its receive already, so the message keeps its
tensors (zeros stand in), and where messages stay within a call (the step handler's
``announces_presence``) the gradients of the sending stage's first backward come with a second
header saying which are there, which the receiver waits for at its first gradient receive;
every micro-batch of the call must have the same ones. Across calls (asynchronous schedules)
every gradient is sent (zeros where none flows).

Every wait has a timeout and, on failure, names the peer, the micro-batch and this stage's
place in its list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch

from pipetrain.errors import CommunicationTimeout, PeerError, PipelineError, StageError
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
from pipetrain.runtime.tags import ACTIVATION, GRADIENT, HEADER, TagLayout
from pipetrain.runtime.transport import Handle, Transport
from schedules import Action, Kind, Schedule
from schedules.action import RECVS

Outgoing = tuple[Action, list[torch.Tensor], bool]  # a send to post: action, tensors, header?
HEADER_META = (TensorMeta((HEADER_LEN,), torch.int64, False),)
RECV_LOOKAHEAD = 2  # receives posted ahead of the one being waited on


def peer_of(action: Action) -> int:
    peer = action.peer
    assert peer is not None, f"{action} is not a communication action"
    return peer


def tag(action: Action, layout: TagLayout, header: bool = False) -> int:
    """The first message tag of a communication action (pipetrain/runtime/tags.py): its
    micro-batch, lane and boundary."""
    gradient = action.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD)
    lane = HEADER if header else GRADIENT if gradient else ACTIVATION
    return layout.tag(action.microbatch, lane, min(action.stage, peer_of(action)))


class Boundaries:
    """One call's messages across the boundaries of ``rank``'s stages in ``schedule``, over
    ``transport``: receives posted ahead and kept until their compute takes them, sends
    posted and waited for. For errors, ``where()`` names the stage at work and
    ``position()`` the index of the action the list is at."""

    def __init__(
        self, schedule: Schedule, rank: int, transport: Transport, call: Call, timeout: float,
        where: Callable[[], str], position: Callable[[], int],
    ):
        self.schedule, self.rank, self.transport = schedule, rank, transport
        self.handler, self.carry = call.handler, call.carry
        self.base, self.training = call.base, call.training
        self.timeout, self.where, self.position = timeout, where, position
        self.actions = schedule.actions[rank]
        self._cycle = self.handler.cycle(schedule)  # message numbers: see _tag
        self.tags = TagLayout(schedule.stages, self._cycle)
        self._recv_positions = [i for i, a in enumerate(self.actions) if a.kind in RECVS]
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

    def prefetch(self) -> None:
        """Post upcoming receives in list order (keeping each link's order) while shapes are
        known and fewer than RECV_LOOKAHEAD are outstanding."""
        while self._next_recv < len(self._recv_positions) and len(self._posted) < RECV_LOOKAHEAD:
            action = self.actions[self._recv_positions[self._next_recv]]
            metas = self._metas(action)
            if metas is None:
                return
            header = metas is HEADER_META
            peer, number = self.schedule.rank_of(peer_of(action)), self._tag(action, header)
            last = self.carry.shapes_in.get(action.stage) if header else None
            try:
                self._posted[action] = self.transport.recv(metas, peer, number)
                if self._announces(action, len(metas)):
                    first = Action(action.kind, action.stage, self._first_backward[peer_of(action)])
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
            and not self.schedule.local(action.stage, peer_of(action))
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
        peer = peer_of(action)
        where = (
            f"{self.where()} at action {self.position() + 1} of "
            f"{len(self.actions)} ({action}) {doing} stage {peer} "
            f"({self.transport.rank_name(self.schedule.rank_of(peer))}) "
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
        self.prefetch()  # every earlier receive is done, so this one is next in line
        handle = self._posted.pop(action, None)
        if handle is None:
            raise PipelineError(
                f"{self.where()}: {action} comes before the forward that fixes its "
                "shapes; the schedule is out of order"
            )
        tensors = self._wait(action, handle)
        if action.kind is not Kind.RECV_ACT:
            return tensors
        if action.microbatch == 0:
            tensors = self._payload(action, decode(tensors[0]))
        metas = self._in_meta[action.stage].tensors
        return [m.from_wire(t) for t, m in zip(tensors, metas, strict=True)]

    def _payload(self, action: Action, meta: BoundaryMeta) -> list[torch.Tensor]:
        """The first micro-batch's activations after its header ``meta``: what arrived where
        the receive posted with the last call's shapes still fits, else a receive now."""
        self._in_meta[action.stage] = meta
        last = self.carry.shapes_in.get(action.stage)
        self.carry.shapes_in[action.stage] = meta
        guessed = self._guessed.pop(action, None)
        if guessed is not None:
            tensors = self._wait(action, guessed)  # the payload, or the stand-in
            if meta == last:
                return tensors
        peer = self.schedule.rank_of(peer_of(action))
        return self._wait(action, self.transport.recv(meta.tensors, peer, self._tag(action)))

    def receive_activations(self, action: Action) -> None:
        """RECV_ACT: wait for a micro-batch's activations (the header first, at micro-batch 0)."""
        self._accept(action, self._receive(action))

    def _accept(self, action: Action, tensors: list[torch.Tensor]) -> None:
        """Keep a stage's arrived activations (from a message or a stage of this rank)."""
        for t, m in zip(tensors, self._in_meta[action.stage].tensors, strict=True):
            t.requires_grad_(m.requires_grad and self.training)
        self._received[action] = tensors

    def receive_gradients(self, action: Action) -> None:
        """RECV_GRAD: wait for a micro-batch's output gradients (and, at the first, which
        are there)."""
        self._received[action] = self._receive(action)
        presence = self._presence_posted.pop(action, None)
        if presence is not None:
            mask = self._wait(action, presence)[0]
            self._present[action.stage] = tuple(bool(v) for v in mask.tolist())

    # -- what a compute takes and gives -----------------------------------------------------

    def activations_in(self, forward: Action) -> tuple[tuple[torch.Tensor, ...], Any]:
        """The received inputs of a forward: the tensors, and the value they make (one tensor
        or a tuple, as the previous stage returned it)."""
        inputs = tuple(self._received.pop(Action(Kind.RECV_ACT, forward.stage, forward.microbatch)))
        return inputs, unflatten(inputs, self._in_meta[forward.stage].is_tuple)

    def activations_out(self, forward: Action, output: Any) -> list[Outgoing]:
        """The messages of a forward's ``output`` to the next stage: at the call's first
        micro-batch its header (and a stand-in where the shapes changed), then the tensors."""
        i = forward.microbatch
        tensors, is_tuple = flatten(output, f"stage {forward.stage} (micro-batch {i})")
        meta = describe(tensors, is_tuple)
        send = Action(Kind.SEND_ACT, forward.stage, i)
        outgoing: list[Outgoing] = []
        known = self._out_meta.get(forward.stage)
        remote = not self.schedule.local(forward.stage, peer_of(send))
        if known is None:
            last = self.carry.shapes_out.get(forward.stage)
            if last != meta or forward.stage not in self.carry.headers:
                self.carry.headers[forward.stage] = encode(meta)
                self.carry.shapes_out[forward.stage] = meta
            else:  # the header as sent before: its memory order is the one to send in
                meta = last
            known = self._out_meta[forward.stage] = meta
            outgoing.append((send, [self.carry.headers[forward.stage]], True))
            if last not in (None, meta) and remote:
                outgoing.append((send, empty_like_meta(last.tensors, self.transport.device), False))
        elif meta != known:
            raise StageError(
                f"stage {forward.stage}: micro-batch {i} produced {meta} but micro-batch 0 "
                f"produced {known}; all micro-batches of a mini-batch must have the "
                "same shapes and dtypes at a stage boundary (shapes may change between "
                "mini-batches)"
            )
        if self.training:  # for the receive of its gradient
            self.carry.in_flight[forward.stage, self.base + i] = meta
        payload = [t.detach() for t in tensors]
        if remote:  # in memory order (the module docstring of meta.py); here: as it is
            payload = [m.to_wire(t) for t, m in zip(payload, known.tensors, strict=True)]
        outgoing.append((send, payload, False))
        return outgoing

    def gradients_in(self, backward: Action) -> list[torch.Tensor | None]:
        """The received output gradients of a backward, None where the next stage said none
        flows back."""
        i = backward.microbatch
        grads: list[torch.Tensor | None] = list(
            self._received.pop(Action(Kind.RECV_GRAD, backward.stage, i))
        )
        if grads and self.handler.announces_presence:
            present = self._present.get(backward.stage)
            if present is None:
                raise PipelineError(
                    f"{self.where()}: micro-batch {i}'s gradients arrived before the "
                    "header saying which are there; the schedule is out of order"
                )
            grads = [g if there else None for g, there in zip(grads, present, strict=True)]
        return grads

    def gradients_out(
        self, backward: Action, grads: list[torch.Tensor | None], first: bool
    ) -> list[Outgoing]:
        """The messages of a backward's input gradients ``grads`` (none from the ``first``
        stage): the gradients (zeros standing in for absent ones) and, where it announces
        them, which are there (see the module docstring). A stage of this rank learns that
        directly."""
        self.carry.in_flight.pop((backward.stage, self.base + backward.microbatch), None)
        if first:
            return []
        send = Action(Kind.SEND_GRAD, backward.stage, backward.microbatch)
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
        first_present = self._sent_present.setdefault(send.stage, present)
        if present != first_present:
            raise StageError(
                f"stage {send.stage}: micro-batch {send.microbatch} has gradients for its "
                f"inputs {[k for k, p in enumerate(present) if p]} but an earlier micro-batch "
                f"for {[k for k, p in enumerate(first_present) if p]}; every micro-batch of a "
                "mini-batch must backpropagate to the same stage inputs (a detach or "
                "branch that depends on the data cannot cross a stage boundary)"
            )
        if self.schedule.local(send.stage, peer_of(send)):
            self._present[peer_of(send)] = present
            return [(send, tensors, False)]
        if not self._announces(send, len(grads)):
            return [(send, tensors, False)]
        mask = self.carry.presence.get(present)
        if mask is None:
            mask = torch.tensor(present, dtype=torch.int64, device=self.transport.device)
            self.carry.presence[present] = mask
        return [(send, [mask], True), (send, tensors, False)]

    # -- sends ------------------------------------------------------------------------------

    def post(self, action: Action, tensors: list[torch.Tensor], header: bool = False) -> None:
        """Send ``tensors`` of ``action`` now; to a stage of this rank, hand them over."""
        peer = peer_of(action)
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

    def finish_sends(self) -> None:
        """Wait until every send posted so far has left."""
        for action, handle in self._sends:
            self._wait(action, handle)
        self._sends.clear()

    def settle(self, feeds: bool) -> None:
        """At the end of the list (``feeds``: it has forwards): wait for the sends the step
        handler does not carry to the next call."""
        self._sends = self.handler.settle(self.carry, self._sends, feeds)
        self.finish_sends()
