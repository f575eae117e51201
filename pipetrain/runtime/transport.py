"""Moving tensors between neighbouring stages: one interface, two implementations.

``DistributedTransport`` uses torch.distributed point-to-point operations (gloo on CPU, NCCL on
GPUs), one process per stage. ``LocalTransport`` connects stages that run as threads of one
process (torchgpipe-style, one device each). Both post operations without blocking and return a
handle; only ``Handle.wait`` blocks, always with a timeout. Both can abort: a failing stage
records why and breaks its links, so its peers stop at once instead of waiting out the timeout.

On CUDA devices neither blocks the host or a device: NCCL runs its point-to-point operations on
streams of its own, and ``LocalTransport`` copies between CUDA stages on a stream per link
(pipetrain's ``_CudaLink``), ordered by events: the copy waits for the sender's work up to the
send and nothing else, and the receiver's work waits for the copy, so a send never waits for
compute unrelated to its tensor (as a copy on the compute streams would, across devices).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from pipetrain.errors import CommunicationTimeout, PeerError
from pipetrain.runtime.distributed import bound_exit
from pipetrain.runtime.meta import TensorMeta, empty_like_meta
from pipetrain.runtime.tags import BREAK_TAG, tensor_tags


class Handle(ABC):
    """A posted send or receive."""

    @abstractmethod
    def wait(self, timeout: float) -> list[torch.Tensor]:
        """Block until done (a receive returns its tensors); raise PeerError on failure."""


class Transport(ABC):
    """Point-to-point links from one rank to the others of its pipeline (peers are pipeline
    ranks; with one stage per rank, the rank is the stage)."""

    device: torch.device

    @abstractmethod
    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> Handle:
        """Post the tensors to rank ``peer``; the caller keeps the handle until it is waited."""

    @abstractmethod
    def recv(self, metas: Sequence[TensorMeta], peer: int, tag: int) -> Handle:
        """Post a receive of tensors shaped as ``metas`` from rank ``peer``."""

    @abstractmethod
    def abort(self, reason: str) -> None:
        """Record why this stage stops (first reason wins) and break its links."""

    def rank_name(self, peer: int) -> str:
        """Rank ``peer`` as errors name it: "rank R" (under torchrun, its global rank)."""
        return f"rank {peer}"

    @abstractmethod
    def failure(self) -> str | None:
        """The reason recorded by whichever stage aborted first, if any."""

    @abstractmethod
    def raise_if_stopped(self) -> None:
        """Raise PeerError if another stage is known to have stopped (checked before each
        compute, so a stage that never waits stops too)."""


class _DistributedHandle(Handle):
    def __init__(
        self, works: list[Any], tensors: list[torch.Tensor], transport: DistributedTransport
    ):
        self._works = works
        self._tensors = tensors  # kept alive until the operation completes
        self._transport = transport

    def wait(self, timeout: float) -> list[torch.Tensor]:
        for work in self._works:
            try:
                work.wait(timeout=timedelta(seconds=timeout))
            except RuntimeError as error:  # gloo reports timeouts and lost peers this way
                self._transport.raise_failure(error)
        return self._tensors


STORE_WAIT = 1.0  # seconds a look-up in the rendezvous store may take (its host may be stuck)


def is_timeout(error: BaseException) -> bool:
    """Whether a backend error is a timed-out wait (gloo: "Timed out waiting ...",
    "Operation timed out!", "Application timeout caused pair closure")."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


