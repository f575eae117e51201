"""The causal-LM loss of a Hugging Face model, token-weighted across micro-batches.

In a pipeline, plain labels are enough: the loss takes ``num_items_in_batch``, the mini-batch's
counted tokens over every replica (pipetrain/runtime/loss_items.py). What follows is the older
way, kept working: targets that carry the count themselves.

transformers' loss is the cross-entropy of each token's logits against the next token's label
(labels shifted left by one inside the loss, -100 ignored), summed and divided by the number
of counted tokens. A pipeline computes the loss per micro-batch and divides each by the number
of micro-batches, so a per-micro-batch mean would weight a micro-batch with few counted tokens
as much as a full one. ``causal_lm_targets(labels)`` therefore sends, with each row's labels,
the mini-batch's rows per counted token, B / N; a micro-batch of b rows then returns
``sum / N * (B / b)``, which the pipeline's division by B / b micro-batches turns into
``sum / N``: summed over micro-batches, the mini-batch's token mean, exactly as transformers
computes it in one process.
"""

from __future__ import annotations

import torch
from torch.nn import functional

IGNORE = -100  # transformers' label of a token left out of the loss


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """Each position's target: the next token's label (-100 after the last)."""
    return functional.pad(labels, (0, 1), value=IGNORE)[:, 1:]


def causal_lm_targets(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The targets of ``train_step`` for :func:`causal_lm_loss`: ``(labels, weight)``, where
    every row's ``weight`` is the whole mini-batch's rows per counted token (float64)."""
    if labels.dim() != 2 or labels.is_floating_point():
        raise ValueError(f"labels must be token ids of shape (batch, seq), got {labels.dtype} "
                         f"of shape {tuple(labels.shape)}")
    counted = int((_shifted(labels) != IGNORE).sum())
    rows = labels.shape[0]
    weight = rows / counted if counted else float("nan")  # no counted token: nan, as HF's
    return labels, torch.full((rows,), weight, dtype=torch.float64, device=labels.device)


class CausalLMLoss:
    """transformers' causal-LM loss of ``logits`` (batch, seq, vocab) against ``target``, the
    labels (or ``causal_lm_targets``' pair). In a pipeline it takes ``num_items_in_batch``
    (pipetrain/runtime/loss_items.py): the whole mini-batch's counted tokens over every
    replica, so plain labels give transformers' loss and gradient at any chunks, padding and
    replica count. Called alone: the mean over these rows' counted tokens, or with the pair the
    share of the mini-batch's token mean ``causal_lm_targets`` describes."""

    def __call__(
        self, logits: torch.Tensor, target: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        num_items_in_batch: torch.Tensor | float | None = None,
    ) -> torch.Tensor:
        labels, weight = target if isinstance(target, tuple | list) else (target, None)
        shifted = _shifted(labels)
        total = functional.cross_entropy(
            logits.float().flatten(0, 1), shifted.flatten(), ignore_index=IGNORE,
            reduction="sum",
        )
        if num_items_in_batch is not None:
            return total / num_items_in_batch
        if weight is None:
            return total / (shifted != IGNORE).sum()
        return total * (weight[0] / labels.shape[0]).to(total.dtype)

    @staticmethod
    def count_items(target: torch.Tensor | tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The tokens of ``target``'s labels that the loss counts (the shifted, not -100)."""
        labels = target[0] if isinstance(target, tuple | list) else target
        return (_shifted(labels) != IGNORE).sum()


causal_lm_loss = CausalLMLoss()
