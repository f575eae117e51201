"""Run with pipetrain at commit 2ea65ec (before layers by name): a GPT-2 pipeline's checkpoint
after 2 steps, and the parameters after a third step trained on without a restart (README.md
beside this file)."""

import sys
from pathlib import Path

import torch

import pipetrain
import pipetrain.hf as hf
from tests.hf.models import batch, model

out = Path(sys.argv[1])
pipe = pipetrain.Pipeline(
    hf.sequential(model("gpt2")), balance=[2, 3], chunks=2, devices=["cpu", "cpu"],
    loss_fn=hf.causal_lm_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
)
for step in range(3):
    ids, mask, labels = batch(seed=step)
    pipe.train_step((ids, mask), hf.causal_lm_targets(labels))
    if step == 1:
        pipe.save(out / "checkpoints")
state = {k: v.detach().clone() for k, v in pipe.module.state_dict().items()}
torch.save(state, out / "after_step_3.pt")
