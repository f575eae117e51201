"""The integer program and the DP solve the same problem: same bottleneck, also vs brute force."""

from __future__ import annotations

import random

import pytest
from split_oracle import least_memory, optimum, random_instance

from partitioner import InfeasibleError, load_pipedream, make_problem, plan, solve, solve_ilp


def _caps(rng: random.Random, inst, uniform: bool) -> None:
    low = least_memory(inst)
    if low is not None:
        draw = [int(low * rng.uniform(1.0, 1.5)) for _ in range(inst.stages)]
        inst.memory = [draw[0]] * inst.stages if uniform else draw


def test_ilp_matches_dp_on_identical_devices() -> None:
    rng = random.Random(7)
    for _ in range(24):
        inst = random_instance(rng, max_layers=7, max_stages=4)
        _caps(rng, inst, uniform=True)
        problem = make_problem(inst.forward, inst.backward, **inst.kwargs())
        if optimum(inst) is None:
            with pytest.raises(InfeasibleError):
                solve_ilp(problem)
            continue
        dp, ilp = solve(problem), solve_ilp(problem)
        assert ilp.bottleneck == pytest.approx(dp.bottleneck, rel=1e-6)
        assert min(ilp.balance) >= 1 and all(inst.allowed[b] for b in ilp.bounds)


def test_ilp_matches_brute_force_on_unlike_devices() -> None:
    rng = random.Random(8)
    for _ in range(12):
        inst = random_instance(rng, max_layers=7, max_stages=4, unlike=True)
        _caps(rng, inst, uniform=False)
        want = optimum(inst)
        if want is None:
            continue
        got = solve_ilp(make_problem(inst.forward, inst.backward, **inst.kwargs()))
        assert got.bottleneck == pytest.approx(want[0], rel=1e-6)
        assert got.peak_memory == want[1]


def test_ilp_refuses_replication() -> None:
    with pytest.raises(ValueError, match="one device per stage"):
        solve_ilp(make_problem([1.0, 2.0, 3.0], stages=2, devices=3))


@pytest.mark.parametrize("name", ["vgg16", "gnmt", "resnet50"])
def test_ilp_matches_dp_on_real_profiles(name: str) -> None:
    profile = load_pipedream(name, batch_size=64 if name == "gnmt" else None)
    options = {"stages": 4, "microbatches": 4, "bandwidth": "25GB/s", "memory": "40GB"}
    dp = plan(profile, solver="dp", **options)
    ilp = plan(profile, solver="ilp", **options)
    assert (dp.solver, ilp.solver) == ("dp", "ilp")
    assert ilp.bottleneck == pytest.approx(dp.bottleneck, rel=1e-6)
    peak = [max(s.memory_bytes for s in p.per_stage) for p in (dp, ilp)]
    assert peak[0] == peak[1]
