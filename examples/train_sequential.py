"""Train an MLP across pipeline stages, one process per stage.

    torchrun --nproc_per_node=2 examples/train_sequential.py            # CPU: gloo
    torchrun --nproc_per_node=4 examples/train_sequential.py --schedule gpipe

Every rank builds the same model from the same seed; each keeps only its stage's layers.
"""

from __future__ import annotations

import argparse
import time

import torch
from data import classifier, teacher_batches
from torch import nn

import pipetrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch")
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--schedule", default="1f1b", choices=["1f1b", "gpipe"])
    parser.add_argument("--recompute", default=None, choices=["never", "except_last", "always"],
                        help="activation recomputation (default: what the schedule needs, "
                        "except_last under gpipe, never under 1f1b)")
    args = parser.parse_args()

    rank, world = pipetrain.init_distributed()
    torch.set_num_threads(1)  # one core per stage on a small machine
    torch.manual_seed(0)
    model = classifier(args.width, args.depth)
    layers = len(model)
    balance = [layers // world + (s < layers % world) for s in range(world)]
    pipe = pipetrain.Pipeline(
        model,
        balance,
        chunks=args.chunks,
        schedule=args.schedule,
        recompute=args.recompute,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-4),
    )
    if rank == 0:
        print(f"{world} stages, balance {balance}, {args.schedule}, {args.chunks} micro-batches")
    start = time.perf_counter()
    for step, (x, y) in enumerate(teacher_batches(args.steps, args.batch, args.width), 1):
        loss = pipe.train_step(x, y)
        if rank == 0 and (step % 10 == 0 or step == 1):
            rate = step * args.batch / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss:.4f}  {rate:8.0f} samples/s")

    x, y = next(iter(teacher_batches(1, 512, args.width, seed=1)))
    logits = pipe.eval_step(x)
    if logits is not None:  # the last stage holds the output
        accuracy = (logits.argmax(dim=1) == y).float().mean().item()
        print(f"held-out accuracy {accuracy:.3f} (chance 0.100)")


if __name__ == "__main__":
    main()
