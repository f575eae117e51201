"""Plans: predicted figures, JSON round trip, model checks and the infeasible-cap message."""

from __future__ import annotations

import json
import re

import pytest

from partitioner import (
    Host,
    InfeasibleError,
    LayerCost,
    Plan,
    PlanFileError,
    PlanMismatchError,
    PlannerError,
    Profile,
    plan,
)
from schedules import Kind, build, simulate


def _profile(n: int = 6) -> Profile:
    layers = [
        LayerCost(
            name=f"layer{i}",
            forward=0.001 * (1 + i % 3),
            backward=0.002 * (1 + i % 2),
            activation_bytes=1_000_000 * (n - i),
            param_count=1000 * (i + 1),
            param_bytes=4000 * (i + 1),
            optimizer_state_bytes=8000 * (i + 1),
        )
        for i in range(n)
    ]
    return Profile(device="test-gpu", batch_size=8, layers=layers, input_bytes=2_000_000)


def test_predictions_come_from_the_simulator() -> None:
    result = plan(_profile(), stages=3, microbatches=4, bandwidth="1GB/s", microbatch_size=4)
    sim = simulate(
        build("1f1b", 3, 4),
        [s.forward_time for s in result.per_stage],
        [s.backward_time for s in result.per_stage],
        [s.transfer_time for s in result.per_stage[:-1]],
    )
    assert result.step_time == pytest.approx(sim.step_time)
    assert result.bubble_fraction == pytest.approx(sim.bubble_fraction)
    assert result.samples_per_second == pytest.approx(4 * 4 / sim.step_time)
    # half the profiled batch: half the time per micro-batch
    profile = _profile()
    first = result.per_stage[0]
    want = sum(layer.forward for layer in profile.layers[: first.layers[1]]) / 2
    assert first.forward_time == pytest.approx(want)
    # a chain sends its last layer's output, scaled to the micro-batch
    for stage in result.per_stage[:-1]:
        last = profile.layers[stage.layers[1] - 1]
        assert stage.transfer_bytes == last.activation_bytes // 2
        assert stage.transfer_time == pytest.approx(stage.transfer_bytes / 1e9)


def test_plan_json_round_trip(tmp_path) -> None:
    result = plan(_profile(), stages=3, microbatches=4, schedule="gpipe", memory="1GiB")
    path = tmp_path / "plan.json"
    result.save(path)
    again = Plan.load(path)
    assert again == result
    data = json.loads(path.read_text())
    assert data["format"] == "pipetrain-plan" and data["version"] == 1
    assert data["stage_to_rank"] == [0, 1, 2]


def test_replicated_plan_lists_ranks_per_stage() -> None:
    result = plan(_profile(), stages=2, microbatches=4, devices=4, bandwidth="10GB/s")
    ranks = [result.ranks(t) for t in range(2)]
    assert sorted(r for group in ranks for r in group) == list(range(sum(map(len, ranks))))
    assert max(map(len, ranks)) > 1  # four devices for two stages: one is replicated
    assert result.stage_to_rank == ranks
    alone = plan(_profile(), stages=2, microbatches=4, bandwidth="10GB/s")
    assert result.bottleneck < alone.bottleneck
    assert Plan.from_json(result.to_json()) == result


def test_plan_file_errors_name_the_problem(tmp_path) -> None:
    text = plan(_profile(), stages=2, microbatches=2).to_json()
    data = json.loads(text)
    data["version"] = 9
    with pytest.raises(PlanFileError, match="version 9"):
        Plan.from_json(json.dumps(data))
    data = json.loads(text)
    del data["per_stage"][1]["memory_bytes"]
    with pytest.raises(PlanFileError, match="stage 1 is missing the field 'memory_bytes'"):
        Plan.from_json(json.dumps(data))
    with pytest.raises(PlanFileError, match="pipetrain-plan"):
        Plan.from_json(_profile().to_json())


def test_check_model_accepts_the_planned_model() -> None:
    profile = _profile()
    result = plan(profile, stages=2, microbatches=2)
    result.check_model(profile.names, [layer.param_count for layer in profile.layers])


def test_check_model_says_what_differs() -> None:
    profile = _profile()
    result = plan(profile, stages=2, microbatches=2)
    names = profile.names
    counts = [layer.param_count for layer in profile.layers]
    with pytest.raises(PlanMismatchError, match=r"5 layers but the plan was made for 6 layers"):
        result.check_model(names[:5], counts[:5])
    renamed = [*names[:3], "other", *names[4:]]
    with pytest.raises(PlanMismatchError, match=r"layer 3 is named 'other' in the model but "):
        result.check_model(renamed, counts)
    grown = [*counts[:4], counts[4] + 1, counts[5]]
    with pytest.raises(PlanMismatchError, match=r"layer 4 \('layer4'\) has 5,001 parameters"):
        result.check_model(names, grown)
    with pytest.raises(PlanMismatchError, match="re-run `pipetrain profile` and `pipetrain plan`"):
        result.check_model(names, grown)


