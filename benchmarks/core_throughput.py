"""Core throughput benchmark: pipetrain vs torch.distributed.pipelining on two CPU ranks.

Setup (fixed by the issue): a 16-block MLP, each block Linear(1024, 1024) + ReLU (32 layers),
split into two stages of 8 blocks (balance [16, 16]); batch 256 in 8 micro-batches; SGD; MSE
loss; one torch thread per rank; two processes joined by gloo, started by this script.

Variants, measured side by side in one run, round-robin (the order rotates every round):

  pipetrain-1f1b / pipetrain-gpipe   pipetrain.Pipeline(..., schedule=...), recompute="never"
  pipetrain-1f1b-traced              the same 1F1B with tracing on (Pipeline(trace=tmpdir))
  torch-1f1b / torch-gpipe           torch.distributed.pipelining Schedule1F1B / ScheduleGPipe
                                     on PipelineStage (manual split, same halves, same loss)
  single-process                     the whole model, whole batch, one thread, on rank 0 while
                                     rank 1 waits in a barrier
  no-comm bound                      both ranks at once run their own stage's forward+backward
                                     over the 8 micro-batches with no transfers (stage 1's
                                     input requires grad); bound time = max over ranks of that
                                     time * (m + p - 1) / m

Each timed step is timed on every rank and the slower rank's time counts. The table reports
medians over the timed steps (warm-up excluded) that no other process disturbed: per step the
script reads /proc/stat and subtracts the ranks' own CPU time, and a step during which other
processes (or hypervisor steal) took more than --disturbed of the CPUs is left out. The two
ranks need both cores, so on a shared machine pass --wait-quiet S to pause before each round
until the machine is quiet. Every blocking wait has a timeout, and the parent kills the ranks if
they overrun --deadline.

    python benchmarks/core_throughput.py                  # ~2-3 minutes on 2 quiet cores
    python benchmarks/core_throughput.py --wait-quiet 30  # on a machine shared with other work
    python benchmarks/core_throughput.py --quick          # ~30 s smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta

from machine_load import cpu_jiffies, load_report
from ranks import init_rank, spawn_ranks
from timing import quantile, rotation, slowest

WIDTH, BLOCKS, BATCH, CHUNKS, STAGES = 1024, 16, 256, 8, 2
LR = 1e-3
VARIANTS = (
    "pipetrain-1f1b",
    "pipetrain-1f1b-traced",
    "pipetrain-gpipe",
    "torch-1f1b",
    "torch-gpipe",
    "single-process",
    "no-comm bound",
)
PEER = {"pipetrain-1f1b": "torch-1f1b", "pipetrain-gpipe": "torch-gpipe"}
TARGET_VS_PEER, TARGET_VS_BOUND = 1.10, 0.92


# -- the ranks ----------------------------------------------------------------------------------


def _model():
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers)


def _half(rank: int):
    """This rank's stage as its own nn.Sequential (same weights as the full model's half)."""
    from torch import nn

    layers = list(_model().children())
    n = len(layers) // STAGES
    return nn.Sequential(*layers[rank * n : (rank + 1) * n])


def _sgd(params):
    import torch

    return torch.optim.SGD(params, lr=LR)


def _mse(output, target):
    import torch.nn.functional as F

    return F.mse_loss(output, target)


class _Variant:
    """One way of training: ``step()`` runs one mini-batch; ``participates`` says whether this
    rank's time counts (rank 1 only idles during single-process)."""

    participates = True

    def step(self) -> float | None:
        raise NotImplementedError


