"""Schedule throughput and peak activation memory: pipetrain's multi-stage schedules against
torch.distributed.pipelining's same schedules, and its 1F1B and ZB-H1/H2, on 2 and 4 CPU ranks.

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
  pipetrain-v-half/-v-min  the same V, the controllable-memory V schedules (Qi et al. 2024)
  pipetrain-dualpipev      the same V, DualPipeV (its F;B pairs run one after the other on a CPU)
  torch-interleaved-1f1b   ScheduleInterleaved1F1B, same 2p stages, same placement
  torch-interleaved-zb     ScheduleInterleavedZeroBubble, same 2p stages
  torch-looped-bfs         ScheduleLoopedBFS, same 2p stages, same placement
  torch-zbv                ScheduleZBVZeroBubble, 2p stages in a V (rank r: stages r, 2p-1-r)
  torch-dualpipev          ScheduleDualPipeV, the same V (it needs m >= 2p: m=8 runs p <= 4)

"vs peer" is the peer's median step over the variant's, the peer named beside it: torch's same
schedule (interleaved, looped BFS, interleaved ZB, ZBV, DualPipeV); V-Half and V-Min, which torch
lacks, against pipetrain's ZBV; ZB-H1 and ZB-H2 (one stage per rank, no torch twin) against
torch's interleaved zero bubble and ZBV.

Peak activation memory, per rank: each pipetrain variant's second warm-up step (untimed) runs
under torch.autograd.graph.saved_tensors_hooks (:class:`SavedBytes`), which count the bytes of
every tensor autograd saves for backward, parameters left out, a tensor saved by several
operations once, from its save until autograd frees it: what the simulator counts a
stage-micro-batch for (schedules.simulate's peak_inflight: a forward's activations, held until
its backward, or under a split backward its W, frees them). The simulated figure is that peak
per rank times the bytes one micro-batch's forward through one middle stage saves (measured once
per stage size, :func:`stage_microbatch_bytes`). Not counted: output gradients B keeps for W,
received messages' buffers. Expected departures from 1.00: a last stage also saves the loss's
target (one micro-batch of it, 32 KiB, against 160 or 288 KiB per stage-micro-batch); on the V's
bottom rank, stage p-1's output is stage p's input, one tensor counted once.

Variants alternate: every round runs each variant for a few steps, the order rotating from round
to round; a step's time is the slowest rank's; the table gives the median over all timed steps,
and "vs peer" as above. From the traces of
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

    python benchmarks/schedules_throughput.py             # 2 and 4 ranks, about 5 minutes
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
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from machine_load import cpu_jiffies, load_report
from ranks import spawn_ranks
from timing import rotation

if TYPE_CHECKING:
    import torch

    from schedules import Schedule, Span

WIDTH, BLOCKS, BATCH, CHUNKS = 512, 16, 128, 8
LAYERS = 2 * BLOCKS
DRAWS = 10  # twins with drawn action times per traced step
PIPETRAIN = (
    "1f1b", "interleaved", "looped-bfs", "zb-h1", "zb-h2", "interleaved-zb", "zbv", "v-half",
    "v-min", "dualpipev",
)
TORCH = (
    "torch-interleaved-1f1b", "torch-interleaved-zb", "torch-zbv", "torch-looped-bfs",
    "torch-dualpipev",
)
PEER = {  # torch's same schedule; v-half and v-min have none: pipetrain's zbv instead
    "interleaved": "torch-interleaved-1f1b", "looped-bfs": "torch-looped-bfs",
    "interleaved-zb": "torch-interleaved-zb", "zbv": "torch-zbv", "dualpipev": "torch-dualpipev",
    "v-half": "zbv", "v-min": "zbv",
    # one stage per rank: torch has no such zero bubble; its nearest multi-stage ones
    "zb-h1": "torch-interleaved-zb", "zb-h2": "torch-zbv",
}
V_PLACED = ("torch-zbv", "torch-dualpipev")  # rank r holds stages r and 2p-1-r


def linear_model() -> torch.nn.Sequential:
    """BLOCKS x (Linear(WIDTH) + ReLU), the same weights in every process (async_digits.py
    measures on it too)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.nn.functional.mse_loss(out, target)


