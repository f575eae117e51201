"""Train an MLP with every stage in this process, one device per stage (torchgpipe-style).

    python examples/train_local.py                              # two stages on the CPU
    python examples/train_local.py --devices cuda:0 cuda:1      # split across two GPUs
"""

from __future__ import annotations

import argparse

import torch
from data import classifier, teacher_batches
from torch import nn

import pipetrain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", nargs="+", default=["cpu", "cpu"])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=8)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = classifier()
    stages = len(args.devices)
    balance = [len(model) // stages + (s < len(model) % stages) for s in range(stages)]
    pipe = pipetrain.Pipeline(
        model,
        balance,
        chunks=args.chunks,
        devices=args.devices,
        loss_fn=nn.functional.cross_entropy,
        optimizer=lambda params: torch.optim.Adam(params, lr=3e-4),
    )
    for step, (x, y) in enumerate(teacher_batches(args.steps, args.batch, 256), 1):
        loss = pipe.train_step(x, y)
        if step % 10 == 0 or step == 1:
            print(f"step {step:4d}  loss {loss:.4f}")


if __name__ == "__main__":
    main()
