"""Pipelines across real processes (gloo on CPU) against plain single-process training.

Tolerance: fp32, max abs difference 1e-5 on every parameter after several SGD+momentum steps.
Splitting a mini-batch into micro-batches only reorders the summation of the gradient (a sum of
per-micro-batch partial gradients instead of one matmul), which moves results by a few units in
the last place (~1e-7 here); a wrong loss scale, a lost micro-batch or a stale weight moves them
by 1e-3 or more. 1e-5 keeps a wide margin on both sides.
"""

from __future__ import annotations

import copy
import itertools
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import pipetrain
from tests.runtime.harness import free_port, run_ranks, values
from tests.runtime.models import (
    batches,
    mlp,
    reference,
    sequence_batches,
    sequence_model,
    sgd,
)

TOLERANCE = 1e-5
SCHEDULES = ["gpipe", "1f1b"]
CHECKPOINTS = ["never", "except_last", "always"]
BALANCES = {2: [4, 8], 4: [2, 3, 4, 3]}  # uneven; the tuple boundary (Fork|Join) is crossed
CHUNKS = {2: 4, 4: 6}
STEPS = 3


def _train(model: nn.Sequential, balance, data, **options) -> dict:
    pipe = pipetrain.Pipeline(
        model, balance, loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60, **options
    )
    stage = pipe.stages[0]
    losses = [pipe.train_step(x, y) for x, y in data]
    ledger = stage.ledger
    return {
        "state": pipe.module.state_dict(),
        "losses": losses,
        "peak_microbatches": ledger.peak_microbatches if ledger else None,
        "peak_bytes": ledger.peak_bytes if ledger else None,
        "output": pipe.eval_step(data[0][0]),
    }


def _every_config(rank: int, world: int) -> dict:
    """All schedule x checkpoint runs, plus the special cases, in one set of processes."""
    balance = BALANCES[world]
    out = {}
    for schedule, checkpoint in itertools.product(SCHEDULES, CHECKPOINTS):
        out[schedule, checkpoint] = _train(
            mlp(), balance, batches(STEPS), chunks=CHUNKS[world], schedule=schedule,
            recompute=checkpoint, track_memory=True,
        )
    # Called inside the caller's torch.no_grad() (an evaluation helper around training, say).
    with torch.no_grad():
        out["no_grad"] = _train(mlp(), balance, batches(STEPS), chunks=CHUNKS[world])
    # Fewer micro-batches than stages.
    out["few"] = _train(mlp(), balance, batches(STEPS), chunks=world // 2, schedule="1f1b")
    # Shapes that change between mini-batches (variable sequence length); a repeated length
    # takes the first payload posted with the last call's shapes, a new one its stand-in.
    seq_balance = [3, len(sequence_model()) - 3] if world == 2 else [2, 3, 2, 3]
    out["seq"] = _train(
        sequence_model(), seq_balance, sequence_batches([3, 7, 7, 5]), chunks=4, schedule="1f1b"
    )
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["2-stages", "4-stages"])
def runs(request):
    world = request.param
    return world, values(run_ranks(_every_config, world, deadline=240))


def assert_trains_like_one_process(
    per_rank: list[dict], model: nn.Sequential, data, loss_fn=nn.functional.cross_entropy
) -> None:
    expected_state, expected_losses = reference(copy.deepcopy(model), data, loss_fn=loss_fn)
    seen = set()
    for result in per_rank:
        for key, value in result["state"].items():
            seen.add(key)
            diff = (value - expected_state[key]).abs().max().item()
            assert diff <= TOLERANCE, f"{key} differs by {diff}"
        assert result["losses"] == pytest.approx(expected_losses, abs=1e-6)
    assert seen == set(expected_state), "the stages together must hold every parameter"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_parameters_match_single_process_training(runs, schedule, checkpoint):
    world, results = runs
    per_rank = [r[schedule, checkpoint] for r in results]
    assert_trains_like_one_process(per_rank, mlp(), batches(STEPS))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_eval_step_output_matches_the_trained_model(runs, schedule):
    world, results = runs
    model = mlp()
    reference(model, batches(STEPS))
    with torch.no_grad():
        expected = model.eval()(batches(STEPS)[0][0])
    outputs = [r[schedule, "never"]["output"] for r in results]
    assert all(o is None for o in outputs[:-1]), "only the last stage returns the output"
    assert (outputs[-1] - expected).abs().max().item() <= TOLERANCE


def test_a_callers_no_grad_does_not_stop_training(runs):
    world, results = runs
    assert_trains_like_one_process([r["no_grad"] for r in results], mlp(), batches(STEPS))


def test_fewer_micro_batches_than_stages(runs):
    world, results = runs
    assert_trains_like_one_process([r["few"] for r in results], mlp(), batches(STEPS))


def test_shapes_may_change_between_mini_batches(runs):
    world, results = runs
    assert_trains_like_one_process(
        [r["seq"] for r in results], sequence_model(), sequence_batches([3, 7, 7, 5])
    )


def _input_bytes(stage: int, world: int) -> int:
    """Bytes of one micro-batch's stage input, from running the plain model up to the stage."""
    offset = sum(BALANCES[world][:stage])
    x = batches(1)[0][0].chunk(CHUNKS[world])[0]
    with torch.no_grad():
        value = mlp()[:offset](x) if offset else x
    tensors = value if isinstance(value, tuple) else (value,)
    return sum(t.nbytes for t in tensors)


def test_activation_memory_follows_the_schedule(runs):
    world, results = runs
    m = CHUNKS[world]
    for s, result in enumerate(results):
        assert result["gpipe", "never"]["peak_microbatches"] == m
        assert result["1f1b", "never"]["peak_microbatches"] == min(m, world - s)
        for schedule in SCHEDULES:
            always = result[schedule, "always"]
            # Under full checkpointing a stage keeps nothing but its inputs.
            assert always["peak_bytes"] == always["peak_microbatches"] * _input_bytes(s, world)
            assert result[schedule, "never"]["peak_bytes"] > always["peak_bytes"]
        assert result["1f1b", "never"]["peak_bytes"] <= result["gpipe", "never"]["peak_bytes"]


_RANK_SCRIPT = """
import warnings
warnings.simplefilter("always")
import torch.distributed as dist
from pipetrain import init_distributed
init_distributed(timeout=60)
print(dist.get_backend())
dist.destroy_process_group()
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
def test_cpu_machine_chooses_gloo_without_a_gpu_warning():
    """Two real processes on a GPU-less node: gloo, and nothing on stderr about GPUs (the
    warning is for nodes whose GPUs are fewer than their processes)."""
    port = str(free_port())
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK_SCRIPT],
            env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "RANK": str(r),
                 "WORLD_SIZE": "2", "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for r in range(2)
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    for out, err in outputs:
        # torch <= 2.9's gloo prints "[Gloo] Rank r is connected to ..." on stdout: its, not ours
        ours = [line for line in out.splitlines() if not line.startswith("[Gloo] Rank")]
        assert ours == ["gloo"], out
        assert "GPU" not in err, err