def _sgd(params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    import torch

    return torch.optim.SGD(params, lr=1e-3)


class _Pipetrain:
    def __init__(
        self, schedule: str, ranks: int, x: torch.Tensor, y: torch.Tensor, trace: str
    ):
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

    def extent(spans: list[Span]) -> float:
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


class _Held:
    """One saved tensor in autograd's graph, charged to its counter until the graph drops it."""

    __slots__ = ("counter", "key", "tensor")

    def __init__(self, counter: SavedBytes, tensor: Any):
        # detached: a saved output holding its own grad_fn would be a cycle through autograd's
        # graph that nothing frees while a split backward retains the graph
        self.counter, self.tensor = counter, tensor.detach()
        self.key = (tensor.data_ptr(), tensor.nbytes)
        counter.add(self.key)

    def __del__(self) -> None:
        self.counter.drop(self.key)


class SavedBytes:
    """The activation bytes alive in autograd's saved tensors of this process, and their peak.

    Every tensor a forward saves for backward counts, but the parameters (and views of them);
    a distinct tensor (address, size) counts once however many operations save it, from when it
    is saved until autograd frees its saved variable (a whole backward, or under a split
    backward the graph dropped after W). This is what the simulator counts a stage-micro-batch
    for: a forward's saved activations, held until they are all freed."""

    def __init__(self, params: Iterable[Any] = ()):
        self.params = {p.untyped_storage().data_ptr() for p in params}
        self.refs: dict[tuple[int, int], int] = {}
        self.live = self.peak = 0

    def add(self, key: tuple[int, int]) -> None:
        """One more saved reference to the tensor ``key``."""
        self.refs[key] = self.refs.get(key, 0) + 1
        if self.refs[key] == 1:
            self.live += key[1]
            self.peak = max(self.peak, self.live)

    def drop(self, key: tuple[int, int]) -> None:
        """One saved reference to ``key`` freed."""
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= key[1]

    def _pack(self, tensor: Any) -> Any:
        if tensor.untyped_storage().data_ptr() in self.params:
            return tensor
        return _Held(self, tensor)

    @contextmanager
    def counting(self) -> Iterator[SavedBytes]:
        """Count what autograd saves inside the block (and frees, whenever it does)."""
        import torch

        def unpack(held: Any) -> Any:
            return held.tensor if isinstance(held, _Held) else held

        with torch.autograd.graph.saved_tensors_hooks(self._pack, unpack):
            yield self


def stage_microbatch_bytes(layers: int) -> int:
    """The bytes one micro-batch's forward through a middle stage of ``layers`` layers saves
    (its input, which the first Linear saves, and every ReLU's output; no loss)."""
    import torch

    stage = linear_model()[:layers]
    counter = SavedBytes(stage.parameters())
    x = torch.randn(BATCH // CHUNKS, WIDTH, requires_grad=True)
    with counter.counting():
        out = stage(x)
    del out
    return counter.peak


def simulated_peaks(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the simulator's most stage-micro-batches in flight under ``schedule``."""
    from schedules import simulate

    weight = 1.0 if schedule.splits_backward else None
    return simulate(schedule, 1.0, 1.0, weight=weight).peak_inflight


class _Torch:
    def __init__(self, kind: str, rank: int, ranks: int, x: torch.Tensor, y: torch.Tensor):
        import torch
        from torch.distributed.pipelining import (
            PipelineStage,
            ScheduleDualPipeV,
            ScheduleInterleaved1F1B,
            ScheduleInterleavedZeroBubble,
            ScheduleLoopedBFS,
            ScheduleZBVZeroBubble,
        )

        stages = 2 * ranks
        mine = [rank, 2 * ranks - 1 - rank] if kind in V_PLACED else [rank, rank + ranks]
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
            "torch-dualpipev": ScheduleDualPipeV,
        }[kind]
        self.schedule = cls(self.stages, n_microbatches=CHUNKS, loss_fn=mse)
        self.x, self.y = x, y

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        self.opt.step()


def _build(
    rank: int, ranks: int, names: list[str], trace: str, x: torch.Tensor, y: torch.Tensor
) -> dict[str, Any]:
    """The variants named, pipetrain's first; a torch schedule this torch lacks is reported and
    left out."""
    variants: dict[str, Any] = {}
    for name in [n for n in names if n in PIPETRAIN]:
        variants[name] = _Pipetrain(name, ranks, x, y, f"{trace}/{name}")
    for name in [n for n in names if n in TORCH]:
        try:
            variants[name] = _Torch(name, rank, ranks, x, y)
        except Exception as error:  # an API this torch lacks: report, go on
            if rank == 0:
                print(f"{name}: unavailable ({type(error).__name__}: {error})")
    return variants


def _warm_up(variants: dict[str, Any], rank: int, ranks: int) -> dict[str, list[int]]:
    """Two untimed steps of each variant; a pipetrain variant's second one under
    :class:`SavedBytes`. Returns, per pipetrain variant, each rank's peak saved bytes."""
    import torch
    import torch.distributed as dist

    peaks: dict[str, list[int]] = {}
    for name, variant in variants.items():
        variant.step()
        if not isinstance(variant, _Pipetrain):
            variant.step()
            continue
        with SavedBytes(variant.pipe.module.parameters()).counting() as counter:
            variant.step()
        mine = torch.zeros(ranks, dtype=torch.float64)
        mine[rank] = counter.peak
        dist.all_reduce(mine)
        peaks[name] = [int(v) for v in mine]
    return peaks


def _timed(variants: dict[str, Any], rounds: int, steps: int) -> dict[str, list[float]]:
    """Alternating rounds: each variant ``steps`` steps per round, the order rotating; a step's
    time is the slowest rank's."""
    import torch
    import torch.distributed as dist

    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(rounds):
        for name in rotation(list(variants), r):
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                variants[name].step()
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[name].append(float(took))
    return times


def _memory_row(variant: _Pipetrain, peaks: list[int]) -> dict[str, Any]:
    """Measured peak saved bytes per rank beside the simulator's peak in-flight
    stage-micro-batches per rank times one stage-micro-batch's bytes."""
    schedule = variant.pipe.schedule
    unit = stage_microbatch_bytes(LAYERS // schedule.stages)
    inflight = simulated_peaks(schedule)
    return {"measured_bytes": peaks, "inflight": list(inflight), "unit_bytes": unit}


def _rank(
    rank: int, ranks: int, port: int, rounds: int, steps: int, names: list[str], pin: bool,
    out: dict[str, Any],
) -> None:
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
    trace = os.path.join(tempfile.gettempdir(), f"pipetrain-schedules-{port}")  # all ranks'
    variants = _build(rank, ranks, names, trace, x, y)
    peaks = _warm_up(variants, rank, ranks)
    times = _timed(variants, rounds, steps)
    rows: dict[str, dict[str, Any]] = {}
    for name, variant in variants.items():
        rows[name] = {"median": statistics.median(times[name])}
        if isinstance(variant, _Pipetrain):
            variant.pipe.save_trace()
    dist.barrier()
    if rank == 0:
        for name, variant in variants.items():
            if isinstance(variant, _Pipetrain):
                rows[name].update(_bubbles(f"{trace}/{name}", 2))
                rows[name].update(_memory_row(variant, peaks[name]))
        out.update(rows)
        shutil.rmtree(trace, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def _worker(
    rank: int, port: int, ranks: int, rounds: int, steps: int, names: list[str], pin: bool,
    results: Any,
) -> None:
    """One rank; rank 0 puts the rows on ``results``."""
    out: dict[str, Any] = {}
    _rank(rank, ranks, port, rounds, steps, names, pin, out)
    if rank == 0:
        results.put(out)


def run(
    ranks: int, rounds: int, steps: int, names: list[str], pin: bool = True
) -> dict[str, dict[str, Any]]:
    """Every variant named on ``ranks`` ranks: rank 0's rows."""
    rows: dict[str, dict[str, Any]] = spawn_ranks(_worker, ranks, ranks, rounds, steps, names, pin)
    return rows


def _label(name: str) -> str:
    return name if name.startswith("torch") else f"pipetrain-{name}"


def _print_throughput(rows: dict[str, dict[str, Any]]) -> None:
    """The step times, "vs 1f1b", "vs peer" (naming the peer) and the traces' bubbles."""
    base = rows.get("1f1b", {}).get("median")
    print(f"{'variant':<26}{'step ms':>9}{'samples/s':>11}{'vs 1f1b':>9}{'vs peer':>9}"
          f"  {'peer':<24}{'bubble measured':>17}{'simulated':>11}{'twin step':>11}"
          f"{'drawn':>8}")
    for name, row in rows.items():
        peer = rows.get(PEER.get(name, ""))
        versus = f"{peer['median'] / row['median']:>8.2f}x" if peer else f"{'-':>9}"
        named = _label(PEER[name]) if peer else "-"
        bubble = (f"{row['measured']:>17.1%}{row['simulated']:>11.1%}"
                  f"{row['step_ratio']:>10.2f}x{row['drawn']:>8.1%}"
                  if "measured" in row else f"{'-':>17}{'-':>11}{'-':>11}{'-':>8}")
        against = f"{base / row['median']:>8.2f}x" if base else f"{'-':>9}"
        print(f"{_label(name):<26}{row['median'] * 1e3:>9.1f}{BATCH / row['median']:>11.0f}"
              f"{against}{versus}  {named:<24}{bubble}")


def _print_memory(rows: dict[str, dict[str, Any]]) -> None:
    """Per pipetrain variant and rank: the measured peak saved bytes, the simulator's peak
    in-flight stage-micro-batches times one stage-micro-batch's bytes, and their ratio."""
    print(f"\n{'peak activations per rank':<26}{'KiB per stage-mb':>17}{'simulated mbs':>16}"
          f"{'simulated KiB':>22}{'measured KiB':>22}{'measured / simulated':>26}")
    for name, row in rows.items():
        if "measured_bytes" not in row:
            continue
        unit, counts, got = row["unit_bytes"], row["inflight"], row["measured_bytes"]
        ratios = " ".join(f"{g / (c * unit):.2f}" for g, c in zip(got, counts, strict=True))
        print(f"{_label(name):<26}{unit / 1024:>17.0f}{' '.join(map(str, counts)):>16}"
              f"{' '.join(f'{c * unit / 1024:.0f}' for c in counts):>22}"
              f"{' '.join(f'{g / 1024:.0f}' for g in got):>22}{ratios:>26}")


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
    started, before = time.monotonic(), cpu_jiffies()
    for ranks in [int(r) for r in args.ranks.split(",")]:
        rows = run(ranks, args.rounds, args.steps, names, not args.no_pin)
        print(f"\n{ranks} ranks" + (" (oversubscribed: more ranks than cores)"
                                    if ranks > (os.cpu_count() or 1) else ""))
        _print_throughput(rows)
        _print_memory(rows)
    print("\n" + load_report(before, cpu_jiffies(), time.monotonic() - started))


if __name__ == "__main__":
    main()
