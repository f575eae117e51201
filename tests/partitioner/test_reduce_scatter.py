"""The planner's reduce-scatter modes at zero 2 and 3 (partitioner/costs.py): "step" counts a
step's gradients whole and two ring passes of the parameters, "microbatch" their shards and a
reduce-scatter per micro-batch; ``plan`` picks the faster that fits and says which."""

from __future__ import annotations

import pytest

from partitioner import InfeasibleError, LayerCost, Plan, Profile, make_problem, plan
from partitioner.costs import evaluate, held_weight_bytes


def _profile() -> Profile:
    layers = [
        LayerCost(name=f"{i}:Block", forward=1e-3, backward=2e-3, activation_bytes=1 << 18,
                  param_count=1 << 18, param_bytes=1 << 20, optimizer_state_bytes=2 << 20)
        for i in range(8)
    ]
    return Profile(device="cpu", batch_size=4, layers=layers, input_bytes=1 << 16)


def test_step_holds_the_gradients_whole_and_microbatch_their_shards() -> None:
    # a layer of 100 parameter bytes and 800 of optimizer state on 2 replicas; beside what
    # the step holds whole, FSDP2 keeps the shards: at zero 2 the weight's (50), under "step"
    # the gradient's, written by the reduce-scatter while the whole gradient is held (50)
    options = dict(stages=2, devices=4, weight_bytes=[1000] * 4, param_bytes=[100] * 4)
    for zero, step, microbatch in ((2, 150 + 150 + 400, 150 + 50 + 400),
                                   (3, 50 + 150 + 400, 50 + 50 + 400)):
        for mode, held in (("step", step), ("microbatch", microbatch)):
            problem = make_problem([1.0] * 4, **options, zero=zero, reduce_scatter=mode)
            assert held_weight_bytes(problem, 2).tolist() == [held] * 4, (zero, mode)
    # at zero 1 the mode changes nothing: the gradients are all-reduced whole
    ones = [make_problem([1.0] * 4, **options, zero=1, reduce_scatter=m) for m in ("step",
                                                                              "microbatch")]
    assert held_weight_bytes(ones[0], 2).tolist() == held_weight_bytes(ones[1], 2).tolist()
    with pytest.raises(ValueError, match="reduce_scatter must be one of"):
        make_problem([1.0] * 4, **options, reduce_scatter="layer")


def test_microbatch_costs_a_reduce_scatter_per_microbatch() -> None:
    # 8 micro-batches: 8 reduce-scatters and an all-gather instead of 2 passes
    options = dict(stages=1, devices=2, param_bytes=[1000], weight_bytes=[3000],
                   allreduce_bandwidth=1e3, microbatches=8, zero=2)
    step, microbatch = (
        evaluate(make_problem([1.0], **options, reduce_scatter=m), [0, 1], [2])[0]
        for m in ("step", "microbatch")
    )
    assert step.allreduce == pytest.approx(2 * 0.5 * 1000 / 1e3)
    assert microbatch.allreduce == pytest.approx(9 * 0.5 * 1000 / 1e3)
    assert microbatch.compute - step.compute == pytest.approx(7 * 0.5 / 8)


def test_plan_keeps_step_unless_only_microbatch_fits_and_says_which() -> None:
    profile = _profile()
    options = dict(stages=2, microbatches=4, devices=4, bandwidth="1GB/s", zero=2)
    free = plan(profile, **options)
    assert free.reduce_scatter == "step"  # both fit: fewer collectives is faster
    with pytest.raises(InfeasibleError) as err:
        plan(profile, **options, memory=1, reduce_scatter="step")
    cap = err.value.smallest_cap
    assert cap is not None
    tight = plan(profile, **options, memory=cap - 1)  # under step's smallest cap
    assert tight.reduce_scatter == "microbatch"
    assert tight.step_time > free.step_time
    assert Plan.from_json(tight.to_json()).reduce_scatter == "microbatch"
    with pytest.raises(ValueError, match="needs zero 2 or 3"):
        plan(profile, **{**options, "zero": 1}, reduce_scatter="microbatch")


def test_a_plan_written_before_the_mode_reads_as_step() -> None:
    text = plan(_profile(), stages=2, microbatches=4).to_json()
    old = text.replace(',\n "reduce_scatter": "step"', "")
    assert "reduce_scatter" not in old
    assert Plan.from_json(old).reduce_scatter == "step"
