"""A torchrun job for the resume test: trains ``--steps`` steps, checkpointing every 2; on its
first attempt, rank ``--kill-rank`` SIGKILLs itself after step ``--kill-after``. torchrun
restarts the group, which resumes from the newest checkpoint by itself."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

import pipetrain  # noqa: E402
from tests.runtime.models import batches, mlp, sgd  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--kill-after", type=int, default=-1)
parser.add_argument("--kill-rank", type=int, default=1)
args = parser.parse_args()

rank, world = pipetrain.init_distributed(timeout=60)
torch.set_num_threads(1)
pipe = pipetrain.Pipeline(mlp(), [6, 6], chunks=4, schedule="1f1b", recompute="never",
                          loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=30,
                          checkpoint_dir=args.dir, checkpoint_every=2)
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
print(f"rank {rank} attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')} from step {pipe.step}",
      flush=True)
data = batches(args.steps)
for x, y in data[pipe.step:]:
    pipe.train_step(x, y)
    if first_attempt and rank == args.kill_rank and pipe.step == args.kill_after:
        os.kill(os.getpid(), signal.SIGKILL)
torch.save(pipe.module.state_dict(), Path(args.out) / f"final-rank{rank}.pt")
