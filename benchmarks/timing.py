"""Timing helpers the benchmarks share: the median of repeated runs, quantiles, the order of a
round-robin round and the slowest rank's time."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


def median_time(
    run: Callable[[], object], repeats: int, before: Callable[[], object] | None = None
) -> float:
    """The median wall time in seconds of ``repeats`` calls of ``run`` (``before``, e.g. a
    barrier, runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def quantile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated linearly between order statistics."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def rotation(names: Sequence[T], round_: int) -> list[T]:
    """The order of round ``round_`` of a round-robin: ``names`` rotated by the round number,
    so that no variant always runs first (or right after the same one)."""
    k = round_ % len(names)
    return [*names[k:], *names[:k]]


def slowest(times: Sequence[float]) -> list[float]:
    """Per step, the slowest rank's time: ``times`` (this rank's) reduced by max over the
    default process group."""
    import torch
    import torch.distributed as dist

    worst = torch.tensor(list(times), dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return worst.tolist()


def round_robin(
    steps: dict[str, Callable[[], object]], rounds: int, repeats: int
) -> dict[str, list[float]]:
    """Per variant, the slowest rank's time of each of its steps: ``rounds`` rounds, each
    running every variant ``repeats`` times in :func:`rotation` order, a barrier before each
    step (every rank of the default process group calls it)."""
    import torch
    import torch.distributed as dist

    names = list(steps)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in rotation(names, r):
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                steps[name]()
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                times[name].append(float(took))
    return times
