"""Interleaved 1F1B and zero-bubble (ZB-H1, ZB-H2) schedules in the runtime: several stages per
rank, hand-offs in memory between stages of one rank, and B/W split backward.

Same tolerance and reasoning as test_distributed.py: after 3 SGD+momentum steps every parameter
is within 1e-5 of plain single-process training, and the losses agree.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.observe.trace import load_folder
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import (
    batches,
    mlp,
    reference,
    sequence_batches,
    sequence_model,
    sgd,
)
from tests.runtime.test_distributed import TOLERANCE, assert_trains_like_one_process

STEPS = 3
# uneven balances; interleaved has ranks x 2 stages (the tuple boundary Fork|Join is crossed)
CONFIGS = {
    2: {
        "interleaved": ([2, 3, 4, 3], 4),
        "zb-h1": ([4, 8], 4),
        "zb-h2": ([5, 7], 4),
    },
    4: {
        "interleaved": ([1, 2, 1, 2, 2, 1, 2, 1], 4),
        "zb-h1": ([2, 3, 4, 3], 6),
        "zb-h2": ([3, 2, 3, 4], 6),
    },
}
SCHEDULES = ["interleaved", "zb-h1", "zb-h2"]
# sequence_model (10 layers) on inputs whose length changes between mini-batches
SEQ_BALANCES = {
    2: {"interleaved": [2, 3, 2, 3], "zb-h1": [4, 6], "zb-h2": [6, 4]},
    4: {"interleaved": [1, 1, 1, 1, 2, 1, 2, 1], "zb-h1": [2, 3, 2, 3], "zb-h2": [3, 2, 3, 2]},
}
LENGTHS = [3, 7, 7, 5]


def _pipeline(schedule: str, world: int, devices: bool = False, **options) -> pipetrain.Pipeline:
    balance, chunks = CONFIGS[world][schedule]
    if devices:
        options["devices"] = ["cpu"] * world
    return pipetrain.Pipeline(
        mlp(), balance, chunks=chunks, schedule=schedule, loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, timeout=60, **options,
    )


def _train(pipe: pipetrain.Pipeline) -> dict:
    losses = [pipe.train_step(x, y) for x, y in batches(STEPS)]
    return {"state": pipe.module.state_dict(), "losses": losses,
            "stages": [s.index for s in pipe.stages], "output": pipe.eval_step(batches(1)[0][0])}


def _every_config(rank: int, world: int, folder: str) -> dict:
    out = {}
    for schedule in SCHEDULES:
        pipe = _pipeline(schedule, world, trace=f"{folder}/{schedule}")
        out[schedule] = _train(pipe)
        pipe.save_trace()
    out["zb-h1", "always"] = _train(_pipeline("zb-h1", world, recompute="always"))
    for schedule in SCHEDULES:
        pipe = pipetrain.Pipeline(
            sequence_model(), SEQ_BALANCES[world][schedule], chunks=4, schedule=schedule,
            loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60,
        )
        losses = [pipe.train_step(x, y) for x, y in sequence_batches(LENGTHS)]
        out["seq", schedule] = {"state": pipe.module.state_dict(), "losses": losses}
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def runs(request, tmp_path_factory):
    world = request.param
    folder = tmp_path_factory.mktemp(f"traces{world}")
    return world, folder, values(run_ranks(_every_config, world, str(folder), deadline=120))


def _expected():
    model = mlp()
    state, losses = reference(model, batches(STEPS))
    with torch.no_grad():
        output = model.eval()(batches(1)[0][0])
    return state, losses, output


def _assert_matches(per_rank: list[dict]) -> None:
    expected_state, expected_losses, expected_output = _expected()
    seen = set()
    for result in per_rank:
        for key, value in result["state"].items():
            seen.add(key)
            diff = (value - expected_state[key]).abs().max().item()
            assert diff <= TOLERANCE, f"{key} differs by {diff}"
        assert result["losses"] == pytest.approx(expected_losses, abs=1e-6)
    assert seen == set(expected_state), "the ranks together must hold every parameter"
    outputs = [r["output"] for r in per_rank]
    assert all(o is None for o in outputs[:-1]), "only the last stage's rank returns the output"
    assert (outputs[-1] - expected_output).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_processes_match_single_process_training(runs, schedule):
    world, _, results = runs
    _assert_matches([r[schedule] for r in results])
    if schedule == "interleaved":  # stage c*p+r on rank r
        assert [r[schedule]["stages"] for r in results] == [[r, r + world] for r in range(world)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_shapes_may_change_between_mini_batches(runs, schedule):
    _, _, results = runs
    per_rank = [r["seq", schedule] for r in results]
    assert_trains_like_one_process(per_rank, sequence_model(), sequence_batches(LENGTHS))


def test_split_backward_with_recomputation(runs):
    _, _, results = runs
    _assert_matches([r["zb-h1", "always"] for r in results])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_runs_its_list_in_order(runs, schedule):
    """The trace of every step lists exactly the rank's actions, in the schedule's order."""
    world, folder, _ = runs
    traces = load_folder(folder / schedule)
    assert [t.stage for t in traces] == list(range(world))
    for t in traces:
        assert len(t.steps) == STEPS
        for spans in t.steps:
            assert [s.action for s in spans] == list(t.schedule.actions[t.stage])
            assert all(s.lane == t.stage for s in spans)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last"])
def test_threads_match_single_process_training(world, schedule, checkpoint):
    result = _train(_pipeline(schedule, world, devices=True, recompute=checkpoint))
    expected_state = _expected()[0]
    assert list(result["state"]) == list(expected_state), "keys are the full model's, in order"
    _assert_matches([result])


def test_interleaved_balance_needs_an_entry_per_stage():
    with pytest.raises(ValueError, match="interleaved with 4 ranks x 2 chunks needs balance "
                                         "with 8 entries"):
        pipetrain.Pipeline(mlp(), [2, 2, 2, 2, 2, 2], schedule="interleaved", chunks=4,
                           devices=["cpu"] * 4)


def test_checkpoint_round_trip_under_interleaved(tmp_path):
    data = batches(5)

    def fresh(seed: int = 0, **options) -> pipetrain.Pipeline:
        return pipetrain.Pipeline(
            mlp(seed=seed), [2, 3, 4, 3], chunks=4, schedule="interleaved",
            loss_fn=nn.functional.cross_entropy, optimizer=sgd, devices=["cpu"] * 2, **options,
        )

    whole = fresh()
    for x, y in data:
        whole.train_step(x, y)
    first = fresh()
    for x, y in data[:3]:
        first.train_step(x, y)
    saved = first.save(tmp_path)
    assert sorted(p.name for p in saved.glob("stage-*.pt")) == [f"stage-{s}.pt" for s in range(4)]
    again = fresh(seed=99, checkpoint_dir=tmp_path)
    assert again.step == 3
    for x, y in data[3:]:
        again.train_step(x, y)
    expected = whole.module.state_dict()
    for key, value in again.module.state_dict().items():
        assert torch.equal(value, expected[key]), key
    assert list(pipetrain.consolidate(tmp_path)) == list(mlp().state_dict())