class DistributedTransport(Transport):
    """torch.distributed isend/irecv within ``group``; pipeline rank r is global rank
    ``ranks[r]``.

    A stage that stops publishes why under a key of the rendezvous store, then closes its
    links to every peer in ``group`` and in every group of ``others`` (the other groups this
    process trains in; a receive that times out at once makes gloo close the links of its
    group), so a peer blocked on it fails at once even when this process lives on, and reads
    the reason there; and a collective of this process blocked on a stopped peer ends too,
    instead of holding the process's exit until the group's own timeout. Every look-up in the
    store is bounded by STORE_WAIT: the store's host may be the stuck rank."""

    def __init__(
        self, group: dist.ProcessGroup, ranks: Sequence[int], device: torch.device,
        others: Sequence[dist.ProcessGroup] = (),
    ):
        self.group = group
        self.ranks = list(ranks)
        self.device = device
        self._others = list(others)
        self._store = _default_store()
        self._store_stuck = False
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = getattr(group, "group_name", "pipeline")
        self._key = f"pipetrain/failure/{restart}/{name}"
        self._aborted = False
        self._reason: str | None = None
        self._acknowledged = False

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> Handle:
        dst = self.ranks[peer]
        ready = [t.contiguous() for t in tensors]
        try:
            works = [
                dist.isend(t, dst, group=self.group, tag=number)
                for number, t in zip(tensor_tags(tag, len(ready)), ready, strict=True)
            ]
        except RuntimeError as error:  # the link to a dead peer is already closed
            self.raise_failure(error)
        return _DistributedHandle(works, ready, self)

    def recv(self, metas: Sequence[TensorMeta], peer: int, tag: int) -> Handle:
        src = self.ranks[peer]
        buffers = empty_like_meta(metas, self.device)
        try:
            works = [
                dist.irecv(t, src, group=self.group, tag=number)
                for number, t in zip(tensor_tags(tag, len(buffers)), buffers, strict=True)
            ]
        except RuntimeError as error:
            self.raise_failure(error)
        return _DistributedHandle(works, buffers, self)

    def abort(self, reason: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        bound_exit()
        first = self._ask(lambda store: store.compare_set(self._key, "", reason)) == reason.encode()
        for group in (self.group, *self._others):
            _close_links(group)
        if first:  # the root cause: the others stop because of it
            self._await_acknowledgements()
        dist.destroy_process_group(self.group)

    def rank_name(self, peer: int) -> str:
        return f"rank {self.ranks[peer]}"

    def lost(self, group: dist.ProcessGroup) -> list[int]:
        """The peers of ``group`` (global ranks) this process has lost the connection to: a
        receive from a dead peer fails at once, from a live one it times out (which closes
        the group's links: call it only on the way to abort)."""
        failed = {peer: _probe(peer, group) for peer in _peers(group)}
        return [peer for peer, error in failed.items()
                if isinstance(error, RuntimeError) and not is_timeout(error)]

    def raise_if_stopped(self) -> None:
        """Checks nothing: asking the store would cost a round trip per action; a peer's
        failure shows at this rank's next wait instead."""

    def _await_acknowledgements(self) -> None:
        """Give the peers up to STORE_WAIT to read the reason: when this process ends, the
        store may end with it (rank 0 hosts it)."""
        deadline = time.monotonic() + STORE_WAIT
        while time.monotonic() < deadline:
            seen = self._ask(lambda store: store.add(self._key + "/seen", 0))
            if seen is None or seen >= len(self.ranks) - 1:
                return
            time.sleep(0.02)

    def failure(self) -> str | None:
        if self._reason is None:
            answer = self._ask(
                lambda store: store.get(self._key) if store.check([self._key]) else None
            )
            self._reason = answer.decode() if answer else None
        return self._reason

    def _ask(self, call: Callable[[dist.Store], Any]) -> Any:
        """``call(store)``'s answer, or None when it fails or outlasts STORE_WAIT (then the
        store counts as stuck and is not asked again)."""
        if self._store is None or self._store_stuck:
            return None
        store = self._store
        answer: dict[str, Any] = {}

        def ask() -> None:
            try:
                answer["value"] = call(store)
            except RuntimeError:  # the store is gone
                pass

        thread = threading.Thread(target=ask, name="pipetrain-store", daemon=True)
        thread.start()
        thread.join(STORE_WAIT)
        if thread.is_alive():
            self._store_stuck = True
        return answer.get("value")

    def stop_reason(self) -> str | None:
        """Why another stage stopped, as it published (acknowledged: see abort), if it did."""
        reason = self.failure()
        if reason is None:  # the failing peer records its reason just before it closes links
            time.sleep(0.05)
            reason = self.failure()
        if reason and not self._acknowledged:
            self._acknowledged = True
            self._ask(lambda store: store.add(self._key + "/seen", 1))
        return reason

    def raise_failure(self, error: RuntimeError) -> NoReturn:
        """Turn a backend error of a send or receive into a PeerError that says what happened
        (the caller names the peer)."""
        if is_timeout(error):
            raise CommunicationTimeout(str(error)) from error
        reason = self.stop_reason()
        if reason:
            raise PeerError(reason) from error
        raise PeerError(f"lost the connection ({error}); its process probably died") from error


def _close_links(group: dist.ProcessGroup) -> None:
    """Close this rank's link to every peer of ``group``, so their waits on it fail now, and
    so do this process's own operations in it (a collective blocked on a stopped peer)."""
    for peer in _peers(group):
        _probe(peer, group)  # timed out (the link is closed now), or closed already


def _peers(group: dist.ProcessGroup) -> list[int]:
    """The other ranks of ``group`` (global ranks)."""
    return [peer for peer in dist.get_process_group_ranks(group) if peer != dist.get_rank()]


def _probe(peer: int, group: dist.ProcessGroup) -> RuntimeError | ValueError | None:
    """Wait 1 ms for a message no one sends from ``peer``: the error says how the link is (a
    timeout: alive, and the wait closed the link; another: lost or closed already)."""
    try:
        probe = dist.irecv(torch.empty(1), peer, group=group, tag=BREAK_TAG)
        if probe is not None:
            probe.wait(timeout=timedelta(milliseconds=1))
    except (RuntimeError, ValueError) as error:
        return error
    return None


def _default_store() -> dist.Store | None:
    """The rendezvous store of the default group, used to publish why a stage stopped."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


# a message between stages of one process: its tensors, and on a CUDA link the event that
# marks their copy done
_Message = tuple[list[torch.Tensor], "torch.cuda.Event | None"]


class LocalHub:
    """Mailboxes and the abort flag shared by the stages of one process."""

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = list(devices)
        self._boxes: dict[tuple[int, int, int], queue.SimpleQueue[_Message]] = {}
        self._links: dict[tuple[int, int], _CudaLink] = {}
        self._lock = threading.Lock()
        self.aborted = threading.Event()
        self.reason: str | None = None

    def box(self, src: int, dst: int, tag: int) -> queue.SimpleQueue[_Message]:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.SimpleQueue())

    def link(self, src: int, dst: int) -> _CudaLink:
        """The CUDA streams that carry rank ``src``'s messages to rank ``dst``."""
        with self._lock:
            if (src, dst) not in self._links:
                self._links[src, dst] = _CudaLink(self.devices[src], self.devices[dst])
            return self._links[src, dst]

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self.aborted.set()

    def endpoint(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)


class _CudaLink:
    """Copies from one CUDA stage to another (on its device or another) on streams of their
    own, one per link and end: an activation and a gradient never queue behind each other or
    behind either stage's compute. The sent tensors must not be written again by their stage
    (the executor sends fresh outputs and gradients)."""

    def __init__(self, source: torch.device, target: torch.device):
        self.source, self.target = source, target
        self.send_stream = torch.cuda.Stream(source)
        self.recv_stream = self.send_stream if source == target else torch.cuda.Stream(target)

    def copy(self, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event]:
        """Copies of ``tensors`` on the target device, and the event that marks them done.
        Host tensors (the boundary header, which its reader needs on the host) stay there."""
        self.send_stream.wait_stream(torch.cuda.current_stream(self.source))
        copies = []
        with torch.cuda.stream(self.send_stream), torch.cuda.stream(self.recv_stream):
            for t in tensors:
                if t.device.type != "cuda":
                    copies.append(t.detach().clone())
                    continue
                t.record_stream(self.send_stream)  # freed by its stage: reused after the copy
                copies.append(t.detach().to(self.target, copy=True, non_blocking=True))
            ready = torch.cuda.Event()
            ready.record(self.recv_stream)
        return copies, ready


class _LocalSend(Handle):
    def wait(self, timeout: float) -> list[torch.Tensor]:
        return []


class _LocalRecv(Handle):
    _POLL = 0.05  # seconds between looks at the abort flag

    def __init__(self, box: queue.SimpleQueue[_Message], hub: LocalHub):
        self._box, self._hub = box, hub
        self.ready: torch.cuda.Event | None = None  # a CUDA link's copy is done at this event

    def wait(self, timeout: float) -> list[torch.Tensor]:
        """The message's tensors; from a CUDA link, with this thread's current stream made to
        wait for their copy (the host does not wait)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._hub.aborted.is_set():
                raise PeerError(self._hub.reason or "another stage stopped")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommunicationTimeout(f"no message within {timeout:g} s")
            try:
                tensors, self.ready = self._box.get(timeout=min(left, self._POLL))
            except queue.Empty:
                continue
            if self.ready is not None:
                for t in tensors:
                    if t.is_cuda:
                        stream = torch.cuda.current_stream(t.device)
                        stream.wait_event(self.ready)
                        t.record_stream(stream)  # used here, though copied on the link's stream
            return tensors


class LocalTransport(Transport):
    """One rank's end of a LocalHub; a send copies its tensors onto the receiver's device."""

    def __init__(self, hub: LocalHub, rank: int):
        self.hub, self.rank = hub, rank
        self.device = hub.devices[rank]

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> Handle:
        target = self.hub.devices[peer]
        message: tuple[list[torch.Tensor], torch.cuda.Event | None]
        if self.device.type == "cuda" and target.type == "cuda":
            message = self.hub.link(self.rank, peer).copy(tensors)
        else:  # a host is involved: a plain copy, which the host waits for
            message = ([t.detach().to(target, copy=True) for t in tensors], None)
        self.hub.box(self.rank, peer, tag).put(message)
        return _LocalSend()

    def recv(self, metas: Sequence[TensorMeta], peer: int, tag: int) -> Handle:
        return _LocalRecv(self.hub.box(peer, self.rank, tag), self.hub)

    def abort(self, reason: str) -> None:
        self.hub.abort(reason)

    def failure(self) -> str | None:
        return self.hub.reason

    def raise_if_stopped(self) -> None:
        """The hub's abort flag, set the moment any stage of this process fails: a stage that
        never waits (the first, in an evaluation) stops before its next compute too."""
        if self.hub.aborted.is_set():
            raise PeerError(self.hub.reason or "another stage stopped")
