"""balance(): layers per stage minimising the largest stage sum, against brute force."""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest

from partitioner import balance, inflight, make_problem, smallest_cap, solve


def _largest(times: list[float], counts: list[int]) -> float:
    bounds = np.concatenate(([0], np.cumsum(counts)))
    return max(sum(times[a:b]) for a, b in zip(bounds, bounds[1:], strict=False))


def _brute(times: list[float], stages: int) -> float:
    n = len(times)
    return min(
        _largest(times, [b - a for a, b in zip((0, *cuts), (*cuts, n), strict=True)])
        for cuts in itertools.combinations(range(1, n), stages - 1)
    )


def test_balance_matches_brute_force() -> None:
    rng = random.Random(11)
    for _ in range(150):
        n = rng.randint(1, 10)
        stages = rng.randint(1, n)
        times = [rng.choice([0.0, rng.uniform(0, 1), float(rng.randint(1, 3))]) for _ in range(n)]
        counts = balance(times, stages)
        assert len(counts) == stages and sum(counts) == n and min(counts) >= 1
        assert _largest(times, counts) == pytest.approx(_brute(times, stages), rel=1e-12)


def test_balance_of_equal_layers_is_even() -> None:
    assert sorted(balance([1.0] * 12, 4)) == [3, 3, 3, 3]
    assert max(balance([2.0] * 10, 3)) == 4


def test_balance_refuses_more_stages_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot give 5 stages a layer each from 3 layers"):
        balance([1.0, 1.0, 1.0], 5)


@pytest.mark.slow
def test_two_thousand_layers_into_64_stages_under_a_second() -> None:
    rng = np.random.default_rng(0)
    n, stages = 2000, 64
    fwd = rng.uniform(1e-4, 1e-3, n)
    acts = rng.integers(10**6, 10**8, n)
    kwargs = {
        "stages": stages,
        "weight_bytes": rng.integers(0, 10**8, n),
        "activation_bytes": acts,
        "cut_bytes": np.concatenate(([10**7], acts[:-1], [0])),
        "inflight": inflight("1f1b", stages, 2 * stages),
        "bandwidth": 1e10,
    }
    cap = int(smallest_cap(make_problem(fwd, 2 * fwd, **kwargs)) * 1.2)
    problem = make_problem(fwd, 2 * fwd, memory=cap, **kwargs)
    start = time.perf_counter()
    split = solve(problem)
    assert time.perf_counter() - start < 1.0
    assert split.peak_memory <= cap
