"""Pipeline x data parallel, and weights tied across stages, against single-process training.

Tolerance 1e-5 (fp32), as in test_distributed.py: replicas and tied stages only change the order
in which gradient contributions are summed.
"""

from __future__ import annotations

import pytest
from torch import nn

import pipetrain
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, reference, sgd, tied_model, token_batches
from tests.runtime.test_distributed import TOLERANCE
from tests.runtime.test_local import pipeline

STEPS = 3


def _train(rank: int, world: int, model_name: str, balance: list[int], replicas: int):
    model, data = (mlp(), batches(STEPS)) if model_name == "mlp" else (
        tied_model(), token_batches(STEPS))
    pipe = pipetrain.Pipeline(model, balance, chunks=2, schedule="1f1b", replicas=replicas,
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60)
    replica = pipe.placement.replica
    losses = []
    for x, y in data:  # each replica takes its share of the global mini-batch
        share = len(x) // replicas
        part = slice(replica * share, (replica + 1) * share)
        losses.append(pipe.train_step(x[part], y[part]))
    return pipe.module.state_dict(), losses


def _check(results, model, data) -> None:
    expected, expected_losses = reference(model, data)
    for state, losses in results:
        assert losses == pytest.approx(expected_losses, abs=1e-6)
        for key, value in state.items():
            assert (value - expected[key]).abs().max().item() <= TOLERANCE, key
    assert set().union(*(s.keys() for s, _ in results)) == set(expected)


def test_two_stages_times_two_replicas_equal_single_process_training():
    _check(values(run_ranks(_train, 4, "mlp", [5, 7], 2)), mlp(), batches(STEPS))


@pytest.mark.parametrize("world, replicas", [(2, 1), (4, 2)])
def test_weights_tied_across_stages_stay_tied_and_train_as_one(world, replicas):
    results = values(run_ranks(_train, world, "tied", [3, 3], replicas))
    _check(results, tied_model(), token_batches(STEPS))
    for state, _ in results:  # each stage holds the shared weight under its own layer's key
        assert "0.weight" in state or "5.weight" in state


def test_weights_tied_across_stages_in_one_process():
    pipe = pipeline(tied_model(), [3, 3], chunks=2)
    for x, y in token_batches(STEPS):
        pipe.train_step(x, y)
    expected, _ = reference(tied_model(), token_batches(STEPS))
    state = pipe.module.state_dict()
    for key, value in expected.items():
        assert (state[key] - value).abs().max().item() <= TOLERANCE, key
    assert state["0.weight"] is not None and (state["0.weight"] == state["5.weight"]).all()


def _wrong_world(rank: int, world: int) -> None:
    pipetrain.Pipeline(mlp(), [4, 4, 4], replicas=2)


def test_world_must_be_stages_times_replicas():
    for status, (kind, message, _) in run_ranks(_wrong_world, 4):
        assert status == "error" and kind == "ValueError"
        assert "world size 4 does not match the 3 stages of balance x 2 replicas" in message
        assert "launch 6 processes" in message and "or give balance 2 entries (2 replicas x 2 " \
            "stages = 4)" in message, message  # the replicas counted
