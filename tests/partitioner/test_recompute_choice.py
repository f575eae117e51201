"""checkpoint="auto": the DP and the integer program choose recomputation per stage, and only
where a memory cap needs it (issue 31, item 9), checked against brute force over every split
and every per-stage choice (tests/partitioner/split_oracle.py)."""

from __future__ import annotations

import json
import random

import pytest
from split_oracle import Instance, least_memory, random_instance, splits, stage_costs

from partitioner import (
    InfeasibleError,
    LayerCost,
    Plan,
    PlanFileError,
    Profile,
    Split,
    make_problem,
    plan,
    solve,
    solve_ilp,
)


def _auto_with_caps(rng: random.Random, inst: Instance, uniform: bool = True) -> None:
    """Recomputation allowed per stage, caps drawn where keeping activations may not fit."""
    inst.checkpoint = "auto"
    low = least_memory(inst)
    if low is not None:
        draw = [int(low * rng.uniform(0.95, 2.0)) for _ in range(inst.stages)]
        inst.memory = [draw[0]] * inst.stages if uniform else draw


def _check_choice(inst: Instance, got: Split, rel: float) -> None:
    """``got`` reaches the brute-force bottleneck within the caps, recomputes a stage only if it
    does not fit keeping its activations, and recomputes nowhere if some split that recomputes
    nowhere reaches that bottleneck."""
    found = list(splits(inst))
    best = min(split[0] for split in found)
    assert got.bottleneck == pytest.approx(best, rel=rel, abs=1e-12)
    again = tuple(got.recompute)
    costs = stage_costs(inst, list(got.bounds), list(got.replicas), again)
    assert max(t for t, _ in costs) == pytest.approx(got.bottleneck, rel=1e-9, abs=1e-12)
    assert [m for _, m in costs] == [s.memory for s in got.stages]
    kept = stage_costs(inst, list(got.bounds), list(got.replicas), (False,) * inst.stages)
    for t, cap in enumerate(inst.memory):
        assert cap is None or costs[t][1] <= cap
        if again[t]:  # recomputing because keeping would not fit
            assert cap is not None and kept[t][1] > cap
    keeping = [s for s in found if not any(s[4]) and s[0] <= best * (1 + 1e-9) + 1e-15]
    if keeping:
        assert not any(again), "recomputes though a split keeping every activation is as fast"


@pytest.mark.parametrize("seed", range(4))
def test_dp_chooses_recomputation_like_brute_force(seed: int) -> None:
    rng = random.Random(300 + seed)
    recomputed = 0
    for _ in range(40):
        inst = random_instance(rng, max_layers=7, max_stages=3, extra_devices=rng.randint(0, 1))
        _auto_with_caps(rng, inst)
        problem = make_problem(inst.forward, inst.backward, **inst.kwargs())
        if not list(splits(inst)):
            with pytest.raises(InfeasibleError) as err:
                solve(problem)
            assert err.value.smallest_cap == least_memory(inst)
            continue
        got = solve(problem)
        _check_choice(inst, got, rel=1e-9)
        recomputed += any(got.recompute)
    assert recomputed >= 3, "the caps drawn should make some stages recompute"


def test_ilp_chooses_recomputation_like_brute_force() -> None:
    rng = random.Random(9)
    recomputed = 0
    for _ in range(16):
        inst = random_instance(rng, max_layers=6, max_stages=3, unlike=True)
        _auto_with_caps(rng, inst, uniform=False)
        if not list(splits(inst)):
            continue
        got = solve_ilp(make_problem(inst.forward, inst.backward, **inst.kwargs()))
        _check_choice(inst, got, rel=1e-6)
        recomputed += any(got.recompute)
    assert recomputed >= 2, "the caps drawn should make some stages recompute"


