"""A profile that timed the split backward apart (``backward_input``, ``backward_weight``):
the split-backward schedules are planned with B and W as measured (on a CPU their sum ran
1.3-1.8x the whole backward, benchmarks/plan_accuracy.py), the others as before."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner import LayerCost, Profile, simulate_split, stage_costs
from partitioner.costs import pipeline_schedule, split_backward_time
from partitioner.search import best_per_schedule, candidates
from schedules.simulate import simulate


def _profile(b: float | None = None, w: float | None = None) -> Profile:
    layers = [LayerCost(name=f"{i}:Block", forward=1e-3, backward=2e-3, activation_bytes=1 << 10,
                        param_count=1 << 10, param_bytes=1 << 12, backward_input=b,
                        backward_weight=w) for i in range(4)]
    return Profile(device="cpu", batch_size=4, layers=layers, input_bytes=1 << 10)


def test_split_times_lengthen_the_split_schedules_by_what_the_simulator_says() -> None:
    old, measured = _profile(), _profile(1.5e-3, 1.5e-3)  # B + W = 1.5 x backward
    longer = simulate_split(measured, [2, 2], microbatches=4, schedule="zb-h1")
    expected = simulate(pipeline_schedule("zb-h1", 2, 4), forward=[2e-3] * 2,
                        backward=[3e-3] * 2, weight=[3e-3] * 2).step_time
    assert longer.step_time == pytest.approx(expected)
    assert longer.step_time > simulate_split(old, [2, 2], microbatches=4,
                                             schedule="zb-h1").step_time
    for name in ("1f1b", "gpipe"):  # a whole backward: as profiled
        assert (simulate_split(measured, [2, 2], microbatches=4, schedule=name).step_time
                == simulate_split(old, [2, 2], microbatches=4, schedule=name).step_time)


def test_the_search_leaves_zero_bubble_when_w_is_expensive() -> None:
    def fastest(profile: Profile) -> str:
        found = candidates(profile, devices=2, batch_size=8, schedules=["1f1b", "zb-h1"],
                           stages=[2], zero=[0])
        return next(iter(best_per_schedule(found)))

    assert fastest(_profile()) == "zb-h1"  # B and W half the backward each: no bubble
    assert fastest(_profile(2e-3, 2e-3)) == "1f1b"  # a second pass as long as the first


def test_split_times_round_trip_and_come_in_pairs() -> None:
    measured = _profile(1.5e-3, 1.5e-3)
    assert Profile.from_json(measured.to_json()) == measured
    assert "backward_input" not in _profile().to_json()
    with pytest.raises(ValueError, match="both or neither"):
        replace(measured.layers[0], backward_weight=None)


def test_a_layer_without_an_input_gradient_is_all_w_and_never_more() -> None:
    """An embedding's B is empty (its input is token ids): W is the whole backward. Scaled
    to the planned micro-batch that must not round above B + W (it did, by one ulp, with
    these times, and planning raised)."""
    embedding = replace(_profile().layers[0], backward=0.0008444218515250481,
                        backward_input=0.0, backward_weight=0.0007579544029403025)
    profile = replace(_profile(), layers=[embedding, *_profile().layers[1:]])
    found = simulate_split(profile, [2, 2], microbatches=4, schedule="zb-h1")
    assert found.step_time > 0
    for whole in (0.000420571580830845, 1e-3, 3e-7):
        total, weight = split_backward_time(embedding, whole)
        assert weight == total


def test_a_split_backward_under_recomputation_rebuilds_the_forward_for_b_and_for_w() -> None:
    """The runtime's W backpropagates a checkpointed micro-batch a second time, which runs its
    forward once more (pipetrain/runtime/split_backward.py): two rebuilt forwards per
    micro-batch, one in B and one in W, except in the first stage, whose B has no input
    gradient to find (counted: tests/runtime/test_split_recompute.py); a whole backward
    rebuilds once."""
    profile = _profile(1.5e-3, 1.5e-3)  # per stage of two layers: F 2 ms, B 3 ms, W 3 ms
    split = stage_costs(profile, [2, 2], microbatches=4, schedule="zb-h1", checkpoint="always")
    assert [s.backward for s in split] == pytest.approx([8e-3, 10e-3])
    assert [s.weight for s in split] == pytest.approx([3e-3, 5e-3])
    whole = stage_costs(profile, [2, 2], microbatches=4, schedule="1f1b", checkpoint="always")
    assert [s.backward for s in whole] == pytest.approx([6e-3] * 2)
    step = simulate_split(profile, [2, 2], microbatches=4, schedule="zb-h1", checkpoint="always")
    expected = simulate(pipeline_schedule("zb-h1", 2, 4), forward=[2e-3] * 2,
                        backward=[5e-3, 5e-3], weight=[3e-3, 5e-3]).step_time
    assert step.step_time == pytest.approx(expected)