@pytest.mark.parametrize("checkpoint", ["never", "auto", "always"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_infeasible_cap_names_the_cap_that_fits(schedule: str, checkpoint: str) -> None:
    profile = _profile()
    kwargs = {"stages": 3, "microbatches": 4, "schedule": schedule, "checkpoint": checkpoint}
    with pytest.raises(InfeasibleError) as err:
        plan(profile, memory=1000, **kwargs)
    match = re.search(r"needs is (\d+) bytes", str(err.value))
    assert match is not None
    cap = int(match.group(1))
    assert cap == err.value.smallest_cap
    fits = plan(profile, memory=cap, **kwargs)
    assert max(s.memory_bytes for s in fits.per_stage) <= cap
    with pytest.raises(InfeasibleError):
        plan(profile, memory=cap - 1, **kwargs)


def test_checkpointing_and_1f1b_need_less_memory_than_gpipe() -> None:
    profile = _profile()

    def peak(**kwargs) -> int:
        with pytest.raises(InfeasibleError) as err:
            plan(profile, stages=3, microbatches=8, memory=1, **kwargs)
        assert err.value.smallest_cap is not None
        return err.value.smallest_cap

    gpipe = peak(schedule="gpipe", checkpoint="never")
    assert peak(schedule="1f1b", checkpoint="never") < gpipe
    assert peak(schedule="gpipe", checkpoint="always") < gpipe
    assert peak(schedule="gpipe") == peak(schedule="gpipe", checkpoint="always")  # auto


def test_memory_cap_changes_the_split_when_it_binds() -> None:
    profile = _profile(8)
    free = plan(profile, stages=3, microbatches=4, schedule="gpipe")
    peak = max(s.memory_bytes for s in free.per_stage)
    tight = plan(profile, stages=3, microbatches=4, schedule="gpipe", memory=peak - 1)
    assert max(s.memory_bytes for s in tight.per_stage) <= peak - 1
    assert tight.bottleneck >= free.bottleneck


def test_a_shared_host_changes_the_prediction_not_the_split() -> None:
    kwargs = dict(stages=3, microbatches=4, bandwidth="1GB/s", microbatch_size=4)
    alone = plan(_profile(), **kwargs)  # type: ignore[arg-type]
    shared = plan(_profile(), cores=1, overhead=1e-4, **kwargs)  # type: ignore[arg-type]
    assert shared.balance == alone.balance and shared.host == Host(1, 1e-4)
    # one core does everything one piece after another: all compute, each message copied at
    # both ends (bytes / bandwidth), and the overhead of every action of every rank (but the
    # step's REDUCE and AGREE, which take none)
    schedule = build("1f1b", 3, 4)
    actions = sum(
        a.kind not in (Kind.REDUCE, Kind.AGREE) for ops in schedule.actions.values() for a in ops
    )
    compute = 4 * sum(s.forward_time + s.backward_time for s in alone.per_stage)
    copies = 2 * 2 * 4 * sum(s.transfer_time for s in alone.per_stage[:-1])
    assert shared.step_time == pytest.approx(compute + copies + actions * 1e-4)
    assert shared.step_time > alone.step_time
    assert f"step {shared.step_time * 1e3:.3f} ms" in shared.table()
    assert "stages sharing 1 cores; runtime overhead 0.100 ms per action" in shared.table()
    assert Plan.from_json(shared.to_json()) == shared


def test_plans_without_a_host_read_as_a_device_per_stage() -> None:
    data = json.loads(plan(_profile(), stages=2, microbatches=2, cores=2).to_json())
    assert data["host"] == {"cores": 2, "overhead": 0.0}
    del data["host"]  # a plan written before hosts were recorded
    assert Plan.from_json(json.dumps(data)).host == Host()
    data["host"] = {"cores": 0, "overhead": 0.0}
    with pytest.raises(PlanFileError, match="cores must be at least 1"):
        Plan.from_json(json.dumps(data))


def test_one_except_clause_catches_every_planner_error() -> None:
    """Corrupt plan files, infeasible constraints and bad profiles all derive from
    PlannerError (still a ValueError), so a caller needs one clause for the package."""
    failures = [
        lambda: Plan.from_json(_profile().to_json()),
        lambda: plan(_profile(), stages=3, microbatches=4, memory=1000),
        lambda: Profile.from_json("{}"),
    ]
    for fail in failures:
        with pytest.raises(PlannerError) as info:
            fail()
        assert isinstance(info.value, ValueError)
        assert type(info.value) is not PlannerError  # the specific kind, for a specific clause


def test_a_gpipe_plan_short_of_memory_offers_the_default_schedule() -> None:
    profile = _profile(8)
    free = plan(profile, stages=3, microbatches=4, schedule="gpipe", checkpoint="never")
    least = min(s.memory_bytes for s in free.per_stage)
    with pytest.raises(InfeasibleError) as error:
        plan(profile, stages=3, microbatches=4, schedule="gpipe", checkpoint="never",
             memory=least // 4)
    assert "schedule='1f1b' (fewer micro-batches in flight)" in str(error.value)
    assert "--schedule 1f1b" in error.value.for_command_line()
