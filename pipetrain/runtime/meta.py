"""What crosses a stage boundary: a Tensor or a flat tuple of Tensors, described by a header.

The header is a fixed-size int64 tensor, so a receiver can post it before it knows anything;
the sender sends it with the first micro-batch of each mini-batch, and the shapes it describes are
reused for the rest of that mini-batch (and for the gradients flowing back).

An activation crosses in its memory order: a tensor whose layout is a permutation of a dense
block (a transposed view) is sent as that block, and the receiver views it back with the same
strides, so the next stage reads the layout one process would have handed on (what a layer
does in memory order, such as Dropout drawing its mask, then agrees with one process).
Gradients cross in logical order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

HEADER_LEN = 128
_MAGIC = 0x5049  # "PI": catches a receive that got some other message
# The header's fields: magic, tensor count, is_tuple; then per tensor dtype, flags
# (requires_grad, and whether a memory order follows), ndim, the ndim sizes and the order. So
# it describes at most this many tensors (all of them 0-d), and each tensor of a boundary gets
# a message tag of its own (pipetrain/runtime/tags.py).
HEADER_FIXED_FIELDS, TENSOR_FIXED_FIELDS = 3, 3
MAX_TENSORS = (HEADER_LEN - HEADER_FIXED_FIELDS) // TENSOR_FIXED_FIELDS

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool  # the receiver will send this tensor's gradient back
    # the dimensions from outermost to innermost in memory, where that is not their order;
    # not compared: shapes decide whether a header is new, its order is whichever it holds
    order: tuple[int, ...] | None = field(default=None, compare=False)

    @property
    def wire_shape(self) -> tuple[int, ...]:
        """The shape of the message: the dimensions in memory order."""
        return self.shape if self.order is None else tuple(self.shape[d] for d in self.order)

    def to_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in this meta's memory order, contiguous (a view where it is laid out so;
        a copy where another micro-batch's layout differs)."""
        return tensor if self.order is None else tensor.permute(self.order).contiguous()

    def from_wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """A received message viewed in logical order, with the sender's strides."""
        if self.order is None:
            return tensor
        inverse = sorted(range(len(self.order)), key=self.order.__getitem__)
        return tensor.permute(inverse)


def memory_order(tensor: torch.Tensor) -> tuple[int, ...] | None:
    """The order of ``tensor``'s dimensions in memory where it is a permutation of a dense
    block and not contiguous; else None (sent as laid out logically)."""
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    order = tuple(sorted(range(tensor.dim()), key=lambda d: -tensor.stride()[d]))
    return order if tensor.permute(order).is_contiguous() else None


@dataclass(frozen=True)
class BoundaryMeta:
    """Shapes, dtypes and gradient flags of one boundary crossing, and whether it is a tuple."""

    tensors: tuple[TensorMeta, ...]
    is_tuple: bool

    @property
    def grad_metas(self) -> tuple[TensorMeta, ...]:
        """The tensors whose gradients flow back across this boundary."""
        return tuple(replace(t, order=None) for t in self.tensors if t.requires_grad)


def flatten(value: object, where: str) -> tuple[tuple[torch.Tensor, ...], bool]:
    """A boundary value as (tensors, is_tuple); anything else is a clear error."""
    if isinstance(value, torch.Tensor):
        return (value,), False
    if isinstance(value, tuple | list) and all(isinstance(v, torch.Tensor) for v in value):
        return tuple(value), True
    raise TypeError(
        f"{where} produced {type(value).__name__}; values crossing a stage boundary must be a "
        "Tensor or a tuple of Tensors (wrap other outputs, e.g. return a tuple of tensors)"
    )


def unflatten(
    tensors: Sequence[torch.Tensor], is_tuple: bool
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    return tuple(tensors) if is_tuple else tensors[0]


def describe(tensors: Sequence[torch.Tensor], is_tuple: bool) -> BoundaryMeta:
    metas = []
    for t in tensors:
        if t.dtype not in DTYPES:
            raise TypeError(
                f"dtype {t.dtype} cannot cross a stage boundary; supported: "
                f"{', '.join(str(d) for d in DTYPES)}. Cast it in the layer before the boundary."
            )
        grad = t.requires_grad and (t.is_floating_point() or t.is_complex())
        metas.append(TensorMeta(tuple(t.shape), t.dtype, grad, memory_order(t)))
    return BoundaryMeta(tuple(metas), is_tuple)


def encode(meta: BoundaryMeta) -> torch.Tensor:
    if len(meta.tensors) > MAX_TENSORS:
        raise ValueError(
            f"a stage boundary carries {len(meta.tensors)} tensors, more than the {MAX_TENSORS} "
            "a boundary header describes; send fewer tensors (stack or concatenate some)"
        )
    fields = [_MAGIC, len(meta.tensors), int(meta.is_tuple)]
    for t in meta.tensors:
        flags = int(t.requires_grad) | (2 if t.order is not None else 0)
        fields += [DTYPES.index(t.dtype), flags, len(t.shape), *t.shape, *(t.order or ())]
    if len(fields) > HEADER_LEN:
        raise ValueError(
            f"boundary of {len(meta.tensors)} tensors needs {len(fields)} header fields, more "
            f"than {HEADER_LEN}; send fewer or flatter tensors across this stage boundary"
        )
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def decode(header: torch.Tensor) -> BoundaryMeta:
    fields = header.tolist()
    if fields[0] != _MAGIC:
        raise ValueError("received a malformed boundary header: the stages' schedules disagree")
    count, is_tuple, pos = fields[1], bool(fields[2]), 3
    metas = []
    for _ in range(count):
        dtype, flags, ndim = fields[pos : pos + 3]
        shape = tuple(fields[pos + 3 : pos + 3 + ndim])
        pos += 3 + ndim
        order = None
        if flags & 2:
            order, pos = tuple(fields[pos : pos + ndim]), pos + ndim
        metas.append(TensorMeta(shape, DTYPES[dtype], bool(flags & 1), order))
    return BoundaryMeta(tuple(metas), is_tuple)


def empty_like_meta(metas: Sequence[TensorMeta], device: torch.device) -> list[torch.Tensor]:
    """Buffers for messages of ``metas`` (their wire shapes)."""
    return [torch.empty(m.wire_shape, dtype=m.dtype, device=device) for m in metas]
