"""Adding a schedule is one registry entry: a schedule that exists only in this test module
("gpipe-lifo": GPipe's forwards, then the backwards last micro-batch first) is registered with
one ScheduleSpec and trains end to end through Pipeline, as threads and as gloo processes,
exactly like plain single-process training. And what the entries state reaches the runtime: the
memory ledger holds each stage to the schedule's in-flight micro-batches.

Tolerance 1e-5 on every parameter, as in test_distributed.py (micro-batching only reorders the
gradient's summation, ~1e-7; a lost micro-batch or a wrong loss scale moves it by 1e-3).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from torch import nn

import pipetrain
from examples.models import lm_loss
from schedules import (
    GENERATORS,
    Action,
    Kind,
    Schedule,
    ScheduleSpec,
    from_order,
    names,
    register,
    unregister,
)
from schedules.action import check_sizes
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, reference, sgd, text_batches, tiny_gpt

TOLERANCE = 1e-5
NAME = "gpipe-lifo"


def gpipe_lifo(stages: int, microbatches: int) -> Schedule:
    """Every forward, then every backward in reverse micro-batch order."""
    check_sizes(stages, microbatches)

    def order(s: int) -> list[Action]:
        return [Action(Kind.FORWARD, s, i) for i in range(microbatches)] + [
            Action(Kind.BACKWARD, s, i) for i in reversed(range(microbatches))
        ]

    return from_order(NAME, stages, microbatches, order)


# The whole addition: one entry (its generator states the compute order; messages are placed).
SPEC = ScheduleSpec(NAME, gpipe_lifo, inflight=lambda stage, stages, microbatches: microbatches)


@contextmanager
def registered(spec: ScheduleSpec = SPEC) -> Iterator[None]:
    register(spec)
    try:
        yield
    finally:
        unregister(spec.name)


def assert_like_one_process(states: list[dict], losses: list[float], model, data, loss_fn):
    expected_state, expected_losses = reference(copy.deepcopy(model), data, loss_fn=loss_fn)
    state = {k: v for s in states for k, v in s.items()}
    assert set(state) == set(expected_state), "the stages together hold every parameter"
    for key, value in state.items():
        assert (value - expected_state[key]).abs().max().item() <= TOLERANCE, key
    assert losses == pytest.approx(expected_losses, abs=1e-6)


CASES = {  # model, data, loss, balance, chunks
    "mlp": (mlp, batches(3), nn.functional.cross_entropy, [2, 3, 4, 3], 6),  # tuple boundary
    "gpt": (tiny_gpt, text_batches(3), lm_loss, [2, 3], 4),  # attention, head tied to embedding
}


@pytest.mark.parametrize("case", CASES)
def test_a_registered_schedule_trains_like_one_process_in_threads(case):
    make, data, loss_fn, balance, chunks = CASES[case]
    with registered():
        pipe = pipetrain.Pipeline(
            make(), balance, chunks=chunks, schedule=NAME, devices=["cpu"] * len(balance),
            loss_fn=loss_fn, optimizer=sgd, track_memory=True,
        )
        losses = [pipe.train_step(x, y) for x, y in data]
    assert pipe.recompute == "never", "the entry's default recomputation mode"
    assert [s.ledger.peak_microbatches for s in pipe.stages] == [chunks] * len(balance)
    assert_like_one_process([pipe.module.state_dict()], losses, make(), data, loss_fn)


def _train_registered(rank: int, world: int) -> tuple[dict, list[float]]:
    with registered():  # each process registers the schedule for itself
        pipe = pipetrain.Pipeline(
            mlp(), [4, 8], chunks=4, schedule=NAME, loss_fn=nn.functional.cross_entropy,
            optimizer=sgd, timeout=60,
        )
        return pipe.module.state_dict(), [pipe.train_step(x, y) for x, y in batches(3)]


def test_a_registered_schedule_trains_like_one_process_across_processes():
    results = values(run_ranks(_train_registered, 2))
    assert results[0][1] == results[1][1], "every rank returns the same loss"
    assert_like_one_process(
        [state for state, _ in results], results[0][1], mlp(), batches(3),
        nn.functional.cross_entropy,
    )


def test_an_unregistered_schedule_is_unknown_again():
    with registered():
        assert GENERATORS[NAME] is gpipe_lifo and NAME in names()
    assert NAME not in GENERATORS and NAME not in names()
    with pytest.raises(ValueError, match=f"unknown schedule '{NAME}'; choose one of"):
        pipetrain.Pipeline(mlp(), [6, 6], schedule=NAME, devices=["cpu", "cpu"])


def test_an_entry_the_runtime_does_not_run_is_refused_with_the_runnable_ones():
    with registered(ScheduleSpec("gpipe-lifo", gpipe_lifo, runnable=False)):
        with pytest.raises(ValueError, match=r"does not execute it yet; train with one of \["):
            pipetrain.Pipeline(mlp(), [6, 6], schedule=NAME, devices=["cpu", "cpu"])


def test_the_ledger_holds_a_stage_to_its_schedules_inflight_count():
    """PipeDream keeps p - s micro-batches in flight across calls even with one micro-batch a
    call (the registry's rule; the planner used to count 1). A stage that holds more than its
    schedule promises is an error, not a silently wrong memory plan."""
    pipe = pipetrain.Pipeline(
        mlp(), [2, 3, 4, 3], chunks=1, schedule="pipedream", devices=["cpu"] * 4,
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, track_memory=True,
    )
    for x, y in batches(6):
        pipe.train_step(x, y)
    assert [s.ledger.peak_microbatches for s in pipe.stages] == [4, 3, 2, 1]
    assert [s.ledger.bound for s in pipe.stages] == [4, 3, 2, 1]
    gpipe = pipetrain.Pipeline(
        mlp(), [6, 6], chunks=4, schedule="gpipe", devices=["cpu"] * 2, recompute="never",
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, track_memory=True,
    )
    gpipe.stages[0].ledger.bound = 3  # as if the entry promised less than GPipe holds
    with pytest.raises(pipetrain.PipelineError, match="holds 4 micro-batches.*at most 3"):
        gpipe.train_step(*batches(1)[0])
