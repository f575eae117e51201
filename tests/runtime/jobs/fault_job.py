"""A user's training script for the fault runs (benchmarks/fault_runs.py, tests/runtime/
test_faults.py): 2 stages of the test MLP train until stopped, each rank printing "step N" as
it finishes one; nothing is caught, so a failure ends the process as it ends a user's script.
Launched one process per rank with torchrun's environment set; the launcher stops or kills a
rank mid-training and times how long the other takes to exit.

``--replicas N``: N replicas of the pipeline (2 x N processes, global rank ``2 k + s`` running
stage s of replica k). ``--stages 1``: one stage of the whole MLP per replica instead (N
processes, global rank k running replica k). ``--zero Z``: what the replicas shard (ZeRO).

``--hit RANK SIGNAL PLACE``: global rank RANK sends itself SIGNAL (STOP, KILL) as it enters
PLACE, printing "hit TIME" (wall clock) first, so that the fault lands in that wait of its
peers: ``agree``, the step's agreement (an all-reduce over every rank) of step WARMUP;
``gradients``, the gradient all-reduce over the replicas of step WARMUP (replicas > 1: as it
launches it);
``batch``, the first step's check of the batch (a gather); ``settings``, the start-up check of
the settings (a gather, while the pipeline is built); ``gather``, the first forward of step
WARMUP (zero 2 and 3: FSDP2's all-gather of the weights); ``zero-step``, the optimizer step of
step WARMUP (zero 1: ZeroRedundancyOptimizer's broadcasts of the updated weights);
``groups``, the creation of the pipeline's process groups (placement.join); ``shutdown``,
pipetrain.shutdown()'s barrier, training ending after WARMUP steps; ``save``, the checkpoint
of step WARMUP + 1 (zero 1 to 3: the gather of the sharded state from the replicas).

``--save FOLDER``: ``pipe.save(FOLDER)`` after every step."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

import pipetrain  # noqa: E402
from pipetrain.runtime import world  # noqa: E402
from pipetrain.runtime.data_parallel import GradientSync  # noqa: E402
from pipetrain.runtime.sharding import Checkpointing  # noqa: E402
from pipetrain.runtime.stage import Stage  # noqa: E402
from pipetrain.runtime.world import ProcessWorld  # noqa: E402
from tests.runtime.models import batches, mlp, sgd  # noqa: E402

WARMUP = 3  # steps before a fault in a step's agreement, gradient all-reduce or shards
CHUNKS = 4
PLACES = {  # where a rank hits itself: the method entered, on which call
    "agree": (ProcessWorld, "sum_over_ranks", WARMUP + 1),
    "gradients": (GradientSync, "_launch", WARMUP + 1),  # before its all-reduce starts
    "batch": (ProcessWorld, "gather_objects", 1),
    "settings": (ProcessWorld, "agree", 1),
    "gather": (Stage, "forward", CHUNKS * WARMUP + 1),
    "zero-step": (ZeroRedundancyOptimizer, "step", WARMUP + 1),
    "groups": (world, "join", 1),
    "shutdown": (pipetrain, "shutdown", 1),
    "save": (Checkpointing, "whole", WARMUP + 1),
}

parser = argparse.ArgumentParser()
parser.add_argument("--timeout", type=float, default=3.0)
parser.add_argument("--steps", type=int, default=100_000)
parser.add_argument("--replicas", type=int, default=1)
parser.add_argument("--stages", type=int, default=2, choices=(1, 2))
parser.add_argument("--zero", type=int, default=0)
parser.add_argument("--hit", nargs=3, metavar=("RANK", "SIGNAL", "PLACE"))
parser.add_argument("--save", metavar="FOLDER")
args = parser.parse_args()
if args.hit and args.hit[2] == "shutdown":
    args.steps = WARMUP


def hit(rank: int, signal_name: str, place: str) -> None:
    """Make global rank ``rank`` send itself SIG``signal_name`` as it enters ``place``."""
    owner, name, call = PLACES[place]
    method, calls = getattr(owner, name), [0]

    def hitting(*method_args: Any, **options: Any) -> Any:
        calls[0] += 1
        if calls[0] == call and int(os.environ["RANK"]) == rank:
            print(f"hit {time.time()}", flush=True)
            os.kill(os.getpid(), getattr(signal, f"SIG{signal_name}"))
        return method(*method_args, **options)

    setattr(owner, name, hitting)


torch.set_num_threads(1)
pipetrain.init_distributed()  # the process group keeps its default timeout (600 s)
if args.hit:
    hit(int(args.hit[0]), args.hit[1], args.hit[2])
pipe = pipetrain.Pipeline(mlp(), [12] if args.stages == 1 else [6, 6], chunks=CHUNKS,
                          loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                          timeout=args.timeout, replicas=args.replicas, zero=args.zero)
data = batches(4)
for step in range(args.steps):
    pipe.train_step(*data[step % len(data)])
    if args.save:
        pipe.save(args.save)
    print(f"step {step}", flush=True)
pipetrain.shutdown()
