"""Plan accuracy: the planner's predicted step time and per-rank peak memory against measured
ones, configuration by configuration, and the planner's pick against the best of the measured
grid (issue 48, item 3).

Space (per model): the runnable synchronous schedules asked for (default gpipe, 1f1b, zb-h1,
interleaved) x micro-batch counts (default 2, 4, 8 of a mini-batch of 16) x recomputation
("never", "always") on 2 pipeline ranks, each point split by the planner's search
(``partitioner.search.candidates``, unpruned, ``Settings(checkpoint=..., host=...)``). Models:
the example GPT (``examples.models.gpt``, untied head) and a byte-level Hugging Face Llama
built from the tests' config (``tests.hf.models.LLAMA_LIKE``, widened), both 4 blocks.

Prediction: the plan's ``step_time`` (the schedule simulator on the profile's per-layer costs,
scaled from the profiled micro-batch to the point's: each layer's fixed part, fitted from a
second profile at the grid's largest micro-batch by ``partitioner.with_fixed_times``, whole, the
rest in proportion; the profiles taken while another thread trains a copy of the model, as
the other rank will, ``--profile-load busy``), told the host: 2 ranks sharing
``--cores`` cores and the runtime's own seconds per action (``overhead``), calibrated once
before the grid on a pipeline of two 4x4 Linear stages (1F1B, 4 micro-batches): its median
step divided by the step the simulator gives that pipeline at zero compute and one second per
action. Memory: each stage's ``memory_bytes`` (weights, gradients, Adam state, the activations
the schedule keeps, the inputs it holds), summed over the stages a rank holds.

Measurement: every rank is a thread of this process (``devices=["cpu", "cpu"]``, one torch
thread each); a fresh model per configuration; all of a model's configurations built first,
warmed ``--warmup`` steps each, then ``--rounds`` rounds of one step of each configuration in
a rotating order (so that other load on the machine hits all of them alike); the time is
the median of a configuration's ``pipe.metrics["step_time"]``. A rank's peak memory is
counted from its tensors, not from the process (threads share one resident set): its
parameters, their gradients and the optimizer's state (bytes of the tensors held after a
step), plus the peak of what its stages' ledgers (``track_memory``) saw saved for backward
(stage inputs included). Left out of the measurement: allocator slack, temporaries inside a
layer and, under recomputation, the one micro-batch's activations rebuilt in the backward.

ZeRO is not covered: it shards over data-parallel replicas, which the runtime runs only as
processes, and this grid runs threads (see docs/plan-accuracy.md).

    PYTHONPATH=. python benchmarks/plan_accuracy.py            # full grid, a few minutes
    PYTHONPATH=. python benchmarks/plan_accuracy.py --quick    # 2 configurations, smoke
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for where in (ROOT, ROOT / "benchmarks"):
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))  # examples, tests.hf and the shared helpers

from machine_load import cpu_jiffies, load_report  # noqa: E402
from timing import rotation  # noqa: E402

RANKS, TARGET_ERROR, TARGET_CHOICE = 2, 0.10, 0.05
MIB = 2**20


@dataclass
class Row:
    """One configuration: what the plan predicts and what its run measured."""

    model: str
    plan: Any  # partitioner.Plan
    recompute: str
    times: list[float] = field(default_factory=list)
    busy: list[list[float]] = field(default_factory=list)  # per step, each rank's compute
    held: list[int] = field(default_factory=list)  # per stage: weights, gradients, state
    saved: list[tuple[int, int]] = field(default_factory=list)  # per stage: ledger peak, k
    memory: list[int] = field(default_factory=list)  # measured, per rank
    predictions: list[float] = field(default_factory=list)  # per round, on its own profile
    planned_compute: list[float] = field(default_factory=list)  # the same: the ranks' compute

    @property
    def key(self) -> tuple[str, str, int, tuple[int, ...]]:
        return self.model, self.schedule, self.chunks, tuple(self.plan.balance)

    @property
    def schedule(self) -> str:
        return str(self.plan.schedule)

    @property
    def chunks(self) -> int:
        return int(self.plan.microbatches)

    @property
    def predicted(self) -> float:
        """The median over rounds of the step predicted on that round's profile (the plan's
        own prediction where the profile was taken once, before the grid)."""
        if self.predictions:
            return statistics.median(self.predictions)
        return float(self.plan.step_time)

    def predict_on(self, profile: Any, host: Any) -> None:
        """Record the planner's step for this row's split on ``profile`` (its cost model and
        simulator, as in the search: equal to ``plan.step_time`` on the plan's profile) and
        the ranks' compute it counts."""
        from partitioner import simulate_split, stage_costs

        how = dict(microbatches=self.chunks, schedule=self.schedule,
                   microbatch_size=self.plan.microbatch_size, checkpoint=self.recompute)
        self.predictions.append(simulate_split(profile, self.plan.balance, host=host,
                                               **how).step_time)
        costs = stage_costs(profile, self.plan.balance, **how)
        self.planned_compute.append(sum(c.compute for c in costs) * self.chunks)

    @property
    def measured(self) -> float:
        return statistics.median(self.times) if self.times else math.nan

    @property
    def fastest(self) -> float:
        return min(self.times) if self.times else math.nan

    @property
    def time_error(self) -> float:
        return (self.predicted - self.measured) / self.measured

    def compute_ratio(self) -> float:
        """The ranks' compute seconds inside the run (the executors' busy time: step time
        less bubble) over what the profile says they compute, both summed over the ranks."""
        planned = (statistics.median(self.planned_compute) if self.planned_compute
                   else sum(s.compute_time for s in self.plan.per_stage) * self.chunks)
        ran = statistics.median(sum(step) for step in self.busy)
        return ran / planned

    def predicted_memory(self) -> list[int]:
        """Bytes per rank: the plan's stages on it summed."""
        held = [0] * RANKS
        for stage in self.plan.per_stage:
            for rank in stage.ranks:
                held[rank] += stage.memory_bytes
        return held

    def memory_errors(self) -> list[float]:
        return [(p - m) / m for p, m in zip(self.predicted_memory(), self.memory, strict=True)]


# -- the models --------------------------------------------------------------------------------


def _adam(params):
    import torch

    return torch.optim.Adam(params, lr=1e-4)


def build(name: str, batch: int, seq: int) -> tuple[Any, Any, Any, Any]:
    """(model, x, y, loss_fn) of ``name``: "gpt" or "llama"."""
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (batch, seq + 1), generator=g)
    if name == "gpt":
        from examples.models import gpt, lm_loss

        model = gpt(vocab=256, dim=128, blocks=4, heads=4, context=seq, tied=False)
        return model, ids[:, :-1], ids[:, 1:], lm_loss
    if name == "llama":
        import transformers

        import pipetrain.hf
        from tests.hf.models import LLAMA_LIKE

        config = transformers.LlamaConfig(**{
            **LLAMA_LIKE, "vocab_size": 256, "hidden_size": 128, "intermediate_size": 344,
            "num_hidden_layers": 4, "max_position_embeddings": seq,
            "tie_word_embeddings": False})
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = pipetrain.hf.sequential(transformers.AutoModelForCausalLM.from_config(config))
        tokens = ids[:, :-1]
        x = (tokens, torch.ones_like(tokens))
        return model, x, pipetrain.hf.causal_lm_targets(tokens), pipetrain.hf.causal_lm_loss
    raise ValueError(f"unknown model {name!r}: gpt or llama")


