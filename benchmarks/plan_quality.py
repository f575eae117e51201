"""Plan quality: is the planner's split faster than a naive one, and is its step prediction right?

(a) Planned vs uniform split. ``examples.models.resnet_like`` (its full-resolution first layers
    hold most of the compute, its last layers are many cheap ones) is profiled on this machine
    (one torch thread, the micro-batch as the profiled batch), then split into 2 stages by the
    planner (exact DP, with the copy rate of messages measured between the ranks) and by layer count
    (uniform). Both run for real: 2 processes joined by gloo, one torch thread each, the same
    mini-batch, 1F1B, Adam; rounds alternate between the splits (the order rotates every round)
    and each step's time is the slower rank's. Reported: the medians and the throughput ratio
    planned / uniform (target >= 1.3).
(b) Prediction. For 2 and 4 stages the plan's predicted step time is compared with the measured
    median step (target: within 15%). The plan is told the host (``plan(..., cores=,
    overhead=)``): the stage processes share ``--cores`` cores (processor sharing; each message
    is a copy at both ends, done on those cores, at the rate ``_probe_copy_rate`` measures), and
    the runtime spends ``overhead`` of processor time per action, measured on the same ranks
    just before with a pipeline of tiny stages (:func:`_runtime_overhead`). Beside it, the
    prediction for a device per stage (what a plan that is not told the host predicts).
(c) The plan tables of the bundled PipeDream profiles vgg16 and gnmt (4 stages), as
    ``pipetrain plan`` prints them.

Measuring conditions, chosen so that the profile sees what the stages will see:
  * the profile is taken while the other cores run the same model (``--profile-load busy``),
    as the other stages will keep them busy (shared caches and memory bandwidth; in some runs
    the stages of the 2-stage split computed 10-14% slower than an idle-machine profile);
  * glibc malloc keeps freed memory (``--allocator tuned``, see ``tune_malloc``) in the
    profiling process and every rank;
  * ``--rounds`` x ``--steps`` alternating; a report of how busy the machine was with other
    work closes the table (other load slows whichever split runs at that moment).

    python benchmarks/plan_quality.py            # default, about 1.5 minutes on 2 cores
    python benchmarks/plan_quality.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

from machine_load import cpu_jiffies, load_report
from ranks import init_rank, spawn_ranks
from timing import quantile, rotation, slowest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # examples.models, when run as a script from anywhere

TARGET_RATIO, TARGET_ERROR = 1.3, 0.15


# -- the CPU allocator --------------------------------------------------------------------------


def tune_malloc() -> str:
    """Keep freed memory in this process (glibc): no trimming, a 64 MiB top pad, no mmap below
    32 MiB. By default glibc hands the activations freed after each backward back to the OS
    and page-faults them in again during the next forward, which made a chained forward here
    30-50% slower than the sum of its layers timed alone (the profile) and stage compute
    inside a pipeline ~10% slower, in a way that depends on which layers share a process.
    PyTorch's CPU performance guide recommends jemalloc or tcmalloc for the same reason."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return "default allocator (no glibc to tune)"
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    ok = all(
        libc.mallopt(option, value)
        for option, value in (
            (m_mmap_threshold, 32 * 2**20),
            (m_trim_threshold, 2**30),
            (m_top_pad, 64 * 2**20),
        )
    )
    return "glibc malloc tuned (keeps freed memory)" if ok else "mallopt failed: default"


# -- the ranks ---------------------------------------------------------------------------------


def _loss(output, target):
    import torch.nn.functional as F

    return F.cross_entropy(output, target)


def _adam(params):
    import torch

    return torch.optim.Adam(params, lr=1e-3)


