"""Plain Hugging Face labels through a pipeline give transformers' own loss and gradient.

The labels are passed as every HF training loop passes them (no ``causal_lm_targets``), with
padding spread unevenly over the rows, so each micro-batch counts a different number of tokens:
a per-micro-batch mean would be off by about 1 in relative gradient. ``causal_lm_loss`` takes
``num_items_in_batch`` (pipetrain/runtime/loss_items.py), so every schedule at every chunks,
and 2 replicas (each feeding half the rows; the count summed over them, as HF Trainer's
``average_tokens_across_devices``), equal ``model(ids, attention_mask=..., labels=...).loss``
on the whole mini-batch in one process. One SGD step at lr 1 (Adam would normalize a wrongly
scaled gradient away): parameters within 1e-5, as tests/hf/test_training.py (fp32 sums in
another order differ by ~1e-7), and the loss within 1e-6.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pipetrain
import pipetrain.hf as hf
from tests.hf.models import VOCAB, model
from tests.runtime.harness import run_ranks, values

TOLERANCE = 1e-5
ROWS, LENGTH = 8, 12


def sgd(params):
    return torch.optim.SGD(params, lr=1.0)


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row i is right-padded by i tokens (row 7: 7 of 12), one row left-padded too."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    for i in range(1, ROWS):
        mask[i, LENGTH - i:] = 0
    mask[2, :2] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def reference() -> tuple[dict[str, torch.Tensor], float]:
    """One process, the whole mini-batch, one SGD step: parameters and loss."""
    m = model("llama")
    ids, mask, labels = padded_batch()
    loss = m(ids, attention_mask=mask, labels=labels, use_cache=False).loss
    loss.backward()
    sgd(m.parameters()).step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, loss.item()


def assert_close(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state, "no parameters compared"
    for key, value in state.items():
        assert (value - expected[key]).abs().max() < TOLERANCE, key


RUNS = {  # schedule -> balance over 2 ranks (interleaved: 2 stages on each)
    "gpipe": [2, 3], "1f1b": [2, 3], "zb-h1": [2, 3], "interleaved": [1, 1, 1, 2],
}


@pytest.mark.parametrize("chunks", [1, 2, 8])
@pytest.mark.parametrize("schedule", list(RUNS))
def test_plain_labels_give_transformers_gradient(schedule: str, chunks: int, one_thread):
    if schedule == "interleaved" and chunks == 1:
        pytest.skip("interleaved needs at least as many micro-batches as ranks")
    expected, loss = reference()
    pipe = pipetrain.Pipeline(
        hf.sequential(model("llama")), RUNS[schedule], devices=["cpu", "cpu"], chunks=chunks,
        schedule=schedule, loss_fn=hf.causal_lm_loss, optimizer=sgd,
    )
    ids, mask, labels = padded_batch()
    got = pipe.train_step((ids, mask), labels)
    assert abs(float(got) - loss) < 1e-6
    assert_close(pipe.module.state_dict(), expected)


def test_the_old_targets_still_give_the_same(one_thread):
    """``causal_lm_targets`` (the former way) is no longer needed, and still works."""
    expected, loss = reference()
    pipe = pipetrain.Pipeline(
        hf.sequential(model("llama")), [2, 3], devices=["cpu", "cpu"], chunks=4,
        loss_fn=hf.causal_lm_loss, optimizer=sgd,
    )
    ids, mask, labels = padded_batch()
    assert abs(float(pipe.train_step((ids, mask), hf.causal_lm_targets(labels))) - loss) < 1e-6
    assert_close(pipe.module.state_dict(), expected)


def test_a_loss_without_the_keyword_keeps_its_own_mean(one_thread):
    """A loss that does not take num_items_in_batch is called as before: each micro-batch's
    own mean (here: not transformers' gradient, by a wide margin, which is what opting in
    fixes)."""
    expected, _ = reference()

    def per_microbatch_mean(logits, labels):
        return copy.copy(hf.causal_lm_loss)(logits, labels)

    pipe = pipetrain.Pipeline(
        hf.sequential(model("llama")), [2, 3], devices=["cpu", "cpu"], chunks=4,
        loss_fn=per_microbatch_mean, optimizer=sgd,
    )
    ids, mask, labels = padded_batch()
    pipe.train_step((ids, mask), labels)
    worst = max((v - expected[k]).abs().max() for k, v in pipe.module.state_dict().items())
    assert worst > 100 * TOLERANCE


def _replica(rank: int, world: int) -> dict[str, torch.Tensor]:
    pipe = pipetrain.Pipeline(
        hf.sequential(model("llama")), [2, 3], chunks=2, replicas=2,
        loss_fn=hf.causal_lm_loss, optimizer=sgd,
    )
    ids, mask, labels = padded_batch()
    half = slice(pipe.placement.replica * ROWS // 2, (pipe.placement.replica + 1) * ROWS // 2)
    loss = pipe.train_step((ids[half], mask[half]), labels[half])
    return {"loss": float(loss), **{k: v.detach().clone()
                                    for k, v in pipe.module.state_dict().items()}}


def test_two_replicas_count_tokens_across_each_other():
    """2 stages x 2 replicas (4 gloo processes); the replicas' rows hold 67 and 28 counted
    tokens, so averaging each replica's own token mean would be off."""
    expected, loss = reference()
    for state in values(run_ranks(_replica, 4, deadline=300)):
        assert abs(state.pop("loss") - loss) < 1e-6
        assert_close(state, expected)
