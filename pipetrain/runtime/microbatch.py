"""Splitting a mini-batch into micro-batches along dimension 0, and joining outputs back."""

from __future__ import annotations

import torch

Batch = torch.Tensor | tuple[torch.Tensor, ...]


def batch_size(value: Batch, what: str) -> int:
    """The batch size (dimension 0) of ``value``; a TypeError naming the culprit unless it is a
    Tensor or a non-empty tuple of Tensors."""
    tensors = value if isinstance(value, tuple | list) else (value,)
    wrong = [(i, t) for i, t in enumerate(tensors) if not isinstance(t, torch.Tensor)]
    if not tensors or wrong:
        member = f" ({what}[{wrong[0][0]}] is {type(wrong[0][1]).__name__})"
        raise TypeError(
            f"{what} must be a Tensor or a tuple of Tensors, got {type(value).__name__}"
            + (member if wrong and isinstance(value, tuple | list) else "")
        )
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(
            f"the tensors of {what} disagree on the batch dimension (dim 0): "
            f"{sorted(map(str, sizes))}"
        )
    return next(iter(sizes))  # type: ignore[return-value]


def scatter(value: Batch, chunks: int, what: str) -> list[Batch]:
    """``value`` cut into ``chunks`` equal micro-batches; uneven sizes are an error."""
    size = batch_size(value, what)
    if size == 0:
        raise ValueError(f"{what} is an empty batch (batch size 0); pass at least {chunks} samples")
    if size % chunks:
        raise ValueError(
            f"{what} has batch size {size}, which chunks={chunks} does not divide; use a batch "
            f"size that is a multiple of {chunks} (e.g. {max(chunks, size - size % chunks)}) "
            "or change chunks"
        )
    if isinstance(value, tuple | list):
        parts = [t.chunk(chunks) for t in value]
        return [tuple(p[i] for p in parts) for i in range(chunks)]
    return list(value.chunk(chunks))


def gather(outputs: list[Batch]) -> Batch:
    """Concatenate micro-batch outputs back into one mini-batch output."""
    first = outputs[0]
    if isinstance(first, tuple):
        return tuple(torch.cat([o[k] for o in outputs]) for k in range(len(first)))
    return torch.cat(outputs)  # type: ignore[arg-type]


def to_device(value: Batch, device: torch.device) -> Batch:
    if isinstance(value, tuple | list):
        return tuple(t.to(device) for t in value)
    return value.to(device)


def check_batches(x: object, y: object) -> None:
    """The caller's batches of a step, before any work: each a Tensor or a tuple of Tensors
    (or None on ranks that do not read it), x and y of one batch size."""
    sizes = {
        what: batch_size(value, what)  # type: ignore[arg-type]
        for what, value in (("x", x), ("y", y))
        if value is not None
    }
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"x has batch size {sizes['x']} but y has {sizes['y']}; pass matching batches"
        )
