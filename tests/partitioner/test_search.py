"""partitioner.search: the whole-run search over schedule, stages x replicas, micro-batches and
ZeRO, checked against planning each point by hand."""

from __future__ import annotations

from partitioner import LayerCost, Profile, plan
from partitioner.search import best_per_schedule, candidates, peak_memory
from schedules import lookup


def _profile() -> Profile:
    layers = [
        LayerCost(name=f"{i}:Block", forward=1e-3 * (1 + i % 3), backward=2e-3 * (1 + i % 3),
                  activation_bytes=1 << 20, param_count=1 << 18, param_bytes=1 << 20,
                  optimizer_state_bytes=2 << 20)
        for i in range(8)
    ]
    return Profile(device="cpu", batch_size=4, layers=layers, input_bytes=1 << 18)


def test_best_of_each_schedule_is_the_fastest_point_planned_by_hand() -> None:
    profile = _profile()
    found = candidates(profile, devices=4, batch_size=8, memory="64MiB")
    best = best_per_schedule(found)
    assert set(best) >= {"1f1b", "gpipe", "zb-h1"}
    for name, chosen in best.items():
        assert chosen.plan is not None and peak_memory(chosen.plan) <= 64 << 20
        several = lookup(name).multi_stage_per_rank  # 2 stages per rank, as candidates makes
        again = plan(profile, stages=chosen.stages * (2 if several else 1),
                     microbatches=chosen.microbatches, schedule=name, memory="64MiB",
                     devices=None if chosen.stages == 4 or several else 4,
                     microbatch_size=8 // chosen.microbatches, zero=chosen.zero)
        assert again.step_time == chosen.plan.step_time
        times = [c.plan.step_time for c in found if c.schedule == name and c.plan is not None]
        assert chosen.plan.step_time == min(times)


def test_a_tight_cap_rules_points_out_with_the_reason() -> None:
    found = candidates(_profile(), devices=2, batch_size=8, memory="12MiB", schedules=["gpipe"])
    assert any(c.plan is None and "MiB" in c.reason for c in found)
    assert all(peak_memory(c.plan) <= 12 << 20 for c in found if c.plan is not None)