def _rows_of(x: Any, rows: int) -> Any:
    return tuple(t[:rows] for t in x) if isinstance(x, tuple) else x[:rows]


# -- the host: per-action overhead -------------------------------------------------------------


def calibrate_overhead(steps: int) -> float:
    """The runtime's seconds per action on these threads: a pipeline of two 4x4 Linear stages
    (1F1B, 4 micro-batches) timed, over the step the simulator gives it at zero compute and
    one second per action."""
    import torch
    from torch import nn

    import pipetrain
    from partitioner import predict

    m = 4
    pipe = pipetrain.Pipeline(
        nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1], chunks=m, schedule="1f1b",
        recompute="never", loss_fn=lambda out, y: (out - y).pow(2).mean(), optimizer=_adam,
        devices=["cpu"] * RANKS,
    )
    x, y = torch.randn(m, 4), torch.randn(m, 4)
    times = []
    for step in range(steps + 3):
        pipe.train_step(x, y)
        if step >= 3:
            times.append(pipe.metrics["step_time"])
    zeros = [0.0] * RANKS
    unit = predict("1f1b", m, zeros, zeros, [0.0], zeros, _host(RANKS, 1.0)).step_time
    return statistics.median(times) / unit


def _host(cores: int, overhead: float) -> Any:
    from partitioner import Host

    return Host(cores, overhead)


