"""Tokens/s of the example GPT at 2 stages x 2 replicas under ZeRO 0, 1, 2 and 3, side by side in
one run, with the bytes each level sends per rank and step.

    PYTHONPATH=. python benchmarks/zero_throughput.py                # about 3-5 minutes on 2 cores
    PYTHONPATH=. python benchmarks/zero_throughput.py --rounds 2 --steps 2   # a quick look

Four gloo processes (one thread each) build one pipeline per level of the example GPT
(examples.models.gpt: dim 128, 4 blocks, context 128, as train_gpt.py's default but with an
untied head: at ZeRO 2 and 3 a tied one stays whole, with an all-reduce of its own), split
[3, 3], 1F1B, 4 micro-batches of 4 x 128 tokens per replica, AdamW, clip 1.0. Variants alternate in
rounds (the order rotating), each timed for a few steps after a barrier; a step's time is the
slowest rank's; the table gives medians. "sent per rank" is what the replica collectives carry
for one stage of P parameter bytes at r replicas and m micro-batches, by ring algorithms (each
of all-reduce's two halves, a reduce-scatter and an all-gather, moves (r - 1) / r of the
tensor):

    zero 0: all-reduce of the gradients                    2 (r-1)/r P
    zero 1: the same, and the updated weights broadcast    3 (r-1)/r P
    zero 2: reduce-scatter, all-gather once per step       2 (r-1)/r P
    zero 3: reduce-scatter, all-gather per F and per B     (2m + 1) (r-1)/r P
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from ranks import spawn_ranks
from timing import rotation

import pipetrain
from examples.models import gpt, lm_loss

LEVELS = (0, 1, 2, 3)
STAGES, REPLICAS, CHUNKS = 2, 2, 4


def collective_bytes(zero: int, stage_bytes: int, replicas: int, microbatches: int) -> float:
    """Bytes one rank sends over its replica group per step (module docstring)."""
    share = (replicas - 1) / replicas * stage_bytes
    return {0: 2, 1: 3, 2: 2, 3: 2 * microbatches + 1}[zero] * share


def worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    world = STAGES * REPLICAS
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    pipes = {
        zero: pipetrain.Pipeline(
            gpt(dim=128, blocks=4, heads=4, context=128, tied=False, seed=0), [3, 3],
            chunks=CHUNKS, replicas=REPLICAS, zero=zero, clip_grad_norm=1.0, loss_fn=lm_loss,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), timeout=300,
        )
        for zero in LEVELS
    }
    g = torch.Generator().manual_seed(pipes[0].placement.replica)
    tokens = torch.randint(0, 256, (args.batch, 129), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for pipe in pipes.values():  # warm-up: optimizer state, FSDP2's lazy set-up
        pipe.train_step(x, y)
    times: dict[int, list[float]] = {zero: [] for zero in LEVELS}
    for round_ in range(args.rounds):
        for zero in rotation(list(LEVELS), round_):
            for _ in range(args.steps):
                dist.barrier()
                start = time.perf_counter()
                pipes[zero].train_step(x, y)
                took = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's
                times[zero].append(float(took))
    if rank == 0:
        stage = sum(p.numel() * p.element_size() for p in pipes[0].stages[0].module.parameters())
        results.put(({z: statistics.median(t) for z, t in times.items()}, stage))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=16, help="sequences per replica")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    medians, stage_bytes = spawn_ranks(worker, STAGES * REPLICAS, args)
    tokens = args.batch * 128 * REPLICAS
    print(f"example GPT (dim 128, 4 blocks, untied head), {STAGES} stages x {REPLICAS} replicas, "
          f"1F1B, {CHUNKS} micro-batches, {tokens} tokens per step, AdamW, clip 1.0, gloo, "
          f"1 thread per process; stage 0: {stage_bytes / 2**20:.1f} MiB of weights")
    print("\n| zero | median step ms | tokens/s | vs zero 0 | sent per rank and step (MiB) |"
          "\n|---|---|---|---|---|")
    for zero, t in medians.items():
        sent = collective_bytes(zero, stage_bytes, REPLICAS, CHUNKS) / 2**20
        print(f"| {zero} | {t * 1e3:.0f} | {tokens / t:.0f} | {medians[0] / t:.2f} | "
              f"{sent:.1f} |")


if __name__ == "__main__":
    main()
