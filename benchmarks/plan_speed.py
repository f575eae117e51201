"""How fast the planner is and how good its splits are.

    python benchmarks/plan_speed.py

1. Planning time for L layers into S stages with a binding memory cap (1.2 x the least cap any
   split fits), 1F1B with 2S micro-batches: the DP alone and the whole ``partitioner.plan`` (which
   also runs the schedule simulator). Median of 3 runs, seconds, synthetic layers.
2. Predicted bottleneck on PipeDream's real profiles: the DP against uniform layer counts,
   DeepSpeed-style parameter balancing and a torchgpipe-style greedy time balancer, all costed
   by the same model (baseline cuts moved to the nearest cut the graph allows). The DP must never
   be worse; the script fails if it is.
3. The DP's stage tables for the PipeDream profiles.
4. The whole-run search (``pipetrain plan PROFILE --devices N --batch-size B --memory CAP``,
   ``partitioner.search.candidates``) for a 100-layer synthetic profile: seconds, median of 3,
   each run cold (the kept schedules and splits cleared first, as a fresh command starts), with
   how many points it planned, pruned and refused. ``python benchmarks/plan_speed.py search``
   runs this table alone.
"""

from __future__ import annotations

import os
import platform
import sys
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from timing import median_time  # noqa: E402

from partitioner import (  # noqa: E402
    LayerCost,
    Profile,
    balance,
    load_pipedream,
    plan,
    problem_from_profile,
    smallest_cap,
    solve,
)
from partitioner.costs import Problem  # noqa: E402
from partitioner.dp import split_of  # noqa: E402
from partitioner.search import Settings, best_per_schedule, candidates, forget  # noqa: E402

LAYERS = (250, 500, 1000, 2000)
STAGES = (8, 16, 32, 64)
BANDWIDTH = 25e9
MODELS = ("alexnet", "vgg16", "resnet50", "resnet101", "inception_v3", "gnmt")


def synthetic(layers: int, seed: int = 0) -> Profile:
    """A transformer-ish stack with uneven layers: costs and sizes drawn log-normally."""
    rng = np.random.default_rng(seed)
    fwd = rng.lognormal(np.log(2e-3), 0.5, layers)
    params = rng.lognormal(np.log(5e6), 1.0, layers).astype(int)
    acts = rng.lognormal(np.log(3e7), 0.7, layers).astype(int)
    return Profile(
        device="synthetic",
        batch_size=8,
        input_bytes=int(acts[0]),
        layers=[
            LayerCost(
                f"block{i}",
                float(fwd[i]),
                float(2 * fwd[i]),
                int(acts[i]),
                int(p),
                4 * int(p),
                8 * int(p),
            )
            for i, p in enumerate(params)
        ],
    )


def speed_tables() -> None:
    dp_rows: list[list[float]] = []
    plan_rows: list[list[float]] = []
    for layers in LAYERS:
        profile = synthetic(layers)
        dp_row, plan_row = [], []
        for stages in STAGES:
            m = 2 * stages
            free = problem_from_profile(profile, stages=stages, microbatches=m, bandwidth=BANDWIDTH)
            cap = int(smallest_cap(free) * 1.2)
            problem = problem_from_profile(
                profile, stages=stages, microbatches=m, bandwidth=BANDWIDTH, memory=cap
            )
            dp_row.append(median_time(partial(solve, problem), 3))
            run = partial(
                plan, profile, stages=stages, microbatches=m, bandwidth=BANDWIDTH, memory=cap
            )
            plan_row.append(median_time(run, 3))
        dp_rows.append(dp_row)
        plan_rows.append(plan_row)
    for title, rows in (("DP (partitioner.solve)", dp_rows), ("partitioner.plan", plan_rows)):
        print(f"\n{title}: seconds, median of 3, memory cap on")
        print(f"{'L/S':>8}" + "".join(f"{s:>9}" for s in STAGES))
        for layers, row in zip(LAYERS, rows, strict=True):
            print(f"{layers:>8}" + "".join(f"{t:>9.3f}" for t in row))


# --- baselines: layer counts from other tools' rules ---


