"""partitioner.search: the whole-run search over schedule, pipeline ranks x data-parallel copies,
micro-batches and ZeRO; pruned by its floors, it returns what planning every point does (the best,
and each schedule's best within WITHIN of it)."""

from __future__ import annotations

import random

import pytest

from partitioner import LayerCost, Plan, Profile, plan
from partitioner.costs import pipeline_schedule
from partitioner.search import (
    WITHIN,
    Settings,
    _floor_factor,
    best_per_schedule,
    candidates,
    frontier,
    peak_memory,
    space,
    why_empty,
)
from schedules import lookup


def _profile(layers: int = 8, seed: int | None = None) -> Profile:
    """Uneven layers (seeded: drawn at random)."""
    rng = random.Random(seed)
    costs = []
    for i in range(layers):
        scale = 1 + i % 3 if seed is None else rng.uniform(0.2, 3.0)
        params = (1 << 18) if seed is None else rng.randint(1 << 14, 1 << 20)
        costs.append(LayerCost(
            name=f"{i}:Block", forward=1e-3 * scale, backward=2e-3 * scale,
            activation_bytes=(1 << 20) if seed is None else rng.randint(1 << 16, 1 << 21),
            param_count=params, param_bytes=4 * params, optimizer_state_bytes=8 * params))
    return Profile(device="cpu", batch_size=4, layers=costs, input_bytes=1 << 18)


def _by_hand(profile: Profile, c, memory, settings: Settings) -> Plan:
    """The candidate's point planned directly."""
    p = c.point
    return plan(profile, stages=p.stages * p.virtual_stages, microbatches=p.microbatches,
                schedule=p.schedule, memory=memory, bandwidth=settings.bandwidth,
                microbatch_size=p.microbatch_size, zero=p.zero, data_parallel=p.data_parallel,
                virtual_stages=p.virtual_stages if p.virtual_stages > 1 else 2)


def test_best_of_each_schedule_is_the_fastest_point_planned_by_hand() -> None:
    profile = _profile()
    settings = Settings()
    found = candidates(profile, devices=4, batch_size=8, memory="64MiB", prune=False)
    best = best_per_schedule(found)
    assert set(best) >= {"1f1b", "gpipe", "zb-h1", "interleaved"}
    for name, chosen in best.items():
        assert chosen.plan is not None and peak_memory(chosen.plan) <= 64 << 20
        again = _by_hand(profile, chosen, "64MiB", settings)
        assert again.step_time == chosen.plan.step_time
        assert (again.zero, again.data_parallel) == (chosen.zero, chosen.point.data_parallel)
        times = [c.plan.step_time for c in found if c.schedule == name and c.plan is not None]
        assert chosen.plan.step_time == min(times)


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_the_pruned_search_finds_what_the_exhaustive_one_does(seed) -> None:
    rng = random.Random(seed)
    profile = _profile(rng.randint(4, 12), seed)
    devices, batch = rng.choice([2, 4, 6, 8]), rng.choice([8, 12, 16])
    memory = rng.choice([None, "24MiB", "48MiB"])
    settings = Settings(bandwidth=rng.choice([None, "1GB/s"]))
    kwargs = dict(devices=devices, batch_size=batch, memory=memory, settings=settings)
    pruned = candidates(profile, **kwargs)
    every = candidates(profile, prune=False, **kwargs)
    assert len(pruned) == len(every)
    ours, theirs = best_per_schedule(pruned), best_per_schedule(every)
    fastest = next(iter(theirs.values())).plan.step_time
    near = {k: c for k, c in theirs.items() if c.plan.step_time <= WITHIN * fastest}
    assert next(iter(ours.values())).point == next(iter(theirs.values())).point
    assert {k: ours[k].point for k in near} == {k: c.point for k, c in near.items()}
    assert all(ours[k].plan.step_time == c.plan.step_time for k, c in near.items())
    for c in every:  # each floor is under the step the point's plan predicts
        if c.plan is not None:
            assert c.floor <= c.plan.step_time * (1 + 1e-9)


def test_choices_the_caller_fixes_narrow_the_search() -> None:
    profile = _profile()
    found = candidates(profile, devices=4, batch_size=8, schedules=["1f1b", "zbv"], stages=[2],
                       microbatches=[2], zero=[1])
    assert found and {c.schedule for c in found} == {"1f1b", "zbv"}
    assert {(c.stages, c.point.data_parallel, c.microbatches, c.zero) for c in found} == {
        (2, 2, 2, 1)}
    assert all(c.plan is None or c.plan.pipeline_ranks == 2 for c in found)


def test_the_space_holds_copies_that_divide_the_batch_and_enough_microbatches() -> None:
    points = list(space(_profile(), devices=4, batch_size=6))
    assert points and all(6 % (p.data_parallel * p.microbatches) == 0 for p in points)
    assert all(p.stages * p.data_parallel == 4 for p in points)
    assert all(p.microbatches >= lookup(p.schedule).least_microbatches(
        p.stages * p.virtual_stages) for p in points)
    assert {p.data_parallel for p in points} == {1, 2}  # 4 copies do not divide 6
    assert all(p.zero == 0 for p in points if p.data_parallel == 1)


def test_why_the_space_is_empty_names_the_flag() -> None:
    profile = _profile()
    assert "--stages" in why_empty(profile, devices=4, batch_size=8, stages=[3])
    assert "--batch-size" in why_empty(profile, devices=4, batch_size=3, stages=[1])
    assert "fewer --stages" in why_empty(_profile(2), devices=4, batch_size=8, stages=[4])


def test_a_tight_cap_rules_points_out_with_the_reason() -> None:
    found = candidates(_profile(), devices=2, batch_size=8, memory="12MiB", schedules=["gpipe"])
    refused = [c for c in found if c.plan is None and not c.pruned]
    assert refused and all("MiB" in c.reason and c.need and c.need > 12 << 20 for c in refused)
    assert all(peak_memory(c.plan) <= 12 << 20 for c in found if c.plan is not None)


def test_weights_over_the_cap_are_refused_before_the_split() -> None:
    found = candidates(_profile(), devices=2, batch_size=8, memory="1MiB", schedules=["1f1b"])
    assert found and all(c.plan is None and "optimizer state" in c.reason for c in found)


def test_the_floor_factor_with_one_stage_per_rank_is_the_best_weighting() -> None:
    for m in (1, 3, 8):
        for stages in (2, 4):
            exact = _floor_factor(tuple(range(stages)), m, 1.0)
            spread = tuple(range(stages)) * 2  # two stages per rank, found by weights
            assert m / stages <= _floor_factor(spread, m, 1.0) <= exact + 1e-9


def test_the_frontier_trades_time_for_memory() -> None:
    found = candidates(_profile(), devices=4, batch_size=8, memory="64MiB")
    edge = frontier(found)
    assert edge and edge[0].point == next(iter(best_per_schedule(found).values())).point
    times = [c.plan.step_time for c in edge]
    peaks = [peak_memory(c.plan) for c in edge]
    assert times == sorted(times) and peaks == sorted(peaks, reverse=True)


def test_schedules_are_generated_once() -> None:
    assert pipeline_schedule("zbv", 4, 4) is pipeline_schedule("zbv", 4, 4)
    assert pipeline_schedule("1f1b", 2, 4) is not pipeline_schedule("1f1b", 2, 5)


def test_a_plan_keeps_its_copies_and_zero_through_json() -> None:
    made = plan(_profile(), stages=2, microbatches=2, data_parallel=2, zero=1)
    again = Plan.from_json(made.to_json())
    assert (again.data_parallel, again.zero) == (2, 1) and again == made
