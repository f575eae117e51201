"""The interpreter: walks one stage's action list for one mini-batch.

Each action kind is one small method; a compute method returns the sends its result feeds, and
the loop posts them. Overlap lives here and only here: a send is posted the moment the compute
that produced its tensor ends (never later than the schedule lists it, so it
cannot add a wait), and receives are posted a few actions ahead of where they are waited on, as
soon as their shapes are known. Every wait has a timeout and, on failure, names the peer, the
micro-batch and this stage's position in its schedule.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pipetrain.errors import CommunicationTimeout, PeerError, PipelineError, StageError
from pipetrain.meta import (
    HEADER_LEN,
    BoundaryMeta,
    TensorMeta,
    decode,
    describe,
    encode,
    flatten,
    unflatten,
)
from pipetrain.stage import Stage
from pipetrain.trace import Recorder
from pipetrain.transport import Handle, Transport
from schedules import Action, Kind
from schedules.action import COMPUTE, RECVS

Outgoing = tuple[Action, list[torch.Tensor], bool]  # a send to post: action, tensors, header?
HEADER_META = (TensorMeta((HEADER_LEN,), torch.int64, False),)
RECV_LOOKAHEAD = 2  # receives posted ahead of the one being waited on


def _peer(action: Action) -> int:
    peer = action.peer
    assert peer is not None, f"{action} is not a communication action"
    return peer


def tag(action: Action, header: bool = False) -> int:
    """Message tag of a communication action; tuple members take consecutive tags."""
    lane = 2 if header else int(action.kind in (Kind.SEND_GRAD, Kind.RECV_GRAD))
    return (action.microbatch * 3 + lane) * 64


class Executor:
    """Runs ``actions`` (one stage's list from a validated schedule) over ``transport``."""

    def __init__(
        self,
        stage: Stage,
        transport: Transport,
        actions: Sequence[Action],
        timeout: float,
        training: bool = True,
        recorder: Recorder | None = None,
    ):
        self.stage, self.transport, self.actions = stage, transport, list(actions)
        self.timeout, self.training, self.recorder = timeout, training, recorder
        self.compute_time = 0.0  # seconds of forward and backward work in the last run
        self.chunks = 1 + max((a.microbatch for a in self.actions), default=0)
        self._recv_positions = [i for i, a in enumerate(self.actions) if a.kind in RECVS]
        backwards = [i for i, a in enumerate(self.actions) if a.kind is Kind.BACKWARD]
        self._last_backward = backwards[-1] if backwards else -1

    def run(self, inputs: Sequence[object] | None, targets: Sequence[object] | None) -> list:
        """Execute the whole list. Returns the outputs of every micro-batch on the last stage
        when not training, else an empty list; losses stay in ``stage.losses``."""
        self._inputs, self._targets = inputs, targets
        self._in_meta: BoundaryMeta | None = None  # what arrives from the previous stage
        self._out_meta: BoundaryMeta | None = None  # what leaves for the next stage
        self._received: dict[Action, list[torch.Tensor]] = {}
        self._posted: dict[Action, Handle] = {}
        self._sends: list[tuple[Action, Handle]] = []
        self._next_recv = 0
        self._outputs: list[object] = []
        self._position = 0
        self.compute_time = 0.0
        if self.recorder:
            self.recorder.begin_step()
        try:
            for position, action in enumerate(self.actions):
                self._position = position
                self._prefetch()
                if position == self._last_backward:
                    for sync in self.stage.syncs:  # reduce gradients as this backward makes them
                        sync.arm()
                start = time.perf_counter()
                outgoing = getattr(self, "_do_" + action.kind.name.lower())(action)
                end = time.perf_counter()
                if action.kind in COMPUTE:
                    self.compute_time += end - start
                if self.recorder:
                    self.recorder.record(action, start, end)
                for send in outgoing or ():  # after the span ends: a peer may start at once
                    self._post(*send)
            self._finish_sends()
        except PeerError as error:
            self.transport.abort(f"stage {self.stage.index} stopped: {error}")
            raise
        except Exception as error:
            reason = str(error) if isinstance(error, StageError) else repr(error)
            self.transport.abort(f"stage {self.stage.index} failed: {reason}")
            raise
        return self._outputs

    # -- receives ---------------------------------------------------------------------------

    def _metas(self, action: Action) -> tuple[TensorMeta, ...] | None:
        """Shapes of what ``action`` receives, or None while they are still unknown."""
        if action.kind is Kind.RECV_GRAD:
            return None if self._out_meta is None else self._out_meta.grad_metas
        if action.microbatch == 0 or self._in_meta is None:
            return HEADER_META if action.microbatch == 0 else None
        return self._in_meta.tensors

    def _prefetch(self) -> None:
        """Post upcoming receives in list order (keeping each link's order) while shapes are
        known and fewer than RECV_LOOKAHEAD are outstanding."""
        while self._next_recv < len(self._recv_positions) and len(self._posted) < RECV_LOOKAHEAD:
            action = self.actions[self._recv_positions[self._next_recv]]
            metas = self._metas(action)
            if metas is None:
                return
            header = metas is HEADER_META
            self._posted[action] = self.transport.recv(metas, _peer(action), tag(action, header))
            self._next_recv += 1

    def _wait(self, action: Action, handle: Handle) -> list[torch.Tensor]:
        try:
            return handle.wait(self.timeout)
        except PeerError as error:
            where = (
                f"stage {self.stage.index} at action {self._position + 1} of "
                f"{len(self.actions)} ({action}) waiting for stage {action.peer} "
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
                f"stage {self.stage.index}: {action} comes before the forward that fixes its "
                "shapes; the schedule is out of order"
            )
        tensors = self._wait(action, handle)
        if action.kind is Kind.RECV_ACT and action.microbatch == 0:
            self._in_meta = decode(tensors[0])
            data = self.transport.recv(self._in_meta.tensors, _peer(action), tag(action))
            tensors = self._wait(action, data)
        return tensors

    def _do_recv_act(self, action: Action) -> None:
        tensors = self._receive(action)
        meta = self._in_meta
        assert meta is not None
        for t, m in zip(tensors, meta.tensors, strict=True):
            t.requires_grad_(m.requires_grad and self.training)
        self._received[action] = tensors

    def _do_recv_grad(self, action: Action) -> None:
        self._received[action] = self._receive(action)

    # -- compute ----------------------------------------------------------------------------

    def _do_forward(self, action: Action) -> list[Outgoing]:
        i = action.microbatch
        if self.stage.is_first:
            if self._inputs is None:
                raise ValueError("the first stage needs the input: pass x to train_step/eval_step")
            value = self._inputs[i]
            inputs: tuple[torch.Tensor, ...] = ()
        else:
            assert self._in_meta is not None
            inputs = tuple(self._received.pop(Action(Kind.RECV_ACT, action.stage, i)))
            value = unflatten(inputs, self._in_meta.is_tuple)
        target = None
        if self.stage.is_last and self.training:
            if self._targets is None:
                raise ValueError("the last stage needs the target: pass y to train_step")
            target = self._targets[i]
        output = self.stage.forward(i, inputs, value, target, self.chunks, self.training)
        if self.stage.is_last:
            if not self.training:
                self._outputs.append(output)
            return []
        tensors, is_tuple = flatten(output, f"stage {self.stage.index} (micro-batch {i})")
        meta = describe(tensors, is_tuple)
        send = Action(Kind.SEND_ACT, action.stage, i)
        outgoing: list[Outgoing] = []
        if self._out_meta is None:
            self._out_meta = meta
            outgoing.append((send, [encode(meta)], True))
        elif meta != self._out_meta:
            raise StageError(
                f"stage {self.stage.index}: micro-batch {i} produced {meta} but micro-batch 0 "
                f"produced {self._out_meta}; all micro-batches of a mini-batch must have the "
                "same shapes and dtypes at a stage boundary (shapes may change between "
                "mini-batches)"
            )
        outgoing.append((send, [t.detach() for t in tensors], False))
        return outgoing

    def _do_backward(self, action: Action) -> list[Outgoing]:
        i = action.microbatch
        grads: list[torch.Tensor] = []
        if not self.stage.is_last:
            grads = self._received.pop(Action(Kind.RECV_GRAD, action.stage, i))
        input_grads = self.stage.backward(i, grads)
        if self.stage.is_first:
            return []
        return [(Action(Kind.SEND_GRAD, action.stage, i), input_grads, False)]

    def _do_step(self, action: Action) -> None:
        self._finish_sends()
        for sync in self.stage.syncs:
            sync.finish()
        self.stage.step()

    # -- sends ------------------------------------------------------------------------------

    def _post(self, action: Action, tensors: list[torch.Tensor], header: bool = False) -> None:
        handle = self.transport.send(tensors, _peer(action), tag(action, header))
        self._sends.append((action, handle))

    def _do_send_act(self, action: Action) -> None:
        """Already posted when the forward ended (see the module docstring)."""

    _do_send_grad = _do_send_act

    def _finish_sends(self) -> None:
        for action, handle in self._sends:
            self._wait(action, handle)
        self._sends.clear()
