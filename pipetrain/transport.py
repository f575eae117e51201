"""Moving tensors between neighbouring stages: one interface, two implementations.

``DistributedTransport`` uses torch.distributed point-to-point operations (gloo on CPU, NCCL on
GPUs), one process per stage. ``LocalTransport`` connects stages that run as threads of one
process (torchgpipe-style, one device each). Both post operations without blocking and return a
handle; only ``Handle.wait`` blocks, always with a timeout. Both can abort: a failing stage
records why and breaks its links, so its peers stop at once instead of waiting out the timeout.
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
from pipetrain.meta import TensorMeta, empty_like_meta
from pipetrain.tags import BREAK_TAG, tensor_tags


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

    @abstractmethod
    def failure(self) -> str | None:
        """The reason recorded by whichever stage aborted first, if any."""


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
    links to every peer (a receive that times out at once makes gloo close the link), so a
    peer blocked on it fails at once even when this process lives on, and reads the reason
    there. Every look-up in the store is bounded by STORE_WAIT: the store's host may be the
    stuck rank."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int], device: torch.device):
        self.group = group
        self.ranks = list(ranks)
        self.device = device
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
        first = self._ask(lambda store: store.compare_set(self._key, "", reason)) == reason.encode()
        self._close_links()
        if first:  # the root cause: the others stop because of it
            self._await_acknowledgements()
        dist.destroy_process_group(self.group)

    def _close_links(self) -> None:
        """Close this rank's link to every peer of the group, so their waits on it fail now."""
        me = dist.get_rank()
        for peer in self.ranks:
            if peer == me:
                continue
            try:
                probe = dist.irecv(torch.empty(1), peer, group=self.group, tag=BREAK_TAG)
                if probe is not None:
                    probe.wait(timeout=timedelta(milliseconds=1))
            except RuntimeError:  # timed out (the link is closed now) or closed already
                pass

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

    def raise_failure(self, error: RuntimeError) -> NoReturn:
        """Turn a backend error into a PeerError that says what happened to whom."""
        if is_timeout(error):
            raise CommunicationTimeout(str(error)) from error
        reason = self.failure()
        if reason is None:  # the failing peer records its reason just before it closes links
            time.sleep(0.05)
            reason = self.failure()
        if reason:
            if not self._acknowledged:
                self._acknowledged = True
                self._ask(lambda store: store.add(self._key + "/seen", 1))
            raise PeerError(reason) from error
        raise PeerError(
            f"lost the connection to a peer ({error}); its process probably died"
        ) from error


def _default_store() -> dist.Store | None:
    """The rendezvous store of the default group, used to publish why a stage stopped."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, AttributeError, ValueError):
        return None


class LocalHub:
    """Mailboxes and the abort flag shared by the stages of one process."""

    def __init__(self, devices: Sequence[torch.device]):
        self.devices = list(devices)
        self._boxes: dict[tuple[int, int, int], queue.SimpleQueue[list[torch.Tensor]]] = {}
        self._lock = threading.Lock()
        self.aborted = threading.Event()
        self.reason: str | None = None

    def box(self, src: int, dst: int, tag: int) -> queue.SimpleQueue[list[torch.Tensor]]:
        with self._lock:
            return self._boxes.setdefault((src, dst, tag), queue.SimpleQueue())

    def abort(self, reason: str) -> None:
        with self._lock:
            if self.reason is None:
                self.reason = reason
        self.aborted.set()

    def endpoint(self, rank: int) -> LocalTransport:
        return LocalTransport(self, rank)


class _LocalSend(Handle):
    def wait(self, timeout: float) -> list[torch.Tensor]:
        return []


class _LocalRecv(Handle):
    _POLL = 0.05  # seconds between looks at the abort flag

    def __init__(self, box: queue.SimpleQueue[list[torch.Tensor]], hub: LocalHub):
        self._box, self._hub = box, hub

    def wait(self, timeout: float) -> list[torch.Tensor]:
        deadline = time.monotonic() + timeout
        while True:
            if self._hub.aborted.is_set():
                raise PeerError(self._hub.reason or "another stage stopped")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommunicationTimeout(f"no message within {timeout:g} s")
            try:
                return self._box.get(timeout=min(left, self._POLL))
            except queue.Empty:
                continue


class LocalTransport(Transport):
    """One rank's end of a LocalHub; a send copies its tensors onto the receiver's device."""

    def __init__(self, hub: LocalHub, rank: int):
        self.hub, self.rank = hub, rank
        self.device = hub.devices[rank]

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> Handle:
        target = self.hub.devices[peer]
        copies = [t.detach().to(target, copy=True) for t in tensors]
        self.hub.box(self.rank, peer, tag).put(copies)
        return _LocalSend()

    def recv(self, metas: Sequence[TensorMeta], peer: int, tag: int) -> Handle:
        return _LocalRecv(self.hub.box(peer, self.rank, tag), self.hub)

    def abort(self, reason: str) -> None:
        self.hub.abort(reason)

    def failure(self) -> str | None:
        return self.hub.reason
