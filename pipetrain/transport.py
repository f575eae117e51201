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
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from pipetrain.errors import CommunicationTimeout, PeerError
from pipetrain.meta import TensorMeta, empty_like_meta


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
    def __init__(self, works: list, tensors: list[torch.Tensor], transport: DistributedTransport):
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


class DistributedTransport(Transport):
    """torch.distributed isend/irecv within ``group``; pipeline rank r is global rank
    ``ranks[r]``."""

    def __init__(self, group: dist.ProcessGroup, ranks: Sequence[int], device: torch.device):
        self.group = group
        self.ranks = list(ranks)
        self.device = device
        self._store = _default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        name = getattr(group, "group_name", "pipeline")
        self._key = f"pipetrain/failure/{restart}/{name}"
        self._aborted = False

    def send(self, tensors: Sequence[torch.Tensor], peer: int, tag: int) -> Handle:
        dst = self.ranks[peer]
        ready = [t.contiguous() for t in tensors]
        works = [dist.isend(t, dst, group=self.group, tag=tag + k) for k, t in enumerate(ready)]
        return _DistributedHandle(works, ready, self)

    def recv(self, metas: Sequence[TensorMeta], peer: int, tag: int) -> Handle:
        src = self.ranks[peer]
        buffers = empty_like_meta(metas, self.device)
        works = [dist.irecv(t, src, group=self.group, tag=tag + k) for k, t in enumerate(buffers)]
        return _DistributedHandle(works, buffers, self)

    def abort(self, reason: str) -> None:
        if self._aborted:
            return
        self._aborted = True
        if self._store is not None:
            try:
                self._store.compare_set(self._key, "", reason)
            except RuntimeError:  # the store itself is gone: nothing more to tell
                pass
        dist.destroy_process_group(self.group)  # closes the links: peers' waits fail at once

    def failure(self) -> str | None:
        if self._store is None:
            return None
        try:
            if self._store.check([self._key]):
                return self._store.get(self._key).decode()
        except RuntimeError:
            return None
        return None

    def raise_failure(self, error: RuntimeError) -> None:
        """Turn a backend error into a PeerError that says what happened to whom."""
        if "Timed out" in str(error) or "timeout" in str(error).lower():
            raise CommunicationTimeout(str(error)) from error
        time.sleep(0.05)  # the failing peer records its reason just before it closes its links
        reason = self.failure()
        if reason:
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
        self._boxes: dict[tuple[int, int, int], queue.SimpleQueue] = {}
        self._lock = threading.Lock()
        self.aborted = threading.Event()
        self.reason: str | None = None

    def box(self, src: int, dst: int, tag: int) -> queue.SimpleQueue:
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

    def __init__(self, box: queue.SimpleQueue, hub: LocalHub):
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
