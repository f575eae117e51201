"""Schedule throughput: pipetrain's interleaved 1F1B, looped BFS, ZB-H1, ZB-H2, interleaved ZB
and ZB-V against its 1F1B and against torch.distributed.pipelining's multi-stage schedules, on
2 and 4 CPU ranks.

Model: 16 blocks of Linear(512, 512) + ReLU (32 layers), batch 128 in 8 micro-batches, MSE loss,
SGD, recompute="never", one torch thread per rank, each rank pinned to its share of the
cores before gloo starts (pipetrain.runtime.distributed.pin_to_cores, as
init_distributed(pin_cores=True) does; --no-pin leaves placement to the OS), ranks joined by gloo
(started here).

  pipetrain-1f1b           p stages of 32/p layers
  pipetrain-interleaved    2p stages of 16/p layers, stage c*p+r on rank r
  pipetrain-looped-bfs     the same 2p stages and placement, each rank's stages breadth first
  pipetrain-zb-h1/-h2      p stages of 32/p layers, backward split into B and W
  pipetrain-interleaved-zb 2p stages placed as interleaved's, backward split
  pipetrain-zbv            2p stages in a V (rank r: stages r, 2p-1-r), backward split
  torch-interleaved-1f1b   ScheduleInterleaved1F1B, same 2p stages, same placement
  torch-interleaved-zb     ScheduleInterleavedZeroBubble, same 2p stages
  torch-looped-bfs         ScheduleLoopedBFS, same 2p stages, same placement
  torch-zbv                ScheduleZBVZeroBubble, 2p stages in a V (rank r: stages r, 2p-1-r)

Variants alternate: every round runs each variant for a few steps, the order rotating from round
to round; a step's time is the slowest rank's; the table gives the median over all timed steps,
and "vs peer" torch's same schedule's median over pipetrain's (interleaved against
ScheduleInterleaved1F1B, looped BFS against ScheduleLoopedBFS, ZB-H1 and interleaved ZB against
ScheduleInterleavedZeroBubble, ZB-H2 and ZB-V against ScheduleZBVZeroBubble). From the traces of
the timed steps: "measured bubble" is 1 - compute / (ranks x step), the step running from its
first action's start to its last action's end on any rank, compute being F+B+W; "simulated" is
the same step's simulated twin (pipetrain.observe.trace.simulated_twin: the schedule simulated
with the step's measured per-stage F, B, W and optimizer-step times, each rank's measured
runtime overhead per action and the step's message latency,
pipetrain.observe.trace.message_latency, and each rank's entry into the step: ranks leave the
barrier before it a few milliseconds apart); "twin step" is the twin's step time over the
measured one; "drawn" is the twin's bubble with each compute and optimizer step taking a time
drawn from those its stage measured for that kind in the step instead of their mean
(simulated_twin(traces, k, rng), mean of DRAWS draws per step): on shared cores an action's time
strays from its stage's mean by a third to a half of it, and a step follows its slow actions,
which the mean hides; all averaged over the timed steps. With 4 ranks on a 2-core machine the
ranks share cores (oversubscribed; pinned round robin, ranks 0 and 2 share one core, 1 and 3 the
other): the twin then runs each pair on its core (processor sharing, with the measured times
converted to full speed; pipetrain.observe.trace.shared_cores and full_speed). Compute times
inflate and bubbles mix with waiting for a core, so compare variants within one rank count, not
across.

    python benchmarks/schedules_throughput.py             # 2 and 4 ranks, about 1-2 minutes
    python benchmarks/schedules_throughput.py --ranks 2 --rounds 3
    python benchmarks/schedules_throughput.py --no-peers   # pipetrain's schedules only
    python benchmarks/schedules_throughput.py --ranks 2 --rounds 20 \
        --variants interleaved,torch-interleaved-1f1b        # one pair, more steps
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import tempfile
from datetime import timedelta

from ranks import spawn_ranks
from timing import rotation

WIDTH, BLOCKS, BATCH, CHUNKS = 512, 16, 128, 8
LAYERS = 2 * BLOCKS
DRAWS = 10  # twins with drawn action times per traced step
PIPETRAIN = ("1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2", "interleaved-zb", "zbv")
TORCH = ("torch-interleaved-1f1b", "torch-interleaved-zb", "torch-zbv", "torch-looped-bfs")
PEER = {  # torch's same schedule
    "interleaved": TORCH[0], "zb-h1": TORCH[1], "zb-h2": TORCH[2], "looped-bfs": TORCH[3],
    "zbv": TORCH[2], "interleaved-zb": TORCH[1],
}


def linear_model():
    """BLOCKS x (Linear(WIDTH) + ReLU), the same weights in every process (async_digits.py
    measures on it too)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def mse(out, target):
    import torch

    return torch.nn.functional.mse_loss(out, target)


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=1e-3)