class _PipetrainVariant(_Variant):
    def __init__(self, schedule: str, x, y, timeout: float, trace: str | None = None):
        import pipetrain

        self.pipe = pipetrain.Pipeline(
            _model(),
            [2 * BLOCKS // STAGES] * STAGES,
            chunks=CHUNKS,
            schedule=schedule,
            recompute="never",
            loss_fn=_mse,
            optimizer=_sgd,
            timeout=timeout,
            trace=trace,
        )
        self.x, self.y = x, y

    def step(self) -> float | None:
        return float(self.pipe.train_step(self.x, self.y))  # read, as the torch variant does


class _TorchVariant(_Variant):
    def __init__(self, schedule: str, rank: int, x, y):
        import torch
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.rank = rank
        self.module = _half(rank)
        self.opt = _sgd(self.module.parameters())
        stage = PipelineStage(self.module, rank, STAGES, torch.device("cpu"))
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        self.schedule = kind(stage, n_microbatches=CHUNKS, loss_fn=_mse)
        self.x, self.y = x, y

    def step(self) -> float | None:
        self.opt.zero_grad(set_to_none=True)
        if self.rank == 0:
            self.schedule.step(self.x)
            loss = None
        else:
            losses: list = []
            self.schedule.step(target=self.y, losses=losses, return_outputs=False)
            loss = float(sum(float(v.detach()) for v in losses) / len(losses))
        self.opt.step()
        return loss


class _SingleVariant(_Variant):
    def __init__(self, rank: int, x, y):
        self.participates = rank == 0
        if self.participates:
            self.model = _model()
            self.opt = _sgd(self.model.parameters())
        self.x, self.y = x, y

    def step(self) -> float | None:
        if not self.participates:
            return None
        self.opt.zero_grad(set_to_none=True)
        loss = _mse(self.model(self.x), self.y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())


class _BoundVariant(_Variant):
    """This rank's stage, forward + backward over every micro-batch, no communication. Stage 0
    backpropagates a fixed output gradient; stage 1 starts from an input that requires grad
    and ends in the loss. Gradients accumulate into .grad as in the pipeline; no optimizer
    step (zero_grad runs before the timer starts)."""

    def __init__(self, rank: int, x, y):
        import torch

        self.rank = rank
        self.module = _half(rank)
        g = torch.Generator().manual_seed(1)
        mb = BATCH // CHUNKS
        if rank == 0:
            self.inputs = list(x.chunk(CHUNKS))
            self.grads = [torch.randn(mb, WIDTH, generator=g) * 1e-3 for _ in range(CHUNKS)]
        else:
            self.inputs = [torch.randn(mb, WIDTH, generator=g) for _ in range(CHUNKS)]
            self.targets = list(y.chunk(CHUNKS))

    def prepare(self) -> None:
        self.module.zero_grad(set_to_none=True)

    def step(self) -> float | None:
        import torch

        for i in range(CHUNKS):
            if self.rank == 0:
                out = self.module(self.inputs[i])
                torch.autograd.backward(out, self.grads[i])
            else:
                inp = self.inputs[i].detach().requires_grad_(True)
                loss = _mse(self.module(inp), self.targets[i]) / CHUNKS
                loss.backward()
                assert inp.grad is not None
        return None


def _rank_main(rank: int, port: int, opts: dict, results) -> None:
    """One rank: join the group, measure; rank 0 reports the records on ``results``."""
    timeout = float(opts["timeout"])
    init_rank(rank, STAGES, port, timeout)
    import torch.distributed as dist

    try:
        result = _measure(rank, opts, timeout)
        if result is not None:
            results.put(result)
    finally:
        dist.destroy_process_group()


def _measure(rank: int, opts: dict, timeout: float) -> dict | None:
    """Every variant's timed steps (rank 0 returns them with the first losses, else None)."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1234)
    x = torch.randn(BATCH, WIDTH, generator=g)
    y = torch.randn(BATCH, WIDTH, generator=g)
    wanted = opts["variants"]
    builders = {
        "pipetrain-1f1b": lambda: _PipetrainVariant("1f1b", x, y, timeout),
        "pipetrain-1f1b-traced": lambda: _PipetrainVariant(
            "1f1b", x, y, timeout, trace=tempfile.mkdtemp(prefix="pipetrain-trace-")
        ),
        "pipetrain-gpipe": lambda: _PipetrainVariant("gpipe", x, y, timeout),
        "torch-1f1b": lambda: _TorchVariant("1f1b", rank, x, y),
        "torch-gpipe": lambda: _TorchVariant("gpipe", rank, x, y),
        "single-process": lambda: _SingleVariant(rank, x, y),
        "no-comm bound": lambda: _BoundVariant(rank, x, y),
    }
    variants = {name: builders[name]() for name in VARIANTS if name in wanted}

    def barrier() -> None:
        # rank 0 may spend up to --wait-quiet seconds before a round while rank 1 waits here
        dist.monitored_barrier(timeout=timedelta(seconds=timeout + opts["wait_quiet"]))

    def block(name: str, steps: int) -> tuple[list[dict], list[float | None]]:
        """``steps`` steps of one variant. Per step: the slower rank's time, and how much of
        the machine other processes (or the hypervisor) took meanwhile."""
        v = variants[name]
        times, cpus, busy, steal, losses = [], [], [], [], []
        bound = isinstance(v, _BoundVariant)
        barrier()
        for _ in range(steps):
            if bound:
                v.prepare()
                barrier()  # both ranks compute at the same time
            before = cpu_jiffies() if rank == 0 else None
            cpu, start = time.process_time(), time.perf_counter()
            losses.append(v.step() if v.participates else None)
            times.append(time.perf_counter() - start if v.participates else 0.0)
            cpus.append(time.process_time() - cpu)  # every thread of this rank
            after = cpu_jiffies() if rank == 0 else None
            if before is not None and after is not None:
                busy.append(after[0] - before[0])
                steal.append(after[1] - before[1])
        barrier()
        worst = slowest(times)
        ours = torch.tensor(cpus, dtype=torch.float64)
        dist.all_reduce(ours, op=dist.ReduceOp.SUM)
        hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
        records = []
        for k, t in enumerate(worst):
            rec = {"time": t, "foreign": 0.0, "steal": 0.0}
            if len(busy) == steps and t > 0:
                capacity = ncpu * t
                rec["foreign"] = max(busy[k] / hz - ours[k].item(), 0.0) / capacity
                rec["steal"] = steal[k] / hz / capacity
            records.append(rec)
        return records, losses

    first_loss: dict[str, float | None] = {}
    for name in variants:  # warm-up (also fixes torch pipelining's shapes)
        _, losses = block(name, opts["warmup"])
        first_loss[name] = losses[0]
    steps: list[dict] = []  # one record per timed step: round, variant, time, foreign, steal
    names = list(variants)
    waited = 0.0
    for r in range(opts["rounds"]):
        if rank == 0 and opts["wait_quiet"] > 0:
            waited += _wait_for_quiet(opts["wait_quiet"], opts["disturbed"])
        for name in rotation(names, r):
            records, _ = block(name, opts["steps"])
            steps += [dict(rec, round=r, variant=name) for rec in records]
    merged = _first_losses(first_loss)
    if rank != 0:
        return None
    return {"steps": steps, "first_loss": merged, "waited": waited}


def _first_losses(first_loss: dict[str, float | None]) -> dict[str, float | None]:
    """Each variant's first-step loss from the rank that has it (the last stage's), gathered
    from every rank: a sanity check of equivalence."""
    import torch
    import torch.distributed as dist

    names = list(first_loss)
    loss_t = torch.tensor(
        [first_loss[n] if first_loss[n] is not None else float("nan") for n in names],
        dtype=torch.float64,
    )
    gathered = [torch.empty_like(loss_t) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, loss_t)
    merged = {}
    for k, n in enumerate(names):
        vals = [t[k].item() for t in gathered if t[k].item() == t[k].item()]
        merged[n] = vals[0] if vals else None
    return merged


def _wait_for_quiet(limit_s: float, share: float) -> float:
    """Before a round (both ranks idle), wait up to ``limit_s`` seconds until other processes
    use at most ``share`` of the CPUs over half a second. Returns the seconds waited."""
    start = time.monotonic()
    hz, ncpu = os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    while time.monotonic() - start < limit_s:
        before, t0 = cpu_jiffies(), time.monotonic()
        time.sleep(0.5)
        after = cpu_jiffies()
        if before is None or after is None:
            break
        load = (after[0] - before[0] + after[1] - before[1]) / hz / ((time.monotonic() - t0) * ncpu)
        if load <= share:
            break
    return time.monotonic() - start


# -- the parent ---------------------------------------------------------------------------------


def _select(steps: list[dict], limit: float) -> tuple[dict[str, list[dict]], dict[str, bool]]:
    """Per variant, the steps to report: those no other process disturbed (foreign load and
    steal each at most ``limit`` of the machine), unless fewer than a fifth (or 3) of its steps
    are clean, in which case all of them (flagged)."""
    chosen, fallback = {}, {}
    for name in VARIANTS:
        mine = [s for s in steps if s["variant"] == name]
        if not mine:
            continue
        clean = [s for s in mine if s["foreign"] <= limit and s["steal"] <= limit]
        fallback[name] = len(clean) < max(3, len(mine) // 5)
        chosen[name] = mine if fallback[name] else clean
    return chosen, fallback


def _scaled(name: str, t: float) -> float:
    """Step time; for the bound, the compute time stretched by the fill-drain bubble."""
    return t * (CHUNKS + STAGES - 1) / CHUNKS if name == "no-comm bound" else t


def _paired(chosen: dict[str, list[dict]], name: str, ref: str) -> tuple[float, float, float]:
    """Median (min, max) over rounds of ref's median step time / name's in the same round:
    a throughput ratio that shrugs off the machine's speed drifting between rounds."""
    per_round: dict[int, dict[str, list[float]]] = {}
    for n in (name, ref):
        for s in chosen.get(n, []):
            per_round.setdefault(s["round"], {}).setdefault(n, []).append(_scaled(n, s["time"]))
    r = [
        statistics.median(x[ref]) / statistics.median(x[name])
        for x in per_round.values()
        if name in x and ref in x
    ]
    return (statistics.median(r), min(r), max(r)) if r else (float("nan"),) * 3


