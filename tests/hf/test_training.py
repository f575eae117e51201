"""A Hugging Face model trained through pipetrain equals the same model trained by itself.

2 stages (threads in one process, and 2 gloo processes), 2 micro-batches, AdamW with a clip,
3 steps on padded batches whose sequence length changes every step, against single-process
training on ``model(input_ids, attention_mask=..., labels=...).loss``. Tolerance: fp32, 1e-5
on every parameter. Micro-batching only reorders sums (a few units in the last place, ~1e-7),
which Adam's normalized step can amplify on a near-zero gradient component to about lr * 1e-2;
a wrong loss weighting (micro-batch means) or a lost mask moves parameters by about lr = 1e-3.
"""

from __future__ import annotations

import copy

import pytest
import torch

import pipetrain
import pipetrain.hf as hf
from tests.hf.models import batch, config, declared, model, transformers, two_stages
from tests.runtime.harness import run_ranks, values

TOLERANCE = 1e-5
STEPS = 3


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


def batches():
    return [batch(rows=4, length=9 + 3 * step, seed=step) for step in range(STEPS)]


def reference(arch: str) -> dict[str, torch.Tensor]:
    m = model(arch)
    opt = adamw(m.parameters())
    for ids, mask, labels in batches():
        opt.zero_grad()
        m(ids, attention_mask=mask, labels=labels, use_cache=False).loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def train(pipe: pipetrain.Pipeline) -> list[float]:
    losses = []
    for ids, mask, labels in batches():
        losses.append(float(pipe.train_step((ids, mask), hf.causal_lm_targets(labels))))
    return losses


def options(arch: str = "llama", **extra) -> dict:
    return dict(balance=two_stages(arch), chunks=2, schedule="1f1b", loss_fn=hf.causal_lm_loss,
                optimizer=adamw, clip_grad_norm=1.0, **extra)


def assert_close(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert state.keys() <= expected.keys()
    for key, value in state.items():
        assert (value - expected[key]).abs().max() < TOLERANCE, key


@pytest.mark.parametrize("arch", [declared(a) for a in ("llama", "gpt2", "gptj", "codegen")])
def test_threads_equal_hf_training(arch: str, one_thread) -> None:
    pipe = pipetrain.Pipeline(hf.sequential(model(arch)), devices=["cpu", "cpu"],
                              **options(arch))
    train(pipe)
    assert_close(pipe.module.state_dict(), reference(arch))


def test_bf16_losses_follow_hf_autocast(one_thread) -> None:
    """bf16: each step's loss within 1e-3 of the model trained under bf16 autocast in one
    process (bf16 rounds at 4e-3 relative; activations cross stages in bf16 where the model
    keeps its residual stream in fp32, so parameters are compared in fp32 only)."""
    pipe = pipetrain.Pipeline(hf.sequential(model("llama")), devices=["cpu", "cpu"],
                              **options(precision="bf16"))
    m = model("llama")
    opt = adamw(m.parameters())
    expected = []
    for ids, mask, labels in batches():
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(ids, attention_mask=mask, labels=labels, use_cache=False).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        opt.step()
        expected.append(loss.item())
    for got, want in zip(train(pipe), expected, strict=True):
        assert abs(got - want) < 1e-3


def _rank(rank: int, world: int, arch: str, folder: str) -> dict[str, torch.Tensor]:
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config(arch))
    pipe = pipetrain.Pipeline(hf.sequential(meta), weights=folder, **options())
    train(pipe)
    return {k: v.detach().clone() for k, v in pipe.module.state_dict().items()}


def test_processes_load_the_checkpoint_and_equal_hf_training(tmp_path) -> None:
    """Each rank builds the model on the meta device and reads its stage from the sharded
    checkpoint directory (the head tied to the embedding, saved once)."""
    model("llama-tied").save_pretrained(tmp_path, max_shard_size="20KB")
    first, last = values(run_ranks(_rank, 2, "llama-tied", str(tmp_path), deadline=180))
    expected = reference("llama-tied")
    assert list(first) == [k for k in expected if not k.startswith(
        ("model.layers.1.", "model.norm", "lm_head"))]
    assert list(last) == [k for k in expected if k.startswith(
        ("model.layers.1.", "model.norm", "lm_head"))]
    for state in (first, last):
        assert_close(state, expected)


def test_loss_is_the_models() -> None:
    """train_step's loss, token-weighted across micro-batches, is transformers' loss."""
    m = model("llama")
    ids, mask, labels = batch()
    expected = m(ids, attention_mask=mask, labels=labels, use_cache=False).loss.item()
    pipe = pipetrain.Pipeline(hf.sequential(copy.deepcopy(m)), devices=["cpu", "cpu"],
                              **options())
    loss = pipe.train_step((ids, mask), hf.causal_lm_targets(labels))
    assert abs(float(loss) - expected) < 1e-6


def _schedules(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """One process per rank trains the model under each schedule (a fresh pipeline each)."""
    runs = {"interleaved": dict(schedule="interleaved", balance=[1, 1, 1, 2], chunks=2),
            "zb-h1": dict(schedule="zb-h1"),
            "1f1b-recompute": dict(recompute="always")}
    if world == 4:
        runs = {"1f1b-4": dict(balance=[1, 1, 1, 2], chunks=4),
                "zb-h1-4": dict(schedule="zb-h1", balance=[1, 1, 1, 2], chunks=4)}
    else:
        runs["gpt2-zb-h1"] = dict(schedule="zb-h1")
    out = {}
    for name, settings in runs.items():
        arch = "gpt2" if name.startswith("gpt2") else "llama"
        pipe = pipetrain.Pipeline(hf.sequential(model(arch)), **{**options(arch), **settings})
        train(pipe)
        out[name] = {k: v.detach().clone() for k, v in pipe.module.state_dict().items()}
    return out


@pytest.mark.slow  # several pipelines in 2 and 4 processes that each import transformers
@pytest.mark.parametrize("world", [2, 4])
def test_schedules_equal_hf_training(world: int) -> None:
    """Interleaved (2 stages per rank), zero bubble (split backward: each block's outputs are
    cut, the mask and positions pass uncut) and recomputation: HF training's parameters."""
    results = values(run_ranks(_schedules, world, deadline=600))
    for name in results[0]:
        expected = reference("gpt2" if name.startswith("gpt2") else "llama")
        held = [r[name] for r in results]
        assert {k for s in held for k in s} == set(expected), name
        for state in held:
            assert_close(state, expected)
