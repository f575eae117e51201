"""Data-parallel overhead: 2 replicas of a 1-stage pipeline against the no-communication bound.

    python benchmarks/data_parallel.py [--rounds 5] [--steps 3]

Two gloo processes, one thread each, alternate in rounds between
  - pipetrain: Pipeline(model, [L], replicas=2): gradients all-reduced in 25 MiB buckets, each
    launched as the last micro-batch's backward produces it;
  - pipetrain, deferred: the same, every bucket all-reduced only after the backward;
  - the bound: each process trains its half of the batch alone (the same 1-stage pipeline in
    single-process mode), no communication;
  - the all-reduce alone: the same buckets all-reduced with nothing else running.
Share of the all-reduce's cost that overlap hides = (deferred - overlapped) / (deferred - bound).
Medians of the per-round medians.
"""

from __future__ import annotations

import argparse
import statistics
from datetime import timedelta

import torch
import torch.distributed as dist
from ranks import spawn_ranks
from timing import median_time
from torch import nn

import pipetrain
from pipetrain.runtime.data_parallel import BUCKET_BYTES


def model(width: int, depth: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(width, width), nn.ReLU())])


def worker(rank: int, port: int, args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=timedelta(seconds=120))
    loss, sgd = nn.functional.mse_loss, lambda ps: torch.optim.SGD(ps, lr=1e-3)
    net = model(args.width, args.depth)
    options = dict(chunks=args.chunks, recompute="never", loss_fn=loss, optimizer=sgd)
    replicated = pipetrain.Pipeline(net, [len(net)], replicas=2, **options)
    deferred = pipetrain.Pipeline(model(args.width, args.depth), [len(net)], replicas=2, **options)
    for sync in deferred.stages[0].syncs:
        sync.overlap = False
    alone = pipetrain.Pipeline(model(args.width, args.depth), [len(net)], devices=["cpu"],
                               **options)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    grads = [p.detach().clone() for p in net.parameters()]
    buckets, size = [[]], 0
    for g in grads:
        if size + g.nbytes > BUCKET_BYTES and buckets[-1]:
            buckets.append([])
            size = 0
        buckets[-1].append(g)
        size += g.nbytes
    flats = [torch.cat([g.reshape(-1) for g in b]) for b in buckets]

    def allreduce() -> None:
        for work in [dist.all_reduce(f, async_op=True) for f in flats]:
            work.wait()

    variants = {
        "pipetrain, 2 replicas": lambda: replicated.train_step(x, y),
        "pipetrain, 2 replicas, deferred all-reduce": lambda: deferred.train_step(x, y),
        "bound: no communication": lambda: alone.train_step(x, y),
        "all-reduce alone": allreduce,
    }
    for fn in variants.values():  # warm-up
        median_time(fn, 2, before=dist.barrier)
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, fn in variants.items():
            rounds[name].append(median_time(fn, args.steps, before=dist.barrier))
    if rank == 0:
        results.put({name: statistics.median(v) for name, v in rounds.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=128, help="per replica")
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    times = spawn_ranks(worker, 2, args)
    pipe, late, bound, reduce = (times[k] for k in times)
    params = sum(p.numel() for p in model(args.width, args.depth).parameters())
    print(f"2 replicas x 1 stage, {args.depth} x Linear({args.width})+ReLU ({params / 1e6:.1f}M "
          f"params, {params * 4 / 2**20:.0f} MiB of gradients), batch {args.batch} per replica, "
          f"{args.chunks} micro-batches, gloo, 1 thread per process")
    print("\n| variant | median step ms | ratio to bound |\n|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / bound:.2f} |")
    hidden = (late - pipe) / (late - bound)
    print(f"\nthroughput vs the no-communication bound: {bound / pipe:.2f} (deferred: "
          f"{bound / late:.2f}); share of the all-reduce's cost hidden by overlap: {hidden:.0%}")


if __name__ == "__main__":
    main()
