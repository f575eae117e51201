"""What ZeRO 0-3 leaves on each rank: bytes of weights, gradients and optimizer state, the
resident growth of one training step and the rank's peak, for 2 stages x 2 and x 4 replicas,
zero 2 and 3 with each ``reduce_scatter`` mode ("step": once per mini-batch; "microbatch":
after every micro-batch's backward), side by side; and the median step time of each row.

    PYTHONPATH=. python benchmarks/zero_memory.py                  # GPT, dim 256, 8 blocks
    PYTHONPATH=. python benchmarks/zero_memory.py --dim 64 --blocks 2 --replicas 2   # quick
    PYTHONPATH=. python benchmarks/zero_memory.py --replicas 2 --schedule zb-h1   # split W

Fresh gloo processes for every row (2 x replicas of them, one thread each) build the example
GPT (examples.models.gpt, untied head: at ZeRO 2 and 3 a tied one stays whole) on the
meta device, each rank materializing its own stage (``init_seed``; at zero 2 and 3 one layer at
a time, each sharded before the next), split evenly in 2 stages, and train it with AdamW, 1F1B
(or ``--schedule``) and 4 micro-batches. The build's growth is the peak resident set while
``Pipeline`` is constructed minus the resident set before. After 3 steps each rank counts the
bytes of the tensors it holds between steps: its weights (the local shard of a sharded one), their
``.grad`` and its optimizer's state (ZeroRedundancyOptimizer's: the local optimizer's). The
step's growth is the peak resident set (VmHWM, reset through /proc/self/clear_refs just before)
of a fourth step minus the resident set (VmRSS) just before it, after glibc's ``malloc_trim``
returned the freed pages (else the step reuses them unseen), with every tensor of 128 KiB or
more in a mapping of its own (MALLOC_MMAP_THRESHOLD_): what the step adds on top of
what is held (gathered weights, whole gradients, activations, buffers of the collectives). Each
column is the largest rank's; "optimizer / zero 0" is that rank's optimizer bytes over zero 0's
of the same replicas. "peak MiB" is the largest rank's held bytes plus its step growth (the
most a rank holds at once in a step). Memory does not depend on timing: one run per row; the
step time is the median of ``--timed`` steps after the measured one (the ranks' slowest, on a
machine shared with other jobs: compare rows of one run only).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import spawn_ranks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import pipetrain
from examples.models import gpt, lm_loss

MiB = 2**20
libc = ctypes.CDLL("libc.so.6")  # glibc's malloc_trim


def _kib(field: str) -> int:
    """A /proc/self/status field in bytes."""
    text = Path("/proc/self/status").read_text()
    found = re.search(rf"^{field}:\s+(\d+) kB", text, re.M)
    assert found is not None, field
    return int(found[1]) * 1024


def _nbytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return local.numel() * local.element_size()


def held(pipe: pipetrain.Pipeline) -> tuple[int, int, int]:
    """This rank's bytes of weights, gradients and optimizer state."""
    weights = grads = state = 0
    for stage in pipe.stages:
        params = list(stage.module.parameters())
        weights += sum(_nbytes(p) for p in params)
        grads += sum(_nbytes(p.grad) for p in params)
        optimizer = stage.optimizer
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            optimizer = optimizer.optim
        if optimizer is not None:
            state += sum(_nbytes(t) for s in optimizer.state.values() for t in s.values()
                         if isinstance(t, torch.Tensor))
    return weights, grads, state


def worker(rank: int, port: int, world: int, zero: int, reduce_scatter: str,
           args: argparse.Namespace, results) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    replicas = world // 2
    model = gpt(dim=args.dim, blocks=args.blocks, heads=4, context=args.context, tied=False,
                device="meta")
    half = len(model) // 2
    libc.malloc_trim(0)
    start = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    pipe = pipetrain.Pipeline(
        model, [half, len(model) - half], chunks=4, replicas=replicas, zero=zero,
        loss_fn=lm_loss, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), timeout=300,
        init_seed=0, schedule=args.schedule, reduce_scatter=reduce_scatter,
    )
    built = _kib("VmHWM") - start
    g = torch.Generator().manual_seed(pipe.placement.replica)
    tokens = torch.randint(0, 256, (args.batch, args.context + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    for _ in range(3):
        pipe.train_step(x, y)
    numbers = held(pipe)
    dist.barrier()
    libc.malloc_trim(0)  # hand freed heap pages back, or the step would reuse them unseen
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    pipe.train_step(x, y)
    growth = _kib("VmHWM") - before
    times = []
    for _ in range(args.timed):
        dist.barrier()
        start_time = time.perf_counter()
        pipe.train_step(x, y)
        times.append(time.perf_counter() - start_time)
    every: list[tuple[float, ...] | None] = [None] * world
    dist.all_gather_object(every, (*numbers, growth, built, statistics.median(times)))
    if rank == 0:
        results.put(every)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="sequences per replica")
    parser.add_argument("--replicas", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--schedule", default="1f1b", help="a synchronous schedule")
    parser.add_argument("--timed", type=int, default=5, help="steps timed per row")
    args = parser.parse_args()
    # glibc: every tensor of 128 KiB or more its own mapping, returned when freed, so that the
    # peak resident set counts what a step holds at once (by default glibc raises this
    # threshold as it goes and keeps freed tensors in per-thread heaps, which gloo's threads
    # then cannot reuse); the ranks inherit it
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))
    params = sum(p.numel() for p in gpt(dim=args.dim, blocks=args.blocks, heads=4,
                                        context=args.context, tied=False).parameters())
    print(f"example GPT, dim {args.dim}, {args.blocks} blocks ({params / 1e6:.1f}M params, "
          f"{params * 4 / MiB:.0f} MiB of fp32 weights), 2 stages, AdamW, {args.schedule}, "
          f"4 micro-batches "
          f"of {args.batch // 4} x {args.context} tokens per replica, gloo, 1 thread per process")
    print("\n| replicas | zero | reduce_scatter | weights MiB | gradients MiB | optimizer MiB | "
          "optimizer / zero 0 | step growth MiB | peak MiB | build growth MiB | step ms |"
          "\n|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(0, "step"), (1, "step"), (2, "step"), (2, "microbatch"), (3, "step"),
            (3, "microbatch")]
    for replicas in args.replicas:
        base = None
        for zero, mode in rows:
            ranks = spawn_ranks(worker, 2 * replicas, 2 * replicas, zero, mode, args)
            weights, grads, state, growth, built, step = (
                max(r[i] for r in ranks) for i in range(6)
            )
            peak = max(sum(r[:4]) for r in ranks)
            base = state if zero == 0 else base
            shown = mode if zero >= 2 else "-"
            print(f"| {replicas} | {zero} | {shown} | {weights / MiB:.1f} | {grads / MiB:.1f} | "
                  f"{state / MiB:.1f} | {state / base:.3f} | {growth / MiB:.1f} | "
                  f"{peak / MiB:.1f} | {built / MiB:.1f} | {step * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
