"""compile=True's throughput: tokens/s of the example GPT's training step, eager against each
layer compiled (Pipeline(compile=True)), under 1F1B and zb-h1, side by side in one run.

Model and step as benchmarks/gpt_throughput.py's: examples.models.gpt (dim 128, 4 blocks,
context 128, 842k parameters, head tied to the embedding), batch 16 x 128 bytes of the bundled
text in 4 micro-batches, AdamW, fp32, no recomputation, 2 stages of [3, 3] layers. On a CPU: 2
gloo ranks, one torch thread each, pinned to a core each. Under zb-h1 a compiled stage runs its
whole backward in B and its W finds nothing left (pipetrain/runtime/compiled.py).

Variants alternate (benchmarks/timing.py's round robin: every round runs each variant for a few
steps, the order rotating); a step's time is the slowest rank's; the table gives the median over
all timed steps and, apart, the first step of each variant (a compiled one compiles there:
inductor's kernels for each kind of layer, the blocks sharing one graph).

    python benchmarks/compile_throughput.py                     # 2 gloo ranks, about 2 minutes
    python benchmarks/compile_throughput.py --devices cuda:0,cuda:0   # a GPU machine (triton)

With ``--devices`` the two stages run as threads of this process on those devices (one GPU
serves both), each step timed to its loss on the host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from gpt_throughput import _adamw, _imports
from ranks import spawn_ranks
from timing import rotation, round_robin

BATCH, CHUNKS, CONTEXT, RANKS = 16, 4, 128, 2
BALANCE = [3, 3]
SCHEDULES = ("1f1b", "zb-h1")
MODES = ("eager", "compiled")


def _variants(
    schedules: Sequence[str], devices: Sequence[str] | None, device: str
) -> tuple[dict[str, Callable[[], object]], dict[str, float]]:
    """Per variant ("1f1b-compiled", ...), one training step of its own pipeline on the
    same batch, and the seconds of its first step (a compiled one compiles there)."""
    import pipetrain

    models, text = _imports()
    train, _ = text.load_corpus()
    x, y = (t.to(device) for t in next(text.training_batches(train, BATCH, CONTEXT, seed=0)))
    steps: dict[str, Callable[[], object]] = {}
    first: dict[str, float] = {}
    for schedule in schedules:
        for mode in MODES:
            pipe = pipetrain.Pipeline(
                models.gpt(), BALANCE, chunks=CHUNKS, schedule=schedule, recompute="never",
                loss_fn=models.lm_loss, optimizer=_adamw, timeout=900, devices=devices,
                compile=mode == "compiled",
            )
            name = f"{schedule}-{mode}"
            steps[name] = lambda pipe=pipe: float(pipe.train_step(x, y))  # waits for the loss
            start = time.perf_counter()
            steps[name]()
            first[name] = time.perf_counter() - start
            steps[name]()  # a second warm-up step: the compiled backward's last shapes
    return steps, first


def _rank(rank: int, port: int, rounds: int, repeats: int, schedules: list[str],
          results) -> None:
    """One gloo rank of the CPU run; rank 0 reports the medians and first steps."""
    from pipetrain.runtime.distributed import pin_to_cores

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_cores(rank, RANKS)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=900))
    steps, first = _variants(schedules, None, "cpu")
    times = round_robin(steps, rounds, repeats)
    worst = torch.tensor(list(first.values()), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if rank == 0:
        results.put(({n: statistics.median(t) for n, t in times.items()},
                     dict(zip(first, worst.tolist(), strict=True))))
    dist.barrier()
    dist.destroy_process_group()


def _in_threads(devices: list[str], rounds: int, repeats: int, schedules: list[str]
                ) -> tuple[dict[str, float], dict[str, float]]:
    """The same measurement with both stages as threads of this process on ``devices``."""
    steps, first = _variants(schedules, devices, devices[0])
    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in rotation(list(steps), r):
            for _ in range(repeats):
                start = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - start)
    return {n: statistics.median(t) for n, t in times.items()}, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--devices", help="two devices, e.g. cuda:0,cuda:0: stages as threads")
    args = parser.parse_args()
    schedules = args.schedules.split(",")
    if set(schedules) - set(SCHEDULES):
        parser.error(f"schedules from {SCHEDULES}")
    where = args.devices or f"{RANKS} gloo ranks pinned, {os.cpu_count()} cores"
    print(f"GPT 842k parameters, batch {BATCH} x {CONTEXT} tokens in {CHUNKS} micro-batches, "
          f"{where}, torch {torch.__version__}; median of {args.rounds * args.steps} steps "
          "per variant")
    if args.devices:
        medians, first = _in_threads(args.devices.split(","), args.rounds, args.steps,
                                     schedules)
    else:
        medians, first = spawn_ranks(_rank, RANKS, args.rounds, args.steps, schedules)
    tokens = BATCH * CONTEXT
    print(f"{'schedule':<10}{'eager tokens/s':>16}{'compiled tokens/s':>19}{'compiled/eager':>16}"
          f"{'first step eager':>18}{'compiled':>10}")
    for schedule in schedules:
        eager, compiled = medians[f"{schedule}-eager"], medians[f"{schedule}-compiled"]
        print(f"{schedule:<10}{tokens / eager:>16,.0f}{tokens / compiled:>19,.0f}"
              f"{eager / compiled:>15.2f}x{first[f'{schedule}-eager']:>17.1f}s"
              f"{first[f'{schedule}-compiled']:>9.1f}s")


if __name__ == "__main__":
    main()