def uniform_counts(problem: Problem) -> list[int]:
    """The same number of layers per stage (give or take one)."""
    n, s = problem.layers, problem.stages
    return [n // s + (1 if t < n % s else 0) for t in range(s)]


def parameter_counts(problem: Problem) -> list[int]:
    """DeepSpeed's 'parameters' method: balance the parameter count per stage."""
    return balance([float(p) for p in problem.param_bytes], problem.stages)


def greedy_time_counts(problem: Problem) -> list[int]:
    """torchgpipe-style greedy: close stage k where the running time is nearest k/S of the
    total."""
    prefix = np.concatenate(([0.0], np.cumsum(problem.cost)))
    n, s = problem.layers, problem.stages
    bounds = [0]
    for k in range(1, s):
        lowest, highest = bounds[-1] + 1, n - (s - k)
        target = prefix[-1] * k / s
        bounds.append(min(range(lowest, highest + 1), key=lambda p: abs(prefix[p] - target)))
    bounds.append(n)
    return [b - a for a, b in zip(bounds, bounds[1:], strict=False)]


def snapped(problem: Problem, counts: list[int]) -> list[int]:
    """Bounds of ``counts`` with every cut moved to the nearest allowed cut, in order."""
    allowed = [p for p in range(1, problem.layers) if problem.allowed[p]]
    wanted = np.cumsum(counts)[:-1]
    bounds = [0]
    for k, cut in enumerate(wanted):
        left = len(wanted) - 1 - k  # cuts still to place after this one
        options = [p for p in allowed if p > bounds[-1]]
        options = options[: len(options) - left] if left else options
        bounds.append(min(options, key=lambda p: (abs(p - cut), p)))
    return [*bounds, problem.layers]


def quality_table() -> None:
    print(
        f"\nPredicted bottleneck (ms per micro-batch), 1F1B, m = 2S, {BANDWIDTH / 1e9:g} GB/s links"
    )
    header = f"{'model':<13}{'S':>3}{'DP':>10}{'uniform':>10}{'params':>10}{'greedy':>10}  worst/DP"
    print(header)
    baselines = (uniform_counts, parameter_counts, greedy_time_counts)
    for name in MODELS:
        profile = load_pipedream(name, batch_size=64 if name == "gnmt" else None)
        cuts = sum(profile.cut_allowed(c) for c in range(len(profile.layers) - 1))
        for stages in (2, 4, 8, 16):
            if stages > cuts + 1:
                continue
            problem = problem_from_profile(
                profile, stages=stages, microbatches=2 * stages, bandwidth=BANDWIDTH
            )
            best = solve(problem).bottleneck
            others = [
                split_of(problem, snapped(problem, rule(problem)), [1] * stages).bottleneck
                for rule in baselines
            ]
            if min(others) < best * (1 - 1e-12):
                raise SystemExit(f"the DP lost to a baseline on {name} with {stages} stages")
            cells = "".join(f"{x * 1e3:>10.2f}" for x in (best, *others))
            print(f"{name:<13}{stages:>3}{cells}  {max(others) / best:>7.2f}x")


def stage_tables() -> None:
    for name in MODELS:
        profile = load_pipedream(name, batch_size=64 if name == "gnmt" else None)
        result = plan(profile, stages=4, microbatches=8, bandwidth=BANDWIDTH, memory="80GB")
        print(f"\n{name}: {len(profile.layers)} layers, batch {profile.batch_size}, 4 stages")
        print(result.table())


SEARCHES = ((8, 64, "4GB"), (64, 64, "8GB"), (64, 256, "8GB"))  # devices, batch, cap


def search_table() -> None:
    """Row per (devices, batch, cap): the whole-run search's time, median of 3 cold runs."""
    profile = synthetic(100)
    settings = Settings(bandwidth=BANDWIDTH)
    print(f"\nWhole-run search, 100 layers, {BANDWIDTH / 1e9:g} GB/s: seconds, median of 3")
    print(f"{'devices':>8}{'batch':>7}{'cap':>6}{'seconds':>9}{'points':>8}{'planned':>8}"
          f"{'pruned':>8}  chosen")
    for devices, batch, cap in SEARCHES:
        found: list = []

        def run(devices: int = devices, batch: int = batch, cap: str = cap,
                found: list = found) -> None:
            found[:] = candidates(profile, devices=devices, batch_size=batch, memory=cap,
                                  settings=settings)

        seconds = median_time(run, 3, before=forget)
        chosen = next(iter(best_per_schedule(found).values()))
        planned = sum(c.plan is not None for c in found)
        pruned = sum(c.pruned for c in found)
        print(f"{devices:>8}{batch:>7}{cap:>6}{seconds:>9.2f}{len(found):>8}{planned:>8}"
              f"{pruned:>8}  {chosen.point.describe()}")


def main() -> None:
    print(
        f"python {platform.python_version()}, numpy {np.__version__}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}"
    )
    if sys.argv[1:] == ["search"]:
        search_table()
        return
    speed_tables()
    quality_table()
    stage_tables()
    search_table()


if __name__ == "__main__":
    main()
