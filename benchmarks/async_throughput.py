"""PipeDream-2BW against synchronous 1F1B: step time, samples/s and memory (issue 49, item 1).

``"pipedream-2bw"`` steps the optimizer once per mini-batch like 1F1B but never flushes: the
next mini-batch's forwards fill the bubble the flush leaves, at the price of a second weight
version on every stage but the last (the forward of a micro-batch reads the version its
mini-batch started on, the backward differentiates through it). Here both run the same model,
split, micro-batch count and optimizer (AdamW, lr 1e-4, weight decay 0.01; no gradient
clipping, 2BW with stashing and neither prediction nor a delay compensation: the paper's 2BW),
one stage per gloo process, one torch thread per process. Models:

  digits  the MLP of async_digits.py (64-128-128-128-10, 7 layers), split [4, 3] or
          [2, 2, 2, 1], batch 64 of random digit-shaped rows (timing needs no data set)
  gpt     examples.models.gpt(tied=False) (dim 128, 4 blocks, context 128; 2BW refuses a head
          tied to the embedding across stages), split [3, 3] or [2, 1, 1, 2], batch 16 random
          128-token sequences (a sample is a sequence: tokens/s = 128 x samples/s)

Timing (benchmarks/pipeline_timing.py): per (model, stages) one run of ``stages`` processes
holding both schedules at every micro-batch count, rounds rotating between them, ``--steps``
consecutive steps per round; the median over rounds of the slowest rank's per-step time.
"ratio" is 1F1B's time over 2BW's (above 1: 2BW is faster). Memory, per rank (first/.../last,
MiB): weights + their gradients + AdamW's state + the extra weight versions (peak) + the
activations saved for backward (peak, ``track_memory=True``), read after a few untimed steps.

Where a bubble can show: 1F1B's flush idles a rank for (stages - 1) / (chunks + stages - 1) of
a step at most, which only turns into lost time when that rank's core has nothing else to do.
With 2 processes on 2 free cores it does (2 stages: at most 20 % at 4 micro-batches, 11 % at
8); with more processes than cores (4 stages on 2 cores) an idle rank's core runs another
rank, so the bubble's compute is mostly reclaimed by the scheduler: those rows cannot show the
bubble win; on a latency-bound model (digits: a few ms per step) they show what the flush's
extra message round trips cost instead. pipetrain has no knob to delay
its transport (a slow link), so none is emulated.

    python benchmarks/async_throughput.py                        # about 5-10 minutes on 2 cores
    python benchmarks/async_throughput.py --models gpt --stages 2 --chunks 2 4 8
    python benchmarks/async_throughput.py --quick                # seconds: the smoke test's run
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from async_digits import PLAIN, _mlp
from machine_load import cpu_jiffies, load_report
from pipeline_timing import TimingRun, Workload, time_configs

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
BALANCE = {("digits", 2): [4, 3], ("digits", 4): [2, 2, 2, 1],
           ("gpt", 2): [3, 3], ("gpt", 4): [2, 1, 1, 2]}
BATCH = {"digits": 64, "gpt": 16}
CONTEXT = 128
SCHEDULES = {
    "1F1B": dict(schedule="1f1b", recompute="never", optimizer="adamw"),
    "2BW": dict(PLAIN, schedule="pipedream-2bw", recompute="never", optimizer="adamw"),
}
MIB = 2**20


def workload(model: str, stages: int) -> Workload:
    """``model`` split over ``stages`` with its fixed random mini-batch (seed 0)."""
    import torch
    from torch import nn

    g = torch.Generator().manual_seed(0)
    batch, balance = BATCH[model], BALANCE[model, stages]
    if model == "digits":
        x = torch.rand(batch, 64, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        return Workload(_mlp(0), balance, nn.functional.cross_entropy, x, y)
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import models

    ids = torch.randint(0, 256, (batch, CONTEXT + 1), generator=g)
    return Workload(models.gpt(tied=False), balance, models.lm_loss, ids[:, :-1], ids[:, 1:])


def measure(model: str, stages: int, chunks: list[int], rounds: int, steps: int,
            warmup: int) -> dict[str, Any]:
    """Both schedules at every micro-batch count of ``chunks``, in one run of ``stages``
    processes: ``{"times": {(schedule, chunks): s}, "memory": {...: [per rank bytes]}}``."""
    configs = {(name, c): dict(options, chunks=c) for c in chunks
               for name, options in SCHEDULES.items()}
    run = TimingRun(stages, partial(workload, model, stages), configs, rounds, steps,
                    memory=True, warmup=warmup)
    return time_configs(run)


def _per_rank(held: list[dict[str, int]], part: str | None = None) -> str:
    """Each rank's bytes (``part`` of them, else all, gradients counted as the weights) in
    MiB, first/.../last."""
    total = [h[part] if part else sum(h.values()) + h["weights"] for h in held]
    return "/".join(f"{b / MIB:.2f}" for b in total)


def rows(model: str, stages: int, chunks: list[int], result: dict[str, Any]) -> list[str]:
    """The table's rows of one (model, stages) run, one per micro-batch count."""
    out = []
    times, memory = result["times"], result["memory"]
    for c in chunks:
        sync, bw = times["1F1B", c], times["2BW", c]
        batch = BATCH[model]
        out.append(
            f"| {stages} | {model} | {c} | {sync * 1e3:.2f} | {bw * 1e3:.2f} | {sync / bw:.3f} "
            f"| {batch / sync:.1f} | {batch / bw:.1f} | {_per_rank(memory['1F1B', c])} "
            f"| {_per_rank(memory['2BW', c])} | {_per_rank(memory['2BW', c], 'versions')} |"
        )
    return out


HEADER = ("| stages | model | chunks | 1F1B ms/step | 2BW ms/step | ratio | 1F1B samples/s "
          "| 2BW samples/s | 1F1B MiB/rank | 2BW MiB/rank | 2BW versions MiB/rank |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(BATCH), default=list(BATCH))
    parser.add_argument("--stages", nargs="+", type=int, choices=[2, 4], default=[2, 4])
    parser.add_argument("--chunks", nargs="+", type=int, default=[4, 8])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="2 stages, 4 micro-batches, 2 rounds of 2 steps: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.stages, args.chunks, args.rounds, args.steps, args.warmup = [2], [4], 2, 2, 1
    cores = os.cpu_count() or 1
    print(f"1F1B vs PipeDream-2BW, AdamW, one gloo process per stage with one torch thread, "
          f"{cores} CPUs; median of {args.rounds} rounds of {args.steps} steps; ratio = 1F1B "
          f"time / 2BW time; MiB/rank = weights + gradients + AdamW state + extra weight "
          f"versions + saved activations (peaks), first/.../last rank; load average before: "
          f"{os.getloadavg()[0]:.2f}\n")
    before, start = cpu_jiffies(), time.perf_counter()
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    print("\n".join(lines), flush=True)
    for stages in args.stages:
        for model in args.models:
            result = measure(model, stages, args.chunks, args.rounds, args.steps, args.warmup)
            new = rows(model, stages, args.chunks, result)
            print("\n".join(new), flush=True)  # as each run ends; the whole table below
            lines += new
    print("\n" + "\n".join(lines))
    if max(args.stages) > cores:
        print(f"\nnote: {max(args.stages)} processes on {cores} CPUs share cores, so a rank's "
              "bubble is filled by another rank's work: those rows cannot show 2BW's bubble "
              "win (a latency-bound model still saves the flush's round trips).")
    print(load_report(before, cpu_jiffies(), time.perf_counter() - start))


if __name__ == "__main__":
    main()
