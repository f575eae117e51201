"""Plan accuracy under ZeRO (issue 48, item 3, the section benchmarks/plan_accuracy.py cannot
run: replicas are processes, its grid runs threads): the planner's predicted step time and
per-rank memory against measured ones for the example GPT of that grid as one stage on 2
data-parallel replicas (2 gloo processes sharing the 2 cores, one torch thread each), at zero
0 to 3 and, at 2 and 3, each ``reduce_scatter`` mode.

Prediction: ``partitioner.plan`` (stages=1, data_parallel=2: two copies of the pipeline, as
the runtime's replicas are; the row's zero and mode) on the GPT's profile, told the host (2
cores, the runtime's seconds per action calibrated as plan_accuracy does) and the all-reduce's
bandwidth, measured in the ranks first (the median of 5 all-reduces of 4 MiB: bytes over
seconds, the planner's ring with 2 members moving each byte once). Each round of steps starts
with both ranks profiling the model at once (so that the other core is busy, as in the run; at
the micro-batch size, each layer's fixed time fitted from a second profile); a row's predicted
step is the median over rounds of the step planned on rank 0's profile of that round. Memory:
the stage's ``memory_bytes``.

Measurement: both ranks build every row's Pipeline (1F1B, 4 micro-batches, AdamW, fresh
weights, ``track_memory``), warm each ``--warmup`` steps, then run ``--rounds`` rounds of one
step of each row in a rotating order; a row's time is the median of its slowest rank's steps.
A rank's memory is its peak in a step as benchmarks/zero_memory.py measures it: the bytes of
the tensors it holds between steps (weights, the local shards of sharded ones, their
gradients, the optimizer's state) plus the growth of its resident set in one more step
(everything the step adds: activations, gathered weights, whole gradients, the collectives'
buffers, allocator slack). Beside it, the tensors alone: the held bytes plus the peak its
ledger saw saved for backward, which misses what FSDP2 gathers inside a step.

    PYTHONPATH=. python benchmarks/plan_accuracy_zero.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for where in (ROOT, ROOT / "benchmarks"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))

from machine_load import cpu_jiffies, load_report  # noqa: E402
from plan_accuracy import MIB, TARGET_ERROR, build, calibrate_overhead, profile_of  # noqa: E402
from ranks import spawn_ranks  # noqa: E402
from timing import rotation  # noqa: E402

REPLICAS = 2
ROWS = [(0, "step"), (1, "step"), (2, "step"), (2, "microbatch"), (3, "step"),
        (3, "microbatch")]


def _allreduce_bandwidth() -> float:
    """Bytes per second of one all-reduce of 4 MiB over the default group (median of 5)."""
    import torch
    import torch.distributed as dist

    tensor = torch.ones(MIB)  # 4 MiB of fp32
    times = []
    for _ in range(6):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor)
        times.append(time.perf_counter() - start)
    return tensor.nbytes / statistics.median(times[1:])


def _memory(pipe: Any, x: Any, y: Any) -> tuple[int, int]:
    """This rank's memory by tensors (held bytes, zero_memory.held, and the peak its ledgers
    saw saved) and by its resident set (held bytes and one more step's growth, as
    zero_memory measures it: everything a step adds, gathered weights and buffers too)."""
    from zero_memory import _kib, held, libc

    kept = sum(held(pipe))
    libc.malloc_trim(0)
    before = _kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    pipe.train_step(x, y)
    growth = _kib("VmHWM") - before
    return kept + sum(stage.ledger.peak_bytes for stage in pipe.stages), kept + growth


def worker(rank: int, port: int, world: int, args: argparse.Namespace, results: Any) -> None:
    """One replica: the bandwidth, then every row built, warmed and stepped in rounds."""
    import torch
    import torch.distributed as dist

    import pipetrain
    from examples.models import lm_loss

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    bandwidth = _allreduce_bandwidth()
    pipes = []
    for zero, mode in ROWS:
        model, x, y, _ = build("gpt", args.batch, args.seq)
        pipes.append(pipetrain.Pipeline(
            model, [len(model)], chunks=args.chunks, replicas=REPLICAS, zero=zero,
            reduce_scatter=mode, loss_fn=lm_loss, timeout=300, track_memory=True,
            optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4),
        ))
    for pipe in pipes:
        for _ in range(args.warmup):
            pipe.train_step(x, y)
    times: list[list[float]] = [[] for _ in ROWS]
    profiles = []
    for r in range(args.rounds):
        dist.barrier()
        profiles.append(profile_of("gpt", _profiling(args)).to_json())
        for k in rotation(list(range(len(ROWS))), r):
            dist.barrier()
            start = time.perf_counter()
            pipes[k].train_step(x, y)
            times[k].append(time.perf_counter() - start)
    mine = (bandwidth, times, [_memory(pipe, x, y) for pipe in pipes], profiles)
    every: list[Any] = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        results.put(every)
    dist.destroy_process_group()


def _profiling(args: argparse.Namespace) -> argparse.Namespace:
    """plan_accuracy.profile_of's settings: the micro-batch size, fixed times fitted from a
    second size, no co-running thread (the other rank is a process, profiling too)."""
    return argparse.Namespace(batch=args.batch, seq=args.seq,
                              chunks=[args.chunks, args.chunks // 2], fixed_times=True,
                              profile_load="idle", profile_repeats=args.profile_repeats)


def predicted(profile: Any, args: argparse.Namespace, zero: int, mode: str, bandwidth: float,
              overhead: float) -> Any:
    """The planner's plan of the row: one stage, the pipeline copied on the 2 replicas
    (``data_parallel``: each copy runs every micro-batch of its own rows, as the runtime's
    ``replicas`` do; ``devices`` would replicate the stage, splitting each micro-batch)."""
    from partitioner import plan

    return plan(profile, stages=1, data_parallel=REPLICAS, microbatches=args.chunks,
                microbatch_size=args.batch // args.chunks, checkpoint="never", zero=zero,
                reduce_scatter=mode, bandwidth=bandwidth, cores=args.cores, overhead=overhead)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16, help="rows per replica (default 16)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--chunks", type=int, default=4, help="micro-batches (default 4)")
    ap.add_argument("--cores", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--profile-repeats", type=int, default=10)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    started, before = time.monotonic(), cpu_jiffies()
    overhead = calibrate_overhead(steps=15)
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(128 * 1024))  # as zero_memory.py
    ranks = spawn_ranks(worker, REPLICAS, REPLICAS, args)
    bandwidth = statistics.median(r[0] for r in ranks)
    print(f"example GPT (plan_accuracy's), 1 stage x {REPLICAS} replicas (gloo processes, "
          f"{args.cores} cores), 1F1B, {args.chunks} micro-batches of "
          f"{args.batch // args.chunks} x {args.seq} tokens per replica, AdamW; all-reduce "
          f"{bandwidth / 1e9:.2f} GB/s, overhead {overhead * 1e3:.3f} ms per action; median of "
          f"{args.rounds} steps after {args.warmup} warm, rows interleaved\n")
    print("| zero | reduce_scatter | predicted ms | measured ms | time error | predicted MiB | "
          "measured peak MiB (rank 0/1) | memory error (rank 0/1) | tensors MiB (rank 0/1) |"
          "\n|---|---|---|---|---|---|---|---|---|")
    time_errors, memory_errors = [], []
    from partitioner import Profile

    profiles = [Profile.from_json(text) for text in ranks[0][3]]
    for k, (zero, mode) in enumerate(ROWS):
        made = predicted(profiles[0], args, zero, mode, bandwidth, overhead)
        step = statistics.median(predicted(p, args, zero, mode, bandwidth, overhead).step_time
                                 for p in profiles)
        steps = [max(r[1][k][i] for r in ranks) for i in range(args.rounds)]
        measured = statistics.median(steps)
        tensors = [r[2][k][0] for r in ranks]
        memory = [r[2][k][1] for r in ranks]
        want = made.per_stage[0].memory_bytes
        errors = [(want - m) / m for m in memory]
        time_errors.append((step - measured) / measured)
        memory_errors += errors
        print(f"| {zero} | {mode if zero >= 2 else '-'} | {step * 1e3:.1f} | "
              f"{measured * 1e3:.1f} | {time_errors[-1]:+.1%} | {want / MIB:.1f} | "
              f"{'/'.join(f'{m / MIB:.1f}' for m in memory)} | "
              f"{'/'.join(f'{e:+.1%}' for e in errors)} | "
              f"{'/'.join(f'{m / MIB:.1f}' for m in tensors)} |")
    for what, errors in (("step time", time_errors), ("memory per rank", memory_errors)):
        med = statistics.median(abs(e) for e in errors)
        worst = max(errors, key=abs)
        print(f"{what}: median |error| {med:.1%} (target <= {TARGET_ERROR:.0%}: "
              f"{'PASS' if med <= TARGET_ERROR else 'FAIL'}), worst {worst:+.1%}")
    print(load_report(before, cpu_jiffies(), time.monotonic() - started))
    return 0


if __name__ == "__main__":
    sys.exit(main())