def test_a_cap_only_recomputation_meets_is_met_by_recomputing_one_stage() -> None:
    """Two equal layers, two stages: 1F1B keeps 2 micro-batches on stage 0 and 1 on stage 1,
    so a cap of 1.5 micro-batches' activations needs stage 0, and only it, to recompute."""
    kwargs = {
        "stages": 2, "activation_bytes": [100, 100], "inflight": [2, 1], "memory": 150,
    }
    with pytest.raises(InfeasibleError):
        solve(make_problem([1.0, 1.0], [2.0, 2.0], checkpoint="never", **kwargs))
    got = solve(make_problem([1.0, 1.0], [2.0, 2.0], checkpoint="auto", **kwargs))
    assert got.recompute == [True, False]
    assert got.bottleneck == pytest.approx(4.0)  # stage 0: forward twice + backward
    assert solve(make_problem([1.0, 1.0], [2.0, 2.0], checkpoint="always", **kwargs)).recompute \
        == [True, True]


def _profile(n: int = 6) -> Profile:
    """Layers whose activations outweigh their weights, as in a transformer at long context."""
    layers = [
        LayerCost(
            name=f"layer{i}", forward=0.001 * (1 + i % 3), backward=0.002 * (1 + i % 2),
            activation_bytes=1_000_000, param_count=1000, param_bytes=4000,
            optimizer_state_bytes=8000,
        )
        for i in range(n)
    ]
    return Profile(device="test", batch_size=8, layers=layers, input_bytes=1_000_000)


def test_plan_recomputes_where_the_cap_needs_it_and_records_it(tmp_path) -> None:
    """The issue's case: a cap infeasible without recomputation and feasible with it is planned
    (by default) with recomputation on the stages that need it, which the plan file keeps."""
    options = {"stages": 2, "microbatches": 4, "schedule": "gpipe"}
    free = plan(_profile(), **options)
    assert free.checkpoints == ["never", "never"] and free.checkpoint == "auto"
    cap = max(s.memory_bytes for s in free.per_stage) // 2
    with pytest.raises(InfeasibleError) as err:
        plan(_profile(), memory=cap, checkpoint="never", **options)
    assert "checkpoint='auto'" in str(err.value)
    assert "--checkpoint auto" in err.value.for_command_line()
    assert "checkpoint=" not in err.value.for_command_line()
    tight = plan(_profile(), memory=cap, **options)
    assert "always" in tight.checkpoints
    assert all(s.memory_bytes <= cap for s in tight.per_stage)
    for stage in tight.per_stage:  # a recomputing stage pays its forward again in backward
        layers = _profile().layers[stage.layers[0] : stage.layers[1]]
        backward = sum(layer.backward for layer in layers)
        forward = sum(layer.forward for layer in layers)
        again = forward if stage.checkpoint == "always" else 0.0
        assert stage.backward_time == pytest.approx(backward + again)
    assert tight.bottleneck > free.bottleneck
    path = tmp_path / "plan.json"
    tight.save(path)
    assert Plan.load(path) == tight
    assert [s["checkpoint"] for s in json.loads(path.read_text())["per_stage"]] == \
        tight.checkpoints


@pytest.mark.parametrize("mode", ["never", "always"])
def test_plan_files_without_per_stage_modes_still_load(tmp_path, mode: str) -> None:
    data = json.loads(plan(_profile(), stages=2, microbatches=2, checkpoint=mode).to_json())
    for stage in data["per_stage"]:
        del stage["checkpoint"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    assert Plan.load(path).checkpoints == [mode, mode]
    data["checkpoint"] = "auto"  # no per-stage modes: nothing says what each stage does
    path.write_text(json.dumps(data))
    with pytest.raises(PlanFileError, match="stage 0"):
        Plan.load(path)


def test_infeasible_messages_never_suggest_what_is_in_force() -> None:
    for schedule, checkpoint in [("1f1b", "always"), ("1f1b", "auto"), ("gpipe", "never")]:
        with pytest.raises(InfeasibleError) as err:
            plan(_profile(), stages=2, microbatches=4, memory=1000, schedule=schedule,
                 checkpoint=checkpoint)
        flags = err.value.for_command_line()
        assert ("--checkpoint" in flags) == (checkpoint == "never"), flags
        assert ("--schedule 1f1b" in flags) == (schedule == "gpipe"), flags
        assert "--memory" in flags and err.value.smallest_cap is not None
