"""The boundary header: what a receiver learns of the tensors before they arrive, and the
memory order activations cross in (pipetrain/runtime/meta.py)."""

from __future__ import annotations

import torch

from pipetrain.runtime.meta import decode, describe, empty_like_meta, encode


def test_a_header_round_trips_shapes_dtypes_gradient_flags_and_memory_order():
    plain = torch.randn(2, 3, requires_grad=True)
    transposed = torch.randn(4, 5, 6).transpose(1, 2)  # dense, dims in memory (0, 2, 1)
    sliced = torch.randn(4, 6)[:, :3]  # not dense: sent in logical order
    meta = describe([plain, transposed, sliced, torch.zeros(3, dtype=torch.int64)], True)
    decoded = decode(encode(meta))
    assert decoded == meta
    assert [t.order for t in decoded.tensors] == [None, (0, 2, 1), None, None]
    assert [t.requires_grad for t in decoded.tensors] == [True, False, False, False]
    assert decoded.grad_metas[0].order is None  # gradients cross in logical order


def test_an_activation_arrives_with_its_senders_strides():
    """What the wire carries is the sender's memory, viewed back with the sender's strides:
    equal values, equal strides, no copy on either side of a dense permutation."""
    sent = torch.randn(3, 4, 5).permute(2, 0, 1)
    (meta,) = describe([sent], False).tensors
    wire = meta.to_wire(sent)
    assert wire.is_contiguous() and wire.data_ptr() == sent.data_ptr()
    (buffer,) = empty_like_meta([meta], torch.device("cpu"))
    assert buffer.shape == wire.shape
    buffer.copy_(wire)  # what a transport does
    arrived = meta.from_wire(buffer)
    assert torch.equal(arrived, sent) and arrived.stride() == sent.stride()


def test_a_later_micro_batch_in_another_layout_is_sent_in_the_first_ones_order():
    first = torch.randn(4, 5).t()
    (meta,) = describe([first], False).tensors
    other = torch.randn(5, 4)  # same shape, contiguous
    arrived = meta.from_wire(meta.to_wire(other).clone())
    assert torch.equal(arrived, other)
