"""Checkpoints written before layers by name still resume: a pipeline's checkpoint holds the
model's own state_dict keys and the optimizer state by parameter name, and those did not
change when GPT-2's embedding became three layers (tests/data/gpt2_checkpoint_2ea65ec)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

import pipetrain
import pipetrain.hf as hf
from tests.hf.models import batch, model, two_stages

OLD = Path(__file__).parents[1] / "data" / "gpt2_checkpoint_2ea65ec"
# the step is the same fp32 arithmetic as the one trained on without a restart (equal here);
# 1e-6 leaves room for another torch or transformers release's kernels
TOLERANCE = 1e-6


def test_a_checkpoint_of_the_old_layers_resumes_and_trains_on(tmp_path: Path) -> None:
    shutil.copytree(OLD / "checkpoints", tmp_path / "checkpoints")
    layers = hf.sequential(model("gpt2", seed=7))  # other weights: the checkpoint's must win
    assert layers.names[:4] == ["transformer.wte", "transformer.wpe", "transformer.drop",
                                "transformer.h.0"]
    pipe = pipetrain.Pipeline(
        layers, balance=two_stages("gpt2"), chunks=2, devices=["cpu", "cpu"],
        loss_fn=hf.causal_lm_loss, checkpoint_dir=tmp_path / "checkpoints",
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    )
    assert pipe.step == 2
    before = {k: p.detach().clone() for k, p in pipe.module.named_parameters()}
    ids, mask, labels = batch(seed=2)
    pipe.train_step((ids, mask), hf.causal_lm_targets(labels))
    expected = torch.load(OLD / "after_step_3.pt", weights_only=True)
    state = pipe.module.state_dict()
    assert list(state) == list(expected)
    for key, value in state.items():
        assert (value - expected[key]).abs().max() <= TOLERANCE, key
    assert all(not torch.equal(state[key], value) for key, value in before.items())
