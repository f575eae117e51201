"""Plans for every synchronous schedule: the zero-bubble schedules split each layer's backward
into B and W by a stated rule, and "interleaved" runs its (virtual) stages on fewer ranks."""

from __future__ import annotations

import json

import pytest

from partitioner import InfeasibleError, Plan, load_pipedream, plan, simulate_split
from partitioner.costs import weight_gradient_share
from pipetrain.tools.cli import main

SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]
STAGES, MICROBATCHES = 4, 8


@pytest.fixture(scope="module")
def vgg16():
    return load_pipedream("vgg16")


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_every_schedule_plans_a_bundled_profile(vgg16, schedule: str) -> None:
    result = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule=schedule)
    assert result.schedule == schedule and len(result.balance) == STAGES
    assert result.step_time > 0 and 0 <= result.bubble_fraction < 1
    ranks = STAGES // 2 if schedule == "interleaved" else STAGES
    assert result.pipeline_ranks == ranks
    assert result.stage_to_rank == [t % ranks for t in range(STAGES)]


def test_zero_bubble_predicts_a_shorter_step_than_1f1b_on_the_same_split(vgg16) -> None:
    base = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="1f1b")
    for schedule in ("zb-h1", "zb-h2"):
        zb = simulate_split(vgg16, base.balance, microbatches=MICROBATCHES, schedule=schedule)
        assert zb.step_time < base.step_time
        assert zb.bubble_fraction < base.bubble_fraction
    zb_plan = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="zb-h1")
    assert zb_plan.step_time < base.step_time


def test_interleaved_has_less_bubble_than_1f1b_on_the_same_split(vgg16) -> None:
    inter = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="interleaved")
    one = simulate_split(vgg16, inter.balance, microbatches=MICROBATCHES, schedule="1f1b")
    assert inter.bubble_fraction < one.bubble_fraction


def test_w_is_half_the_backward_of_layers_with_parameters(vgg16) -> None:
    result = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="zb-h1")
    for stage in result.per_stage:
        layers = vgg16.layers[stage.layers[0] : stage.layers[1]]
        expected = sum(layer.backward / 2 for layer in layers if layer.param_count > 0)
        assert stage.weight_time == pytest.approx(expected)
        assert 0 < stage.weight_time < stage.backward_time
    assert weight_gradient_share(0.004, 0) == 0.0  # ReLU, pooling: no weights, no W


def test_virtual_stages_must_divide_the_stages(vgg16) -> None:
    with pytest.raises(ValueError, match=r"virtual_stages=3 .* got stages=4; use 3 or 6 stages"):
        plan(vgg16, stages=4, microbatches=8, schedule="interleaved", virtual_stages=3)
    four = plan(vgg16, stages=4, microbatches=8, schedule="interleaved", virtual_stages=4)
    assert four.pipeline_ranks == 1
    with pytest.raises(ValueError, match="leave out devices"):
        plan(vgg16, stages=4, microbatches=8, schedule="interleaved", devices=8)


def test_interleaved_memory_cap_holds_per_rank(vgg16) -> None:
    free = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="interleaved")
    per_rank = [0, 0]
    for t, stage in enumerate(free.per_stage):
        per_rank[t % 2] += stage.memory_bytes
    biggest_stage = max(s.memory_bytes for s in free.per_stage)
    assert biggest_stage < max(per_rank)  # a cap between them binds only per rank
    with pytest.raises(InfeasibleError, match="rank 0 holds"):
        plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="interleaved",
             memory=max(per_rank) - 1)
    fits = plan(vgg16, stages=STAGES, microbatches=MICROBATCHES, schedule="interleaved",
                memory=max(per_rank))
    assert fits.balance == free.balance


def test_plans_without_weight_time_still_load(vgg16) -> None:
    data = json.loads(plan(vgg16, stages=2, microbatches=4).to_json())
    for stage in data["per_stage"]:
        del stage["weight_time"]
    assert all(s.weight_time == 0.0 for s in Plan.from_json(json.dumps(data)).per_stage)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_cli_plans_and_simulates_every_schedule(tmp_path, capsys, schedule: str) -> None:
    out = tmp_path / "plan.json"
    args = ["pipedream:vgg16", "--stages", "4", "--microbatches", "8", "--schedule", schedule]
    assert main(["plan", *args, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert ("half of it for layers with parameters" in printed) == schedule.startswith("zb")
    assert ("on 2 ranks, 2 virtual stages per rank" in printed) == (schedule == "interleaved")
    assert main(["simulate", str(out)]) == 0
    assert "predicted step time" in capsys.readouterr().out
