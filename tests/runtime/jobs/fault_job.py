"""A user's training script for the fault runs (benchmarks/fault_runs.py, tests/runtime/
test_faults.py): 2 stages of the test MLP train until stopped, each rank printing "step N" as
it finishes one; nothing is caught, so a failure ends the process as it ends a user's script.
Launched one process per rank with torchrun's environment set; the launcher stops or kills a
rank mid-training and times how long the other takes to exit."""

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
parser.add_argument("--timeout", type=float, default=3.0)
parser.add_argument("--steps", type=int, default=100_000)
parser.add_argument("--schedule", default="1f1b")
args = parser.parse_args()

torch.set_num_threads(1)
pipetrain.init_distributed()  # the process group keeps its default timeout
pipe = pipetrain.Pipeline(mlp(), [6, 6], chunks=4, loss_fn=nn.functional.cross_entropy,
                          optimizer=sgd, timeout=args.timeout, schedule=args.schedule)
data = batches(4)
for step in range(args.steps):
    pipe.train_step(*data[step % len(data)])
    print(f"step {step}", flush=True)
pipetrain.shutdown()