# -- the grid ----------------------------------------------------------------------------------


def grid(name: str, profile: Any, args: argparse.Namespace, overhead: float) -> list[Row]:
    """Every point of the space, planned (one Row each), in the search's order."""
    from partitioner.search import Settings, candidates

    rows = []
    for recompute in args.recompute:
        settings = Settings(checkpoint=recompute, host=_host(args.cores, overhead))
        found = candidates(
            profile, devices=RANKS, batch_size=args.batch, schedules=args.schedules,
            stages=[RANKS], microbatches=args.chunks, zero=[0], settings=settings,
            prune=False,
        )
        rows += [Row(name, c.plan, recompute) for c in found if c.plan is not None]
    return rows


def pipeline(row: Row, model: Any, loss_fn: Any) -> Any:
    import pipetrain

    return pipetrain.Pipeline(
        model, row.plan.balance, schedule=row.schedule, chunks=row.chunks,
        recompute=row.recompute, loss_fn=loss_fn, optimizer=_adam,
        devices=["cpu"] * RANKS, track_memory=True,
    )


def held_bytes(stage: Any) -> int:
    """Bytes of a stage's parameters, their gradients and its optimizer's state tensors."""
    import torch

    params = list(stage.module.parameters())
    total = sum(p.nbytes for p in params)
    total += sum(p.grad.nbytes for p in params if p.grad is not None)  # kept between steps
    optimizer = stage.optimizer
    if optimizer is not None:
        for state in optimizer.state.values():
            total += sum(v.nbytes for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def read_memory(row: Row, pipe: Any) -> None:
    """Per stage: its held bytes and what its ledger saw (peak saved bytes, micro-batches)."""
    row.held = [held_bytes(stage) for stage in pipe.stages]
    row.saved = [(s.ledger.peak_bytes, max(s.ledger.peak_microbatches, 1)) for s in pipe.stages]


def rebuilt_bytes(row: Row, rows: list[Row]) -> list[int] | None:
    """Under recomputation, per stage, the one micro-batch's activations its backward rebuilds
    (the ledger does not see them): what a micro-batch of the same split without
    recomputation saved, less the input the recomputing stage already holds (measured:
    its ledger's peak per micro-batch). None: no such row was measured."""
    if row.recompute == "never":
        return [0] * len(row.saved)
    twin = next((r for r in rows if r.key == row.key and r.recompute == "never"), None)
    if twin is None:
        return None
    return [max(full // k - kept // j, 0)
            for (full, k), (kept, j) in zip(twin.saved, row.saved, strict=True)]


def measured_memory(row: Row, rows: list[Row]) -> list[int]:
    """Per rank: held bytes, the peak saved bytes and the rebuilt activations of its stages."""
    rebuilt = rebuilt_bytes(row, rows) or [0] * len(row.saved)
    per_rank = [0] * RANKS
    for k, planned in enumerate(row.plan.per_stage):
        for rank in planned.ranks:
            per_rank[rank] += row.held[k] + row.saved[k][0] + rebuilt[k]
    return per_rank


def measure(name: str, rows: list[Row], args: argparse.Namespace, host: Any) -> None:
    """Run every row of one model: warm each, then rounds of one step each, rotating; with
    ``--profile-when rounds`` each round first profiles the model again and predicts every
    row on that profile, so that profile and steps see the machine's load of the same
    minute."""
    import torch

    pipes, batch = [], None
    for row in rows:
        model, x, y, loss_fn = build(name, args.batch, args.seq)
        pipes.append(pipeline(row, model, loss_fn))
        batch = (x, y)
    assert batch is not None
    for pipe in pipes:
        for _ in range(args.warmup):
            pipe.train_step(*batch)
    torch.manual_seed(0)
    order = list(range(len(rows)))
    for r in range(args.rounds):
        if args.profile_when == "rounds":
            profile = profile_of(name, args)
            for row in rows:
                row.predict_on(profile, host)
        for k in rotation(order, r * len(order) // args.rounds):
            pipes[k].train_step(*batch)
            metrics = pipes[k].metrics
            step = float(metrics["step_time"])
            rows[k].times.append(step)
            rows[k].busy.append([(1 - b) * step for b in metrics["stage_bubble"]])
    for row, pipe in zip(rows, pipes, strict=True):
        read_memory(row, pipe)
    twins = [*rows, *missing_twins(name, rows, args, batch)]
    for row in rows:
        row.memory = measured_memory(row, twins)


def missing_twins(name: str, rows: list[Row], args: argparse.Namespace, batch: Any
                  ) -> list[Row]:
    """For each recomputing row whose split the grid has no twin of without recomputation (the
    search split them differently), that twin, run one step for its ledger alone (untimed):
    what one micro-batch of the split saves, which the recomputing row's backward rebuilds."""
    twins = []
    for row in rows:
        if row.recompute != "never" and rebuilt_bytes(row, [*rows, *twins]) is None:
            twin = Row(row.model, row.plan, "never")
            model, _, _, loss_fn = build(name, args.batch, args.seq)
            pipe = pipeline(twin, model, loss_fn)
            pipe.train_step(*batch)
            read_memory(twin, pipe)
            twins.append(twin)
    return twins


def _corunner(model: Any, x: Any, stop: threading.Event, ready: threading.Event) -> None:
    """Train ``model`` on ``x`` (forward, backward) in a loop until ``stop``: what the other
    rank's thread does to the profiled one (the interpreter lock, caches, memory bandwidth)."""
    import torch

    torch.set_num_threads(1)
    try:
        while not stop.is_set():
            out = model(x)
            out = out if isinstance(out, torch.Tensor) else out[0]
            out.float().sum().backward()
            ready.set()
    finally:
        ready.set()


def profile_of(name: str, args: argparse.Namespace) -> Any:
    """The model's profile at the middle micro-batch size of the grid; with ``--fixed-times``
    (default) each layer's time that does not grow with the batch fitted from a second
    profile at the largest micro-batch (``partitioner.with_fixed_times``)."""
    from partitioner import with_fixed_times

    sizes = sorted({args.batch // c for c in args.chunks})
    size = args.batch // args.chunks[len(args.chunks) // 2]
    profile = _profile_at(name, args, size)
    other = max(sizes) if max(sizes) != size else min(sizes)
    if not args.fixed_times or other == size:
        return profile
    return with_fixed_times(profile, _profile_at(name, args, other))


def _profile_at(name: str, args: argparse.Namespace, size: int) -> Any:
    """The model's profile at micro-batch ``size``; with ``--profile-load busy`` taken while
    another thread trains a copy of the model, as the other rank will."""
    import warnings

    import pipetrain

    model, x, _, _ = build(name, args.batch, args.seq)
    stop, ready = threading.Event(), threading.Event()
    if args.profile_load == "busy":
        other, _, _, _ = build(name, args.batch, args.seq)
        threading.Thread(target=_corunner, args=(other, _rows_of(x, size), stop, ready),
                         daemon=True).start()
        ready.wait(60)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # noise is what this benchmark measures
            return pipetrain.profile(model, _rows_of(x, size), optimizer="adam",
                                     repeats=args.profile_repeats)
    finally:
        stop.set()


# -- the report --------------------------------------------------------------------------------


def _mib(values: list[int]) -> str:
    return "/".join(f"{v / MIB:.1f}" for v in values)


def table(rows: list[Row]) -> list[str]:
    out = [
        "| model | schedule | chunks | recompute | zero | balance | predicted ms | measured ms "
        "| time error | fastest step ms | predicted MiB (rank 0/1) | measured MiB (rank 0/1) "
        "| memory error (rank 0/1) |",
        "|" + "---|" * 13,
    ]
    for row in rows:
        mem = "/".join(f"{e:+.1%}" for e in row.memory_errors())
        out.append(
            f"| {row.model} | {row.schedule} | {row.chunks} | {row.recompute} | 0 | "
            f"{row.plan.balance} | {row.predicted * 1e3:.1f} | {row.measured * 1e3:.1f} | "
            f"{row.time_error:+.1%} | {row.fastest * 1e3:.1f} | {_mib(row.predicted_memory())} | "
            f"{_mib(row.memory)} | "
            f"{mem} |"
        )
    return out


def _worst(rows: list[Row], errors: list[float]) -> str:
    k = max(range(len(errors)), key=lambda i: abs(errors[i]))
    row = rows[k // (len(errors) // len(rows))]
    return f"{errors[k]:+.1%} ({row.model} {row.schedule} x{row.chunks} {row.recompute})"


def diagnosis(rows: list[Row]) -> list[str]:
    """Per model, schedule and recomputation (medians over the micro-batch counts): the
    measured step over the predicted one, and the ranks' compute inside the run over the
    profile's: where the second is near the first, the layers ran slower in the pipeline than
    profiled; the rest of the gap is time outside the layers (overhead, waiting)."""
    out = ["| model | schedule | recompute | measured / predicted step | compute in the run / "
           "profiled compute |", "|---|---|---|---|---|"]
    groups: dict[tuple[str, str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.model, row.schedule, row.recompute), []).append(row)
    for (model, schedule, recompute), mine in groups.items():
        step = statistics.median(r.measured / r.predicted for r in mine)
        compute = statistics.median(r.compute_ratio() for r in mine)
        out.append(f"| {model} | {schedule} | {recompute} | {step:.2f} | {compute:.2f} |")
    return out


def choice(rows: list[Row], name: str, what: str = "") -> str:
    """The planner's pick among ``rows`` of model ``name`` (the least predicted step, ties as
    the search breaks them) against the measured grid's best and median."""
    from partitioner.search import Candidate, Point, rank_key

    mine = [r for r in rows if r.model == name]

    def key(r: Row) -> Any:  # the search's order, on the row's prediction
        point = Point(r.schedule, RANKS, 1, r.chunks, 0)
        return (r.recompute != "never", r.predicted, *rank_key(Candidate(point, r.plan))[1:])

    pick = min(mine, key=key)
    best = min(mine, key=lambda r: r.measured)
    median = statistics.median(r.measured for r in mine)
    slower = pick.measured / best.measured - 1
    return (
        f"{name}{what}: the planner picks {pick.schedule} x{pick.chunks} {pick.recompute} "
        f"{pick.plan.balance} (predicted {pick.predicted * 1e3:.1f} ms), measured "
        f"{pick.measured * 1e3:.1f} ms; the grid's measured best {best.schedule} "
        f"x{best.chunks} {best.recompute} {best.plan.balance} {best.measured * 1e3:.1f} ms: "
        f"the pick is {slower:+.1%} (target within {TARGET_CHOICE:.0%}: "
        f"{'PASS' if slower <= TARGET_CHOICE else 'FAIL'}); the grid's median "
        f"configuration {median * 1e3:.1f} ms, {median / best.measured - 1:+.1%} over the "
        f"best; the pick ranks {sorted(mine, key=lambda r: r.measured).index(pick) + 1} "
        f"of {len(mine)} measured"
    )


def summary(rows: list[Row]) -> list[str]:
    """Median |error| and the worst case of time and memory; per model the planner's pick
    (the least predicted step) against the measured grid's best and median."""
    times = [r.time_error for r in rows]
    memory = [e for r in rows for e in r.memory_errors()]
    med_t = statistics.median(abs(e) for e in times)
    med_m = statistics.median(abs(e) for e in memory)
    out = [
        f"step time: median |error| {med_t:.1%} (target <= {TARGET_ERROR:.0%}: "
        f"{'PASS' if med_t <= TARGET_ERROR else 'FAIL'}), worst {_worst(rows, times)}; "
        f"{len(rows)} configurations",
        f"peak memory per rank: median |error| {med_m:.1%} (target <= {TARGET_ERROR:.0%}: "
        f"{'PASS' if med_m <= TARGET_ERROR else 'FAIL'}), worst {_worst(rows, memory)}; "
        f"{len(memory)} rank figures",
    ]
    fastest = [(r.predicted - r.fastest) / r.fastest for r in rows]
    out.append(f"step time against each configuration's fastest step (the least disturbed by "
               f"other load): median |error| {statistics.median(abs(e) for e in fastest):.1%}, "
               f"worst {_worst(rows, fastest)}")
    from schedules import lookup

    whole = [r for r in rows if not lookup(r.schedule).split_backward]
    for name in dict.fromkeys(r.model for r in rows):
        out.append(choice(rows, name))
        if any(r.model == name for r in whole) and len(whole) < len(rows):
            out.append(choice(whole, name, " (space without the split-backward schedules)"))
    return out


# -- the command line --------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gpt,llama", help="comma list: gpt, llama")
    ap.add_argument("--schedules", default="gpipe,1f1b,zb-h1,interleaved")
    ap.add_argument("--chunks", default="2,4,8", help="micro-batch counts")
    ap.add_argument("--recompute", default="never,always")
    ap.add_argument("--batch", type=int, default=16, help="mini-batch rows (default 16)")
    ap.add_argument("--seq", type=int, default=64, help="tokens per row (default 64)")
    ap.add_argument("--cores", type=int, default=RANKS, help="cores the ranks share")
    ap.add_argument("--rounds", type=int, default=7, help="timed steps per configuration")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per configuration")
    ap.add_argument("--profile-repeats", type=int, default=10)
    ap.add_argument("--profile-when", default="rounds", choices=["rounds", "before"],
                    help="rounds (default): profile again before each round and predict each "
                    "configuration on that round's profile (median over rounds); before: "
                    "one profile before the grid, the plans' own predictions")
    ap.add_argument("--no-fixed-times", dest="fixed_times", action="store_false",
                    help="plan on one profile, every layer time proportional to its samples "
                    "(default: the fixed part fitted from a second profile)")
    ap.add_argument("--profile-load", default="busy", choices=["busy", "idle"],
                    help="busy (default): profile while another thread trains a copy of the "
                    "model, as the other rank will; idle: alone")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: gpt, 1f1b, 2 and 4 micro-batches, no recomputation")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.models, args.schedules, args.chunks, args.recompute = "gpt", "1f1b", "2,4", "never"
        args.rounds, args.warmup, args.profile_repeats, args.seq = 3, 1, 3, 32
    args.models = [m for m in args.models.split(",") if m]
    args.schedules = [s for s in args.schedules.split(",") if s]
    args.chunks = [int(c) for c in args.chunks.split(",") if c]
    args.recompute = [r for r in args.recompute.split(",") if r]
    import torch

    torch.set_num_threads(1)
    started, before = time.monotonic(), cpu_jiffies()
    overhead = calibrate_overhead(steps=15)
    print(f"runtime overhead: {overhead * 1e3:.3f} ms per action (calibrated); "
          f"{RANKS} ranks as threads sharing {args.cores} cores, 1 torch thread each; "
          f"mini-batch {args.batch} x {args.seq} tokens, Adam; median of {args.rounds} steps "
          f"after {args.warmup} warm, configurations interleaved")
    rows: list[Row] = []
    for name in args.models:
        profile = profile_of(name, args)
        mine = grid(name, profile, args, overhead)
        measure(name, mine, args, _host(args.cores, overhead))
        rows += mine
        print(f"{name}: {len(profile.layers)} layers profiled at micro-batch "
              f"{profile.batch_size}, {len(mine)} configurations measured", flush=True)
    print()
    print("\n".join(table(rows)))
    print()
    print("\n".join(summary(rows)))
    print()
    print("\n".join(diagnosis(rows)))
    print(load_report(before, cpu_jiffies(), time.monotonic() - started))
    print(f"wall time {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
