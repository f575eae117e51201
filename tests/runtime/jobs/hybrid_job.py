"""A torchrun job for the multi-node test: 2 stages x (world / 2) replicas of the test MLP;
each rank saves its final parameters and losses."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

import pipetrain  # noqa: E402
from tests.runtime.models import batches, mlp, sgd  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

rank, world = pipetrain.init_distributed(timeout=60)
torch.set_num_threads(1)
pipe = pipetrain.Pipeline(mlp(), [5, 7], chunks=2, loss_fn=nn.functional.cross_entropy,
                          optimizer=sgd, timeout=60)
replicas, replica = pipe.placement.replicas, pipe.placement.replica
losses = []
for x, y in batches(args.steps):
    share = len(x) // replicas
    losses.append(pipe.train_step(x[replica * share:(replica + 1) * share],
                                  y[replica * share:(replica + 1) * share]))
torch.save({"state": pipe.module.state_dict(), "losses": losses},
           Path(args.out) / f"rank{rank}.pt")
pipetrain.shutdown()  # every rank is done: leave together
