"""A user's training script for the fault runs (benchmarks/fault_runs.py, tests/runtime/
test_faults.py): 2 stages of the test MLP train until stopped, each rank printing "step N" as
it finishes one; nothing is caught, so a failure ends the process as it ends a user's script.
Launched one process per rank with torchrun's environment set; the launcher stops or kills a
rank mid-training and times how long the other takes to exit.

``--hit-at-agree RANK SIGNAL``: rank RANK sends itself SIGNAL (STOP, KILL) as it enters the
step's agreement (an all-reduce over every rank) of step WARMUP, printing "hit TIME" (wall
clock) first: the fault then lands in a collective, not in a receive."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

import pipetrain  # noqa: E402
from pipetrain.runtime.world import ProcessWorld  # noqa: E402
from tests.runtime.models import batches, mlp, sgd  # noqa: E402

WARMUP = 3  # steps before a fault at the agreement

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=3.0)
parser.add_argument("--steps", type=int, default=100_000)
parser.add_argument("--hit-at-agree", nargs=2, metavar=("RANK", "SIGNAL"))
args = parser.parse_args()


def hit_at_agree(rank: int, signal_name: str) -> None:
    """Make rank ``rank`` send itself SIG``signal_name`` in the agreement of step WARMUP."""
    sum_over_ranks, calls = ProcessWorld.sum_over_ranks, [0]

    def hit(world: ProcessWorld, value: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == WARMUP + 1 and world.rank == rank:
            print(f"hit {time.time()}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
        return sum_over_ranks(world, value)

    ProcessWorld.sum_over_ranks = hit  # type: ignore[method-assign]


torch.set_num_threads(1)
pipetrain.init_distributed()  # the process group keeps its default timeout (600 s)
if args.hit_at_agree:
    hit_at_agree(int(args.hit_at_agree[0]), args.hit_at_agree[1])
pipe = pipetrain.Pipeline(mlp(), [6, 6], chunks=4, loss_fn=nn.functional.cross_entropy,
                          optimizer=sgd, timeout=args.timeout)
data = batches(4)
for step in range(args.steps):
    pipe.train_step(*data[step % len(data)])
    print(f"step {step}", flush=True)
pipetrain.shutdown()