def _table(steps: list[dict], first_loss: dict, opts: dict) -> str:
    m, p = CHUNKS, STAGES
    chosen, fallback = _select(steps, opts["disturbed"])
    stats = {}
    for name, picked in chosen.items():
        times = [_scaled(name, s["time"]) for s in picked]
        every = [_scaled(name, s["time"]) for s in steps if s["variant"] == name]
        med = statistics.median(times)
        stats[name] = {
            "ms": med * 1e3,
            "iqr": (quantile(times, 0.25) * 1e3, quantile(times, 0.75) * 1e3),
            "sps": BATCH / med,
            "used": f"{len(times)}/{len(every)}" + (" *" if fallback[name] else ""),
            "all_ms": statistics.median(every) * 1e3,
        }

    def ratio(name: str, ref: str) -> str:
        if ref not in stats or name == ref:
            return "-"
        return f"{stats[name]['sps'] / stats[ref]['sps']:.3f}"

    header = (
        "| variant | median step ms | p25-p75 ms | samples/s | vs torch same schedule "
        "| vs bound | vs single-process | steps used | median ms, all steps |"
    )
    lines = [header, "|" + "---|" * 9]
    for name in VARIANTS:
        if name not in stats:
            continue
        s = stats[name]
        if name in PEER:
            vs_peer = ratio(name, PEER[name])
        else:
            vs_peer = "1.000" if name.startswith("torch") else "-"
        lines.append(
            f"| {name} | {s['ms']:.1f} | {s['iqr'][0]:.1f}-{s['iqr'][1]:.1f} | {s['sps']:.1f} "
            f"| {vs_peer} | {ratio(name, 'no-comm bound')} | {ratio(name, 'single-process')} "
            f"| {s['used']} | {s['all_ms']:.1f} |"
        )
    disturbed = sum(1 for s in steps if max(s["foreign"], s["steal"]) > opts["disturbed"])
    out = [
        f"model {BLOCKS} x (Linear({WIDTH},{WIDTH})+ReLU), balance [16, 16], batch {BATCH}, "
        f"{CHUNKS} micro-batches, 2 ranks (gloo), 1 thread/rank, SGD lr={LR}",
        f"warm-up {opts['warmup']} steps/variant, then {opts['rounds']} rounds x "
        f"{opts['steps']} steps/variant, round-robin; per step the slower rank's time",
        "no-comm bound row: max-over-ranks F+B time of the 8 micro-batches x (m+p-1)/m "
        f"= x{(m + p - 1) / m:.3f}",
        f"{disturbed} of {len(steps)} timed steps were disturbed (other processes or "
        f"hypervisor steal took > {opts['disturbed']:.0%} of the CPUs) and are left out of the "
        "medians; '*' = too few clean steps, all steps used",
        "",
        *lines,
        "",
    ]
    for name, peer in PEER.items():
        if name not in stats:
            continue
        checks = []
        for ref, target, what in (
            (peer, TARGET_VS_PEER, f"x {peer}"),
            ("no-comm bound", TARGET_VS_BOUND, " of bound"),
        ):
            if ref not in stats:
                continue
            r = stats[name]["sps"] / stats[ref]["sps"]
            med, lo, hi = _paired(chosen, name, ref)
            ok = "PASS" if r >= target else "FAIL"
            checks.append(
                f"{r:.3f}{what} (target >= {target}: {ok}; same-round pairs: median "
                f"{med:.3f}, range {lo:.3f}-{hi:.3f})"
            )
        out.append(f"target {name}: " + "; ".join(checks))
    losses = ", ".join(
        f"{n}={v:.6f}" for n, v in first_loss.items() if v is not None and n in stats
    )
    out.append(f"first warm-up step loss (should agree): {losses}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="round-robin rounds (default 15)")
    ap.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per variant first")
    ap.add_argument("--quick", action="store_true", help="~30 s smoke run (3 rounds x 1 step)")
    ap.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="comma-separated subset of: " + ", ".join(VARIANTS),
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="timeout of every wait (s)")
    ap.add_argument(
        "--deadline",
        type=float,
        help="kill the ranks after this many seconds (default 900 + rounds x --wait-quiet)",
    )
    ap.add_argument(
        "--disturbed",
        type=float,
        default=0.08,
        help="leave out steps during which other processes or steal took more than this "
        "share of the CPUs (default 0.08; 1 keeps every step)",
    )
    ap.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="on a shared machine: before each round wait up to S seconds for other "
        "processes to go quiet (default 0: don't wait)",
    )
    ap.add_argument("--json", help="also write the raw per-step records here")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup = 3, 1, 1
    if args.deadline is None:
        args.deadline = 900.0 + args.rounds * args.wait_quiet
    wanted = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in wanted if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    opts = {
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "variants": wanted,
        "timeout": args.timeout,
        "disturbed": args.disturbed,
        "wait_quiet": args.wait_quiet,
    }

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    load_before = cpu_jiffies()
    try:
        result = spawn_ranks(_rank_main, STAGES, opts, timeout=args.deadline)
    except BaseException as error:
        print(f"benchmark failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    wall = time.monotonic() - started
    print(_table(result["steps"], result["first_loss"], opts))
    print(load_report(load_before, cpu_jiffies(), wall))
    if result.get("waited"):
        print(f"waited {result['waited']:.0f} s in all for quiet before rounds (--wait-quiet)")
    print(f"wall time {wall:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