class _Pipetrain:
    def __init__(self, schedule: str, ranks: int, x, y, trace: str):
        import pipetrain
        from schedules import lookup

        stages = ranks * (2 if lookup(schedule).multi_stage_per_rank else 1)
        self.pipe = pipetrain.Pipeline(
            linear_model(), [LAYERS // stages] * stages, chunks=CHUNKS, schedule=schedule,
            recompute="never", loss_fn=mse, optimizer=_sgd, timeout=120, trace=trace,
        )
        self.x, self.y = x, y

    def step(self) -> None:
        self.pipe.train_step(self.x, self.y)


def _bubbles(folder: str, skip: int) -> dict[str, float]:
    """Means over the traced steps after ``skip`` warm-up steps: the measured bubble fraction,
    that of the step's simulated twin (pipetrain.observe.trace.simulated_twin) with stage means and
    with action times drawn from the stages' measured ones (DRAWS draws), and the stage-mean twin's
    step time over the measured one (first action's start to last action's end)."""
    from pipetrain.observe.trace import load_folder, simulated_twin, step_spans
    from schedules import bubble_fraction

    def extent(spans) -> float:
        return max(s.end for s in spans) - min(s.start for s in spans)

    traces = load_folder(folder)
    rng = random.Random(0)
    steps = range(skip, min(len(t.steps) for t in traces))
    pairs = [(step_spans(traces, k), simulated_twin(traces, k)) for k in steps]
    drawn = [
        bubble_fraction(simulated_twin(traces, k, rng)) for k in steps for _ in range(DRAWS)
    ]
    return {
        "measured": statistics.mean(bubble_fraction(m) for m, _ in pairs),
        "simulated": statistics.mean(bubble_fraction(t) for _, t in pairs),
        "drawn": statistics.mean(drawn),
        "step_ratio": statistics.mean(extent(t) / extent(m) for m, t in pairs),
    }


class _Torch:
    def __init__(self, kind: str, rank: int, ranks: int, x, y):
        import torch
        from torch.distributed.pipelining import (
            PipelineStage,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleLoopedBFS,
            ScheduleZBVZeroBubble,
        )

        stages = 2 * ranks
        mine = [rank, 2 * ranks - 1 - rank] if kind == "torch-zbv" else [rank, rank + ranks]
        model, size = linear_model(), LAYERS // stages
        self.stages = [
            PipelineStage(model[s * size : (s + 1) * size], s, stages, torch.device("cpu"))
            for s in mine
        ]
        self.first, self.last = 0 in mine, stages - 1 in mine
        params = [p for stage in self.stages for p in stage.submod.parameters()]
        self.opt = _sgd(params)
        cls = {
            "torch-interleaved-1f1b": ScheduleInterleaved1F1B,
            "torch-interleaved-zb": ScheduleInterleavedZeroBubble,
            "torch-zbv": ScheduleZBVZeroBubble,
            "torch-looped-bfs": ScheduleLoopedBFS,
        }[kind]
        self.schedule = cls(self.stages, n_microbatches=CHUNKS, loss_fn=mse)
        self.x, self.y = x, y

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.opt.step()


def _rank(
    rank: int, ranks: int, port: int, rounds: int, steps: int, names: list[str], pin: bool,
    out: dict,
) -> None:
    import time

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if pin:
        from pipetrain.runtime.distributed import pin_to_cores

        pin_to_cores(rank, ranks)
    dist.init_process_group("gloo", rank=rank, world_size=ranks, timeout=timedelta(seconds=300))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)
    variants: dict[str, object] = {}
    trace = os.path.join(tempfile.gettempdir(), f"pipetrain-schedules-{port}")  # all ranks'
    for name in [n for n in names if n in PIPETRAIN]:
        variants[name] = _Pipetrain(name, ranks, x, y, f"{trace}/{name}")
    for name in [n for n in names if n in TORCH]:
        try:
            variants[name] = _Torch(name, rank, ranks, x, y)
        except Exception as error:  # an API this torch lacks: report, go on
            if rank == 0:
                print(f"{name}: unavailable ({type(error).__name__}: {error})")
    times: dict[str, list[float]] = {name: [] for name in variants}
    for variant in variants.values():  # warm-up
        for _ in range(2):
            variant.step()  # type: ignore[attr-defined]
    names = list(variants)
    for r in range(rounds):
        for name in rotation(names, r):
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                variants[name].step()  # type: ignore[attr-defined]
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[name].append(float(took))
    rows = {}
    for name, variant in variants.items():
        rows[name] = {"median": statistics.median(times[name])}
        if isinstance(variant, _Pipetrain):
            variant.pipe.save_trace()
    dist.barrier()
    if rank == 0:
        for name in [n for n in names if n in PIPETRAIN]:
            rows[name].update(_bubbles(f"{trace}/{name}", 2))
        out.update(rows)
        shutil.rmtree(trace, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank, port, ranks, rounds, steps, names, pin, results):
    out: dict = {}
    _rank(rank, ranks, port, rounds, steps, names, pin, out)
    if rank == 0:
        results.put(out)


