"""The DP finds the brute-force optimum: bottleneck, then peak memory, on random instances."""

from __future__ import annotations

import random

import pytest
from split_oracle import Instance, least_memory, optimum, random_instance, stage_costs

from partitioner import InfeasibleError, make_problem, solve
from partitioner.costs import held_weight_bytes, inflight
from partitioner.dp import least_bottleneck
from schedules import build, simulate


def _with_caps(rng: random.Random, inst: Instance, uniform: bool = True) -> None:
    """Caps between 'nothing fits' and 'everything fits' so that they bind."""
    low = least_memory(inst)
    if low is None:  # too few allowed cuts: no cap matters
        return
    draw = [int(low * rng.uniform(0.9, 1.6)) for _ in range(inst.stages)]
    inst.memory = [draw[0]] * inst.stages if uniform else draw


def _check(inst: Instance) -> None:
    problem = make_problem(inst.forward, inst.backward, **inst.kwargs())
    want = optimum(inst)
    if want is None:
        with pytest.raises(InfeasibleError) as err:
            solve(problem)
        assert err.value.smallest_cap == least_memory(inst)
        return
    got = solve(problem)
    assert got.bottleneck == pytest.approx(want[0], rel=1e-9, abs=1e-12)
    assert got.peak_memory == want[1]
    assert sum(got.balance) == len(inst.forward) and min(got.balance) >= 1
    assert all(inst.allowed[b] for b in got.bounds)
    costs = stage_costs(inst, list(got.bounds), list(got.replicas), tuple(got.recompute))
    assert max(t for t, _ in costs) == pytest.approx(got.bottleneck, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_times_only_match_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        _check(random_instance(rng, bytes_on=False, links=False, forbid=False))


@pytest.mark.parametrize("seed", range(4))
def test_transfers_and_forbidden_cuts_match_brute_force(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(40):
        _check(random_instance(rng))


@pytest.mark.parametrize("seed", range(4))
def test_memory_caps_match_brute_force(seed: int) -> None:
    rng = random.Random(200 + seed)
    for _ in range(40):
        inst = random_instance(rng)
        _with_caps(rng, inst)
        _check(inst)


@pytest.mark.parametrize("seed", range(3))
def test_unlike_devices_in_a_chain_match_brute_force(seed: int) -> None:
    rng = random.Random(300 + seed)
    for _ in range(30):
        inst = random_instance(rng, unlike=True)
        _with_caps(rng, inst, uniform=False)
        _check(inst)


@pytest.mark.parametrize("seed", range(3))
def test_replication_matches_brute_force(seed: int) -> None:
    rng = random.Random(400 + seed)
    for _ in range(25):
        inst = random_instance(rng, max_layers=6, max_stages=3, extra_devices=rng.randint(1, 3))
        if rng.random() < 0.5:
            _with_caps(rng, inst)
        _check(inst)


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("reduce_scatter", ["step", "microbatch"])
def test_replication_under_zero_matches_brute_force(zero: int, reduce_scatter: str) -> None:
    # replicas divide what ZeRO shards, so caps that bind unsharded pass with more replicas
    rng = random.Random(500 + zero)
    for _ in range(25):
        inst = random_instance(rng, max_layers=6, max_stages=3, extra_devices=rng.randint(1, 3))
        inst.zero, inst.reduce_scatter = zero, reduce_scatter
        inst.weight_bytes = [2 * p + rng.randint(0, 2000) for p in inst.param_bytes]
        # some layers hold a weight another layer holds too (whole at zero 2 and 3)
        inst.tied_bytes = [rng.choice([0, 0, p // 3, p]) for p in inst.param_bytes]
        _with_caps(rng, inst)
        _check(inst)


def test_a_cap_too_small_for_whole_stages_fits_when_replicas_shard_them() -> None:
    # 4 layers of 1000 weight bytes (100 of parameters), 2 stages on 4 devices: a stage of 2
    # layers holds 2000 bytes unsharded; at zero=1 on 2 replicas 2 x (200 + 800 / 2) = 1200
    options = dict(stages=2, devices=4, weight_bytes=[1000] * 4, param_bytes=[100] * 4,
                   memory=1500)
    with pytest.raises(InfeasibleError):
        solve(make_problem([1.0] * 4, **options))
    split = solve(make_problem([1.0] * 4, **options, zero=1))
    assert split.replicas == (2, 2) and split.peak_memory == 1200


def test_a_tied_weight_stays_whole_under_zero_2_and_3() -> None:
    # 4 layers of 1000 weight bytes (100 of parameters, 800 of optimizer state); layers 0 and
    # 3 share their whole weight (an embedding and its head), 2 stages on 4 devices. At zero 3
    # on 2 replicas, gradients reduced per micro-batch, an untied layer holds 50 + 50 + 400 =
    # 500, a tied one all its 1000 (the runtime keeps it out of the shards); at zero 1 the tie
    # changes nothing: 100 + 100 + 400; at zero 2 FSDP2 keeps the weight's shard beside the
    # gathered weight: 100 + 50 + 50 + 400
    options = dict(stages=2, devices=4, weight_bytes=[1000] * 4, param_bytes=[100] * 4,
                   reduce_scatter="microbatch")
    tied = [100, 0, 0, 100]
    for zero, per_layer in ((1, [600] * 4), (2, [1000, 600, 600, 1000]),
                            (3, [1000, 500, 500, 1000])):
        problem = make_problem([1.0] * 4, **options, tied_bytes=tied, zero=zero)
        assert held_weight_bytes(problem, 2).tolist() == per_layer
    untied = solve(make_problem([1.0] * 4, **options, zero=3, memory=1000))
    assert untied.peak_memory == 1000
    with pytest.raises(InfeasibleError) as err:
        solve(make_problem([1.0] * 4, **options, tied_bytes=tied, zero=3, memory=1000))
    assert err.value.smallest_cap == 1500
    # half of layer 0's weight tied: 50 whole and its 400 of state, the rest divided
    half = make_problem([1.0] * 4, **options, tied_bytes=[50, 0, 0, 0], zero=3)
    assert held_weight_bytes(half, 2)[0] == 2 * 50 + 400 + 25 + 25 + 200
    with pytest.raises(ValueError, match="tied_bytes is part of param_bytes"):
        make_problem([1.0] * 4, **options, tied_bytes=[101, 0, 0, 0])


def test_replication_splits_the_heavy_stage() -> None:
    # One layer costs as much as the other three together: with two spare devices the DP
    # replicates it instead of leaving it the bottleneck.
    times = [6.0, 1.0, 1.0, 1.0]
    alone = solve(make_problem(times, stages=2))
    shared = solve(make_problem(times, stages=2, devices=4))
    assert alone.bottleneck == pytest.approx(6.0)
    assert shared.replicas[0] >= 2
    assert shared.bottleneck < alone.bottleneck


def test_ties_break_toward_less_memory() -> None:
    # Layer 0 alone is the bottleneck; layers 1-3 fit in two stages either as [1] [2, 3] or as
    # [1, 2] [3], equally fast. Only the second keeps the two heavy layers apart.
    problem = make_problem([10.0, 1.0, 1.0, 1.0], stages=3, weight_bytes=[0, 0, 500, 500])
    split = solve(problem)
    assert split.bottleneck == pytest.approx(10.0)
    assert split.bounds == (0, 1, 3, 4)
    assert split.peak_memory == 500


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_inflight_matches_the_simulator(schedule: str) -> None:
    for stages in range(1, 6):
        for microbatches in range(1, 8):
            peak = simulate(build(schedule, stages, microbatches), 1.0, 1.0).peak_inflight
            assert inflight(schedule, stages, microbatches) == list(peak)


def test_float_search_fallback_is_exact_too(monkeypatch: pytest.MonkeyPatch) -> None:
    # With the candidate lists disabled the DP bisects on the float bits and the memory
    # bytes instead.
    monkeypatch.setattr("partitioner.dp._MAX_CANDIDATES", -1)
    monkeypatch.setattr("partitioner.dp._FEW_CANDIDATES", -1)
    rng = random.Random(500)
    for _ in range(20):
        inst = random_instance(rng)
        _with_caps(rng, inst)
        _check(inst)


@pytest.mark.parametrize("seed", range(3))
def test_starting_from_the_uncapped_bottleneck_changes_nothing(seed: int) -> None:
    # What a search passes solve() for problems of the same costs (partitioner.reuse).
    rng = random.Random(700 + seed)
    for _ in range(30):
        inst = random_instance(rng)
        _with_caps(rng, inst)
        problem = make_problem(inst.forward, inst.backward, **inst.kwargs())
        try:
            want = solve(problem)
        except InfeasibleError:
            continue
        least = least_bottleneck(problem)
        assert least <= want.bottleneck
        assert solve(problem, least) == want
