"""Messages between CUDA stages go over streams of their own, ordered by events
(pipetrain/runtime/transport.py ``_CudaLink``), checked with two stages on cuda:0.

- The copy waits for the sender's work on its tensor, however late that work ends.
- The receiver's work waits for the copy, on whatever stream it runs.
- The copy does not wait for the receiver's compute: it finishes while that still runs.

What only two GPUs could show: the copy crossing between devices (NVLink or PCIe) while both
devices compute, and its two-way barrier falling on the link's streams instead of the
receiving device's compute stream. On one GPU the copy engine and the kernels share a device,
so these tests check the ordering, not the overlap in time of two devices. (Whole pipelines
of two stages on cuda:0 over these links: tests/gpu/test_cuda.py, test_cuda_graphs.py.)

Without a GPU every test is skipped with its reason; run ``python -m pytest tests/gpu -q -rs``.
"""

from __future__ import annotations

import pytest
import torch

from pipetrain.runtime.meta import TensorMeta
from pipetrain.runtime.transport import LocalHub

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SLEEP = 200_000_000  # GPU clock cycles of torch.cuda._sleep: about 0.1 s
SHAPE = (1024, 1024)


def _hub():
    hub = LocalHub([torch.device("cuda:0")] * 2)
    return hub.endpoint(0), hub.endpoint(1)


def test_the_copy_waits_for_the_sender_and_the_receiver_for_the_copy():
    sender, receiver = _hub()
    late = torch.cuda.Stream()
    with torch.cuda.stream(late):  # the sender's tensor is written after a long kernel
        torch.cuda._sleep(SLEEP)
        value = torch.full(SHAPE, 3.0, device="cuda:0")
        sender.send([value], 1, tag=0)
    other = torch.cuda.Stream()  # the receiver computes on a stream of its own
    with torch.cuda.stream(other):
        (got,) = receiver.recv([TensorMeta(SHAPE, torch.float32, False)], 0, 0).wait(5)
        doubled = got * 2
    other.synchronize()  # (a copy to the host on the default stream would not wait for it)
    assert torch.equal(doubled.cpu(), torch.full(SHAPE, 6.0))


def test_the_copy_does_not_wait_for_the_receivers_compute():
    sender, receiver = _hub()
    busy = torch.cuda.Stream()
    with torch.cuda.stream(busy):  # the receiver's unrelated compute
        torch.cuda._sleep(SLEEP * 5)
        slept = torch.cuda.Event()
        slept.record()
    sender.send([torch.ones(SHAPE, device="cuda:0")], 1, tag=0)
    handle = receiver.recv([TensorMeta(SHAPE, torch.float32, False)], 0, 0)
    with torch.cuda.stream(busy):
        handle.wait(5)
    assert handle.ready is not None
    handle.ready.synchronize()  # the copy is done ...
    assert not slept.query(), "... while the receiver still computes"
    busy.synchronize()

