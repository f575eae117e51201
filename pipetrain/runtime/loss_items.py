"""A loss normalized by the whole mini-batch's count of items, as Hugging Face's
``num_items_in_batch``.

A pipeline scores each micro-batch on its own and averages the losses over the micro-batches
(and the replicas), so a per-micro-batch token mean weights a micro-batch with few counted
tokens (padding, -100 labels) as much as a full one: not the loss of one process on the whole
mini-batch. A ``loss_fn`` opts in by taking a ``num_items_in_batch`` keyword, as transformers'
loss functions do (``sum / num_items_in_batch``). Before each training step the last stage
counts the mini-batch's items (summed over the replicas: HF Trainer's
``average_tokens_across_devices``) and passes each micro-batch's loss ``N / (m * r)`` for ``m``
micro-batches and ``r`` replicas, so the pipeline's mean over them is ``sum / N``: the loss, and
the gradient, of one process on the whole mini-batch, at any chunks and padding.

The items counted are the targets other than -100 (the ignore index of torch's
``cross_entropy`` and of transformers' labels), or what the loss's own ``count_items(target)``
returns (a causal LM's loss counts the shifted labels: :mod:`pipetrain.hf.loss`). A schedule
that updates after every micro-batch (PipeDream) gives each its own normalization, unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from pipetrain.runtime.microbatch import Batch
from pipetrain.runtime.stage import Stage

if TYPE_CHECKING:
    from pipetrain.runtime.collectives import Collectives

IGNORE = -100  # the targets left out of the count


def takes_items(loss_fn: Callable[..., Any] | None) -> bool:
    """Whether ``loss_fn`` opts in: it takes a ``num_items_in_batch`` keyword."""
    if loss_fn is None:
        return False
    try:
        parameters = inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False
    item = parameters.get("num_items_in_batch")
    return item is not None and item.kind in (item.POSITIONAL_OR_KEYWORD, item.KEYWORD_ONLY)


def count(loss_fn: Callable[..., Any], target: Batch) -> torch.Tensor:
    """The items of ``target`` (a mini-batch's), as a 0-d tensor on its device: no host sync."""
    counter = getattr(loss_fn, "count_items", None)
    if counter is not None:
        return torch.as_tensor(counter(target))
    first = target[0] if isinstance(target, tuple | list) else target
    return (first != IGNORE).sum()


class LossItems:
    """Hands the last stage's ``loss_fn`` each step's items per micro-batch (module docstring).
    ``group``: the last stage's replicas (None: one replica), ``collectives`` what bounds the
    wait on them (given with a group); ``micro_batches``: those the pipeline averages over per
    update."""

    def __init__(self, last: Stage, micro_batches: int, group: dist.ProcessGroup | None,
                 collectives: Collectives | None):
        self.last, self.micro_batches = last, micro_batches
        self.group, self.collectives = group, collectives
        self.replicas = 1 if group is None else dist.get_world_size(group)

    def count(self, target: Batch | None) -> None:
        """Count ``target``, this step's mini-batch of targets on the last stage, over every
        replica; the last stage's loss then gets its share."""
        if target is None:
            raise ValueError("the last stage's train_step needs the targets (got None)")
        items = count(self.last.loss_fn, target).to(torch.float64)  # type: ignore[arg-type]
        if self.group is not None:
            assert self.collectives is not None, "given with the group"
            work = dist.all_reduce(items, group=self.group, async_op=True)
            self.collectives.wait(work, "the replicas' count of items (num_items_in_batch)",
                                  self.group)
        self.last.num_items = (items / (self.micro_batches * self.replicas)).float()