def _cpu_seconds() -> float:
    """This process's processor time so far, all its threads (the transport's too)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _probe_copy_rate(rank: int, world: int, size: int) -> float:
    """Bytes per processor-second that one end of a message spends moving it (the bandwidth a
    plan on shared cores charges as copies at both ends), agreed by every rank. Ranks 0 and 1
    ping-pong ``size``-byte and 4-byte messages in alternating blocks; the processor time both
    spend (not the wall time: that swings with how fast a waiting thread is woken) beyond the
    small messages' is the copying. The median over the blocks."""
    import torch
    import torch.distributed as dist

    if world < 2:
        return math.inf
    blocks, trips = 9, 10
    spent = torch.zeros(blocks, 2, dtype=torch.float64)
    if rank < 2:
        buffers = (torch.zeros(1), torch.zeros(max(size // 4, 1)))
        for block in range(-1, blocks):  # block -1 warms up
            for k, buffer in enumerate(buffers):
                start = _cpu_seconds()
                for _ in range(trips):
                    if rank == 0:
                        dist.send(buffer, 1)
                        dist.recv(buffer, 1)
                    else:
                        dist.recv(buffer, 0)
                        dist.send(buffer, 0)
                if block >= 0:
                    spent[block, k] = _cpu_seconds() - start
    dist.all_reduce(spent)  # both ends of every message
    per_end = statistics.median((spent[:, 1] - spent[:, 0]).tolist()) / (trips * 2 * 2)
    return size / per_end if per_end > 0 else math.inf


def _runtime_overhead(world: int, opts: dict) -> float:
    """The runtime's own processor seconds per action on these ranks, from a pipeline of tiny
    stages (a 4x4 Linear each) run like the real one (1F1B, the same micro-batches): all ranks'
    process CPU time (executor, transport threads) per step over all their actions. The
    messages are tiny, so their copies (charged separately, bytes / bandwidth) are left out."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipetrain

    m = opts["microbatches"]
    pipe = pipetrain.Pipeline(
        nn.Sequential(*(nn.Linear(4, 4) for _ in range(world))),
        [1] * world,
        chunks=m,
        schedule="1f1b",
        recompute="never",
        loss_fn=lambda output, target: (output - target).pow(2).mean(),
        optimizer=_adam,
        timeout=opts["timeout"],
    )
    g = torch.Generator().manual_seed(0)  # the same batch on every rank, as the pipeline checks
    x, y = torch.randn(m, 4, generator=g), torch.randn(m, 4, generator=g)
    for _ in range(5):
        pipe.train_step(x, y)
    dist.monitored_barrier(timeout=timedelta(seconds=opts["timeout"]))
    steps, start = 30, _cpu_seconds()
    for _ in range(steps):
        pipe.train_step(x, y)
    spent = torch.tensor([(_cpu_seconds() - start) / steps], dtype=torch.float64)
    dist.all_reduce(spent)
    actions = sum(len(ops) for ops in pipe.schedule.actions.values())
    return float(spent[0]) / actions


def _time_stage_compute() -> dict[str, float]:
    """Accumulate the wall time of every Stage.forward/backward(_weights) in this process in the
    returned dict's "seconds" (to tell compute slowed by sharing cores from waiting)."""
    from pipetrain.runtime.stage import Stage

    acc = {"seconds": 0.0}
    for method in ("forward", "backward", "backward_weights"):
        original = getattr(Stage, method, None)
        if original is None:
            continue

        def timed(self, *args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                acc["seconds"] += time.perf_counter() - start

        setattr(Stage, method, timed)
    return acc


def _rank_main(rank: int, port: int, world: int, opts: dict, results) -> None:
    """One rank: join the group, measure; rank 0 reports the result on ``results``."""
    if opts["allocator"] == "tuned":
        tune_malloc()
    init_rank(rank, world, port, opts["timeout"])
    import torch.distributed as dist

    try:
        result = _measure(rank, world, opts)
        if rank == 0:
            results.put(result)
    finally:
        dist.destroy_process_group()


def _pipeline(opts: dict, planned, balance: list[int] | None):
    """The model as a Pipeline: as the plan ``planned`` says (balance, schedule, micro-batches,
    recomputation), or split by ``balance`` under 1F1B without recomputation."""
    import pipetrain
    from examples.models import resnet_like
    from partitioner import Plan

    model = resnet_like(**opts["model"])
    common = dict(loss_fn=_loss, optimizer=_adam, timeout=opts["timeout"])
    if balance is None:
        return pipetrain.Pipeline(model, plan=Plan.from_json(planned.to_json()), **common)
    return pipetrain.Pipeline(
        model,
        balance,
        chunks=opts["microbatches"],
        schedule="1f1b",
        recompute="never",
        **common,
    )


def _measure(rank: int, world: int, opts: dict) -> dict:
    import torch
    import torch.distributed as dist

    from partitioner import Profile
    from partitioner import plan as make_plan

    timeout = opts["timeout"]
    profile = Profile.from_json(opts["profile"])
    size = max(layer.activation_bytes for layer in profile.layers[:-1])
    bandwidth = _probe_copy_rate(rank, world, size)
    overhead = _runtime_overhead(world, opts)
    planned = make_plan(
        profile,
        stages=world,
        microbatches=opts["microbatches"],
        schedule="1f1b",
        bandwidth=bandwidth,
        cores=opts["cores"],
        overhead=overhead,
    )
    n = len(profile.layers)
    uniform = [n // world + (s < n % world) for s in range(world)]
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(opts["batch"], 3, 32, 32, generator=g)
    y = torch.randint(0, opts["classes"], (opts["batch"],), generator=g)

    variants = {
        "planned": _pipeline(opts, planned, None), "uniform": _pipeline(opts, None, uniform)
    }
    compute = _time_stage_compute()  # this rank's forward+backward seconds, per step

    def block(name: str, steps: int) -> list[float]:
        pipe = variants[name]
        dist.monitored_barrier(timeout=timedelta(seconds=timeout))
        times = []
        for _ in range(steps):
            compute["seconds"] = 0.0
            start = time.perf_counter()
            pipe.train_step(x, y)
            times.append(time.perf_counter() - start)
            busy[name].append(compute["seconds"])
        return slowest(times)

    busy: dict[str, list[float]] = {name: [] for name in variants}

    for name in variants:
        block(name, opts["warmup"])
    names = list(variants)
    samples: dict[str, list[float]] = {name: [] for name in names}
    rounds = []
    for r in range(opts["rounds"]):
        this_round = {}
        for name in rotation(names, r):
            times = block(name, opts["steps"])
            samples[name] += times
            this_round[name] = statistics.median(times)
        rounds.append(this_round)
    # Per stage (rank), the median forward+backward seconds per micro-batch it spent in steps.
    medians = torch.tensor(
        [statistics.median(busy[name]) / opts["microbatches"] for name in names],
        dtype=torch.float64,
    )
    gathered = [torch.zeros_like(medians) for _ in range(world)]
    dist.all_gather(gathered, medians)
    return {
        "compute": {n: [float(g[k]) for g in gathered] for k, n in enumerate(names)},
        "bandwidth": bandwidth,
        "overhead": overhead,
        "plan": planned.to_json(),
        "balance": {"planned": planned.balance, "uniform": uniform},
        "samples": samples,
        "rounds": rounds,
    }


# -- the parent --------------------------------------------------------------------------------


def _corunner(opts: dict, ready, stop) -> None:
    """Train the model on one micro-batch in a loop until ``stop``: the load another stage
    puts on its core while the profiled one runs."""
    if opts["allocator"] == "tuned":
        tune_malloc()
    import torch

    from examples.models import resnet_like

    torch.set_num_threads(1)
    model = resnet_like(**opts["model"])
    x = torch.randn(opts["batch"] // opts["microbatches"], 3, 32, 32)
    for step in range(1 << 30):
        if step == 3:
            ready.set()
        if stop.is_set():
            return
        output = model(x)
        output.backward(torch.ones_like(output))


def _profile(opts: dict, warmup: int, repeats: int, busy: int):
    """The profile of one micro-batch, taken while ``busy`` other processes keep the other
    cores working on the same model (as the other stages will during the runs)."""
    import torch
    import torch.multiprocessing as mp

    from examples.models import resnet_like
    from pipetrain.tools.profiler import profile

    torch.set_num_threads(1)
    ctx = mp.get_context("spawn")
    ready, stop = [ctx.Event() for _ in range(busy)], ctx.Event()
    others = [ctx.Process(target=_corunner, args=(opts, r, stop), daemon=True) for r in ready]
    for proc in others:
        proc.start()
    try:
        for event in ready:
            if not event.wait(timeout=120):
                raise TimeoutError("a co-runner did not start")
        model = resnet_like(**opts["model"])
        size = opts["batch"] // opts["microbatches"]
        sample = torch.randn(size, 3, 32, 32, generator=torch.Generator().manual_seed(0))
        return profile(model, sample, optimizer="adam", warmup=warmup, repeats=repeats)
    finally:
        stop.set()
        for proc in others:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def _predictions(profile, balance: list[int], opts: dict, res: dict) -> tuple[float, float]:
    """(the predicted step of this split with a device per stage, the same on this host)."""
    from partitioner import Host, simulate_split

    m, bandwidth = opts["microbatches"], res["bandwidth"]
    alone, here = (
        simulate_split(profile, balance, microbatches=m, bandwidth=bandwidth, host=host)
        for host in (None, Host(opts["cores"], res["overhead"]))
    )
    return alone.step_time, here.step_time


def _pipedream_tables(args: argparse.Namespace) -> str:
    from partitioner import load_pipedream, plan, simulate_split
    from pipetrain.tools.cli_plan import describe_plan

    out = []
    for name, batch in (("vgg16", None), ("gnmt", 64)):
        profile = load_pipedream(name, batch)
        kwargs = dict(microbatches=args.microbatches, bandwidth=args.pd_bandwidth)
        result = plan(profile, stages=4, memory=args.pd_memory, **kwargs)  # type: ignore[arg-type]
        n = len(profile.layers)
        uniform = [n // 4 + (s < n % 4) for s in range(4)]
        even = simulate_split(profile, uniform, **kwargs)  # type: ignore[arg-type]
        out += [
            f"$ pipetrain plan pipedream:{name} --stages 4 --microbatches {args.microbatches} "
            f"--memory {args.pd_memory} --bandwidth {args.pd_bandwidth}"
            + (f" --batch-size {batch}" if batch else ""),
            describe_plan(result),
            f"(uniform split {uniform} for comparison: predicted step "
            f"{even.step_time * 1e3:.3f} ms; planned is {even.step_time / result.step_time:.2f}x "
            "faster)",
            "",
        ]
    return "\n".join(out)


def _measured_report(results: dict, profile, opts: dict) -> str:
    """(a)+(b): per stage count and split, the predictions beside the measured step; the
    targets; each stage's profiled vs measured compute."""
    from partitioner import stage_costs

    rows = [
        "| stages | split | balance | predicted ms (a device per stage) | predicted ms "
        f"(this host: {opts['cores']} shared cores, overhead; the plan's) | measured ms median "
        "(p25-p75) | error | samples/s |",
        "|" + "---|" * 8,
    ]
    summary = []
    compute_rows = [
        "forward+backward ms per micro-batch per stage, profiled -> measured inside the run "
        "(larger: the stage ran slower than profiled, e.g. cores shared with other processes)"
    ]
    for world, res in results.items():
        bandwidth = res["bandwidth"]
        medians = {}
        for name in ("planned", "uniform"):
            balance = res["balance"][name]
            times = res["samples"][name]
            med = statistics.median(times)
            medians[name] = med
            alone, here = _predictions(profile, balance, opts, res)
            rows.append(
                f"| {world} | {name} | {balance} | {alone * 1e3:.1f} | {here * 1e3:.1f} | "
                f"{med * 1e3:.1f} ({quantile(times, 0.25) * 1e3:.1f}-"
                f"{quantile(times, 0.75) * 1e3:.1f}) | {(here - med) / med:+.1%} | "
                f"{opts['batch'] / med:.1f} |"
            )
        for name in ("planned", "uniform"):
            balance = res["balance"][name]
            costs = stage_costs(profile, balance, microbatches=opts["microbatches"])
            pairs = ", ".join(
                f"{c.compute * 1e3:.2f}->{r * 1e3:.2f}"
                for c, r in zip(costs, res["compute"][name], strict=True)
            )
            compute_rows.append(f"{world} stages, {name} {balance}: {pairs}")
        ratio = medians["uniform"] / medians["planned"]
        paired = [r["uniform"] / r["planned"] for r in res["rounds"]]
        low = quantile(res["samples"]["uniform"], 0.25) / quantile(
            res["samples"]["planned"], 0.25
        )
        plan_step = json.loads(res["plan"])["step_time"]
        err = (plan_step - medians["planned"]) / medians["planned"]
        verdict = "PASS" if ratio >= TARGET_RATIO else "FAIL"
        if world != 2:
            verdict = "not applied (the target is for 2 stages)"
        line = (
            f"{world} stages: throughput planned/uniform {ratio:.2f}x (per-round paired median "
            f"{statistics.median(paired):.2f}x, range {min(paired):.2f}-{max(paired):.2f}; "
            f"ratio of the p25 step times, the least disturbed by other load, {low:.2f}x); "
            f"target >= {TARGET_RATIO}: {verdict}. Planned step predicted "
            f"{plan_step * 1e3:.1f} ms vs measured {medians['planned'] * 1e3:.1f} ms "
            f"({err:+.1%}; target within {TARGET_ERROR:.0%}: "
            f"{'PASS' if abs(err) <= TARGET_ERROR else 'FAIL'}); copy rate "
            f"{bandwidth / 1e9:.2f} GB/s, runtime overhead {res['overhead'] * 1e3:.3f} ms of "
            "processor time per action"
        )
        summary.append(line)
    return "\n".join([*rows, *summary, *compute_rows])


def _parser() -> argparse.ArgumentParser:
    """The command line of :func:`main`."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", default="2,4", help="stage counts to run (default 2,4)")
    ap.add_argument("--batch", type=int, default=64, help="mini-batch (default 64)")
    ap.add_argument("--microbatches", type=int, default=8, help="per step (default 8)")
    ap.add_argument("--model", default="{}", help="JSON kwargs of resnet_like")
    ap.add_argument("--rounds", type=int, default=16, help="alternating rounds (default 16)")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per split per round")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per split first")
    ap.add_argument("--profile-repeats", type=int, default=20, help="timed runs per layer")
    ap.add_argument(
        "--cores",
        type=int,
        default=os.cpu_count() or 1,
        help="cores the stage processes share (default: this machine's)",
    )
    ap.add_argument("--pd-memory", default="16GiB", help="memory cap for (c)")
    ap.add_argument("--pd-bandwidth", default="25GB/s", help="bandwidth for (c)")
    ap.add_argument(
        "--allocator",
        default="tuned",
        choices=["tuned", "default"],
        help="tuned: glibc keeps freed memory (see tune_malloc); default: as glibc comes",
    )
    ap.add_argument(
        "--profile-load",
        default="busy",
        choices=["busy", "idle"],
        help="busy (default): profile while the other cores train the same model, as the "
        "other stages will; idle: profile on an otherwise idle machine",
    )
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--deadline", type=float, default=600.0, help="per launch (s)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 rounds x 2 steps")
    ap.add_argument("--json", help="also write the raw results here")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.profile_repeats = 2, 2, 1, 5
    stage_counts = [int(s) for s in args.stages.split(",") if s.strip()]
    opts = {
        "batch": args.batch,
        "microbatches": args.microbatches,
        "model": json.loads(args.model),
        "classes": 10,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "timeout": args.timeout,
        "cores": args.cores,
        "allocator": args.allocator,
    }
    allocator = tune_malloc() if args.allocator == "tuned" else "default glibc malloc"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.monotonic()
    load_before = cpu_jiffies()
    busy = max(0, min(args.cores, max(stage_counts, default=1)) - 1)
    busy = busy if args.profile_load == "busy" else 0
    profile = _profile(opts, warmup=3, repeats=args.profile_repeats, busy=busy)
    opts["profile"] = profile.to_json()
    total = sum(layer.forward + layer.backward for layer in profile.layers)
    print(
        f"resnet_like({args.model}) profiled on {profile.device}: {len(profile.layers)} layers, "
        f"micro-batch {profile.batch_size}, forward+backward {total * 1e3:.2f} ms; "
        f"mini-batch {args.batch} = {args.microbatches} micro-batches, 1f1b, Adam; "
        f"1 torch thread per process, gloo; {args.rounds} rounds x {args.steps} steps per "
        f"split, alternating; per step the slowest rank's time; medians; {allocator} in "
        f"the profiling process and every rank; profiled with {busy} other core(s) busy "
        "training the same model"
    )
    results = {}
    for world in stage_counts:
        try:
            results[world] = spawn_ranks(_rank_main, world, world, opts, timeout=args.deadline)
        except BaseException as error:
            print(f"{world} stages failed: {type(error).__name__}: {error}", file=sys.stderr)
            return 1
    wall = time.monotonic() - started
    load = load_report(load_before, cpu_jiffies(), wall)

    print()
    print("(a)+(b) resnet_like, planned (DP) vs uniform split, measured")
    print(_measured_report(results, profile, opts))
    print(load)
    print()
    print("(c) PipeDream profiles, 4 stages")
    print(_pipedream_tables(args))
    print(f"wall time {time.monotonic() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": opts["profile"], **results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