def run(ranks: int, rounds: int, steps: int, names: list[str], pin: bool = True) -> dict:
    return spawn_ranks(_worker, ranks, ranks, rounds, steps, names, pin)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", default="2,4", help="comma-separated rank counts")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    parser.add_argument("--no-peers", action="store_true",
                        help="skip torch.distributed.pipelining's schedules")
    parser.add_argument("--no-pin", action="store_true",
                        help="leave the ranks unpinned (the OS places them and gloo's threads)")
    parser.add_argument("--variants", default=",".join(PIPETRAIN + TORCH),
                        help="comma-separated variants to run (default: all)")
    args = parser.parse_args()
    names = [n for n in args.variants.split(",") if n in PIPETRAIN or not args.no_peers]
    unknown = sorted(set(names) - set(PIPETRAIN + TORCH))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(PIPETRAIN + TORCH)}")
    print(f"model {BLOCKS} x (Linear({WIDTH})+ReLU), batch {BATCH}, {CHUNKS} micro-batches, "
          f"{os.cpu_count()} cores, ranks {'un' if args.no_pin else ''}pinned; median of "
          f"{args.rounds * args.steps} steps per variant")
    for ranks in [int(r) for r in args.ranks.split(",")]:
        rows = run(ranks, args.rounds, args.steps, names, not args.no_pin)
        base = rows.get("1f1b", {}).get("median")
        print(f"\n{ranks} ranks" + (" (oversubscribed: more ranks than cores)"
                                    if ranks > (os.cpu_count() or 1) else ""))
        print(f"{'variant':<26}{'step ms':>9}{'samples/s':>11}{'vs 1f1b':>9}{'vs peer':>9}"
              f"{'bubble measured':>17}{'simulated':>11}{'twin step':>11}{'drawn':>8}")
        for name, row in rows.items():
            label = name if name.startswith("torch") else f"pipetrain-{name}"
            peer = rows.get(PEER.get(name, ""))
            versus = f"{peer['median'] / row['median']:>8.2f}x" if peer else f"{'-':>9}"
            bubble = (f"{row['measured']:>17.1%}{row['simulated']:>11.1%}"
                      f"{row['step_ratio']:>10.2f}x{row['drawn']:>8.1%}"
                      if "measured" in row else f"{'-':>17}{'-':>11}{'-':>11}{'-':>8}")
            against = f"{base / row['median']:>8.2f}x" if base else f"{'-':>9}"
            print(f"{label:<26}{row['median'] * 1e3:>9.1f}{BATCH / row['median']:>11.0f}"
                  f"{against}{versus}{bubble}")


if __name__ == "__main__":
    main()
