"""The generator of test_equivalence.py drives ``pipetrain profile`` and ``plan`` (the Python
functions the command calls, and for a fixed sample the command itself): no generated model
crashes them, the profile has one entry per position of the Sequential (a module used at two
positions counted at both, with its parameters each time, as the model runs it), and every plan
puts every layer in exactly one stage."""

from __future__ import annotations

import json
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import partitioner
from pipetrain.tools import cli
from pipetrain.tools.meta_profile import profile
from pipetrain.tools.profiler import ProfileNoiseWarning
from schedules.registry import lookup
from tests.property.model_space import (
    BATCH,
    SCHEDULES,
    VOCAB,
    ModelSpec,
    RandomChooser,
    build_model,
    draw_model,
    sample_input,
)
from tests.property.test_equivalence import HypothesisChooser

pytestmark = pytest.mark.usefixtures("one_thread")

FAST_EXAMPLES = 60
LONG_EXAMPLES = 1000
CLI_SAMPLE = 4


@st.composite
def models(draw: st.DrawFn) -> ModelSpec:
    return draw_model(HypothesisChooser(draw))


def check_profile(spec: ModelSpec) -> partitioner.Profile:
    """The profile of ``spec``'s model has each position's class and parameter count."""
    model = build_model(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ProfileNoiseWarning)  # one repeat: timings are noise
        result = profile(model, sample_input(spec, 0), warmup=0, repeats=1)
    assert [layer.name for layer in result.layers] == [
        f"{i}:{type(layer).__name__}" for i, layer in enumerate(model)
    ], f"the profile of {spec} does not list each position of the model"
    assert [layer.param_count for layer in result.layers] == [
        sum(p.numel() for p in layer.parameters()) for layer in model
    ], f"the profile of {spec} miscounts parameters"
    return result


def check_plans(spec: ModelSpec, costs: partitioner.Profile) -> None:
    """Every schedule's plan at every stage count that fits puts each layer in one stage."""
    layers = len(spec)
    for schedule in SCHEDULES:
        step = 2 if lookup(schedule).multi_stage_per_rank else 1  # interleaved: 2 per rank
        for stages in range(step, min(4, layers) + 1, step):
            plan = partitioner.plan(costs, stages=stages, microbatches=4, schedule=schedule)
            assert len(plan.balance) == stages and min(plan.balance) >= 1, (spec, plan.balance)
            assert sum(plan.balance) == layers, f"{schedule} plan of {spec}: {plan.balance}"


@settings(max_examples=FAST_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_profile_and_plan_count_every_layer(spec):
    check_plans(spec, check_profile(spec))


@pytest.mark.slow
@settings(max_examples=LONG_EXAMPLES, derandomize=True, database=None, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(models())
def test_profile_and_plan_count_every_layer_long(spec):
    check_plans(spec, check_profile(spec))


@pytest.mark.parametrize("seed", range(CLI_SAMPLE))
def test_the_commands_profile_and_plan_generated_models(seed, tmp_path, capsys):
    """``pipetrain profile`` then ``pipetrain plan`` on the command line's code path."""
    spec = draw_model(RandomChooser(seed))
    tokens_in = spec.tokens[0] == "embedding"
    shape = [BATCH, *(sample_input(spec, 0).shape[1:])]
    profile_json = tmp_path / "profile.json"
    kwargs = {"tokens": list(spec.tokens), "input_shape": list(spec.input_shape)}
    code = cli.main([
        "profile", "tests.property.model_space:model_of", "--kwargs", json.dumps(kwargs),
        "--input-shape", ",".join(map(str, shape)), "--warmup", "0", "--repeats", "1",
        "--threads", "1", "-o", str(profile_json),
        *(["--input-dtype", "int64", "--input-high", str(VOCAB)] if tokens_in else []),
    ])
    assert code == 0, capsys.readouterr().err
    costs = partitioner.Profile.from_json(profile_json.read_text())
    assert len(costs.layers) == len(spec), f"{spec}: {len(costs.layers)} profile entries"
    stages = min(2, len(spec))
    code = cli.main(["plan", str(profile_json), "--stages", str(stages), "--microbatches", "4"])
    out = capsys.readouterr().out
    assert code == 0 and f"{len(spec)} layers -> {stages} stages" in out, out


def test_profile_counts_a_module_used_twice_at_each_position():
    """Found on main before issue 38's fix: the profile of [Linear a, Linear a, Linear]
    failed with "zip() argument 2 is longer than argument 1"."""
    spec = ModelSpec((4,), ("linear", "again:0", "linear"))
    check_plans(spec, check_profile(spec))
