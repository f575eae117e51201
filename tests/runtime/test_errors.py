"""Bad input gets a clear error naming the problem and the fix; failures never hang."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.errors import CommunicationTimeout, PeerError, PipelineError, StageError
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_local import pipeline


class FailOn(nn.Module):
    """Raises on one micro-batch of one step (counted by calls in training)."""

    def __init__(self, call: int):
        super().__init__()
        self.call, self.calls = call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.call:
            raise RuntimeError("boom")
        return x


def test_balance_must_sum_to_the_model_length():
    with pytest.raises(ValueError, match=r"sums to 10 but the model has 12 layers.*\[6, 6\]"):
        pipeline(mlp(), [5, 5])


def test_balance_entries_must_be_positive():
    with pytest.raises(ValueError, match="positive number of layers"):
        pipeline(mlp(), [0, 12])


def test_only_sequential_models():
    with pytest.raises(TypeError, match="nn.Sequential"):
        pipeline(nn.Linear(2, 2), [1])  # type: ignore[arg-type]


def test_batch_must_divide_into_chunks():
    pipe = pipeline(mlp(), [6, 6], chunks=5)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="batch size 24, which chunks=5 does not divide"):
        pipe.train_step(x, y)


def test_x_and_y_batch_sizes_must_agree():
    pipe = pipeline(mlp(), [6, 6], chunks=2)
    x, y = batches(1)[0]
    with pytest.raises(ValueError, match="x has batch size 24 but y has 12"):
        pipe.train_step(x, y[:12])


def test_unknown_schedule_and_checkpoint_mode():
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        pipeline(mlp(), [6, 6], schedule="zigzag")
    with pytest.raises(ValueError, match="recompute must be one of"):
        pipeline(mlp(), [6, 6], recompute="sometimes")


class ModeName:
    """Not a str, though it prints as a mode."""

    def __str__(self) -> str:
        return "always"


@pytest.mark.parametrize(("checkpoint", "message"), [
    (ModeName(), r"recompute must be one of 'never', 'except_last', 'always' \(a str\) or a "
     r"list of one per stage, got ModeName"),
    (3, r"recompute must be one of .* got int 3"),
    (["always", ModeName()], r"recompute\[1\] must be one of 'never', 'except_last', "
     r"'always' \(a str\), got ModeName"),
])
def test_a_checkpoint_that_is_no_mode_names_the_modes(checkpoint, message):
    with pytest.raises(TypeError, match=message):
        pipeline(mlp(), [6, 6], recompute=checkpoint)


def test_one_device_per_stage():
    with pytest.raises(ValueError, match="3 devices for 2 stages"):
        pipetrain.Pipeline(mlp(), [6, 6], devices=["cpu"] * 3)


def test_no_process_group_and_no_devices():
    with pytest.raises(RuntimeError, match="init_distributed"):
        pipetrain.Pipeline(mlp(), [6, 6])


def test_a_failing_layer_is_named_with_its_stage_and_micro_batch():
    model = nn.Sequential(*mlp()[:6], FailOn(call=3), *mlp()[6:])
    pipe = pipeline(model, [4, 9], chunks=4, recompute="never")  # no recomputed calls
    x, y = batches(1)[0]
    with pytest.raises(StageError, match=r"stage 1, layer 6 \(FailOn\), forward of micro-batch 2"):
        pipe.train_step(x, y)
    with pytest.raises(PipelineError, match="stopped after a failure"):
        pipe.train_step(x, y)


def test_loss_fn_failure_is_named():
    pipe = pipeline(mlp(), [6, 6], chunks=2, loss_fn=lambda out, y: out.sum(dim=1))
    with pytest.raises(StageError, match="stage 1, loss_fn, forward of micro-batch 0.*scalar"):
        pipe.train_step(*batches(1)[0])


def test_shapes_must_agree_within_a_mini_batch():
    class Ragged(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x if self.calls == 1 else x[:, :-1]

    model = nn.Sequential(nn.Linear(4, 4), Ragged(), nn.Linear(4, 2))
    pipe = pipeline(model, [2, 1], chunks=2, recompute="never")
    with pytest.raises(StageError, match="micro-batch 1 produced .* but micro-batch 0"):
        pipe.train_step(torch.randn(4, 4), torch.randint(0, 2, (4,)))


def test_unsupported_boundary_value():
    class Dict(nn.Module):
        def forward(self, x):
            return {"x": x}

    pipe = pipeline(nn.Sequential(Dict(), nn.Identity()), [1, 1])
    with pytest.raises(TypeError, match="must be a Tensor or a tuple of Tensors"):
        pipe.eval_step(torch.randn(2, 2))


# -- across real processes --------------------------------------------------------------------


def _fail_on_stage_one(rank: int, world: int) -> float:
    model = nn.Sequential(*mlp()[:6], FailOn(call=3), *mlp()[6:])
    pipe = pipetrain.Pipeline(
        model, [6, 7], chunks=4, recompute="never", loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, timeout=60,
    )
    start = time.monotonic()
    try:
        pipe.train_step(*batches(1)[0])
    finally:
        elapsed = time.monotonic() - start
        print(f"rank {rank} stopped after {elapsed:.2f} s")
    return elapsed


def _die_on_stage_one(rank: int, world: int) -> None:
    class Die(nn.Module):
        def forward(self, x):
            os._exit(3)

    model = nn.Sequential(*mlp()[:6], Die(), *mlp()[6:])
    pipe = pipetrain.Pipeline(model, [6, 7], chunks=4, loss_fn=nn.functional.cross_entropy,
                              optimizer=sgd, timeout=60)
    pipe.train_step(*batches(1)[0])


def _stall_on_stage_one(rank: int, world: int) -> None:
    class Stall(nn.Module):
        def forward(self, x):
            time.sleep(4)
            return x

    model = nn.Sequential(*mlp()[:6], Stall(), *mlp()[6:])
    pipe = pipetrain.Pipeline(model, [6, 7], chunks=2, loss_fn=nn.functional.cross_entropy,
                              optimizer=sgd, timeout=1.0)
    pipe.train_step(*batches(1)[0])


def _world_size_mismatch(rank: int, world: int) -> None:
    pipetrain.Pipeline(mlp(), [4, 4, 4])


def _errors(results):
    return [value for status, value in results if status == "error"]


def test_a_stage_failure_stops_its_peer_promptly():
    results = run_ranks(_fail_on_stage_one, 2, deadline=60)
    (kind0, msg0, _), (kind1, msg1, _) = _errors(results)
    assert kind1 == "StageError" and "stage 1, layer 6 (FailOn)" in msg1
    assert kind0 == "PeerError"
    assert "stage 0" in msg0 and "waiting for stage 1" in msg0, msg0
    assert "stage 1, layer 6 (FailOn), forward of micro-batch 2 failed" in msg0, msg0


def test_a_dead_peer_is_reported_not_waited_for():
    start = time.monotonic()
    results = run_ranks(_die_on_stage_one, 2, deadline=60)
    assert time.monotonic() - start < 40, "well inside the 60 s timeout"
    assert results[1] == ("died", 3)
    status, value = results[0]
    assert status == "error" and value[0] == "PeerError", value
    assert "waiting for stage 1" in value[1] and "died" in value[1], value[1]


def test_a_silent_peer_times_out_naming_peer_micro_batch_and_position():
    """Stage 1 stalls 4 s in its forward: stage 0 times out waiting for it after 1 s. On a
    loaded machine stage 1 may itself time out first (waiting for a late stage 0); then that is
    the root cause, and the other rank is told it as a PeerError. Either way one rank reports
    the timeout, naming the peer, micro-batch and position, and the other learns of it."""
    results = run_ranks(_stall_on_stage_one, 2, deadline=60)
    assert all(status == "error" for status, _ in results), results
    timeouts = [(rank, message) for rank, (_, (kind, message, _)) in enumerate(results)
                if kind == "CommunicationTimeout"]
    assert timeouts, results
    rank, message = timeouts[0]
    assert f"waiting for stage {1 - rank} (rank {1 - rank}) on micro-batch" in message, message
    assert "at action" in message and "timeout=1 s" in message, message
    if rank == 0:
        assert "waiting for stage 1 (rank 1) on micro-batch 0" in message, message
    other_kind = results[1 - rank][1][0]
    assert other_kind in ("CommunicationTimeout", "PeerError"), results


def test_world_size_must_match_the_stages():
    results = run_ranks(_world_size_mismatch, 2, deadline=60)
    for status, (kind, message, _) in results:
        assert status == "error" and kind == "ValueError"
        assert "world size 2 does not match the 3 stages" in message
        assert "--nproc_per_node=3" in message
        assert "a number of entries that divides 2 ([1, 2]; 2 // entries replicas)" in message


def test_error_classes():
    assert issubclass(CommunicationTimeout, PeerError)
    assert issubclass(PeerError, PipelineError) and issubclass(StageError, PipelineError)


@pytest.mark.parametrize(
    "bad, named",
    [("hello", "got str"), (42, "got int"), ((torch.randn(24, 12), "hello"), r"x\[1\] is str")],
)
def test_eval_step_and_train_step_reject_a_non_tensor_batch_alike(bad, named):
    pipe = pipeline(mlp(), [6, 6], chunks=2)
    _, y = batches(1)[0]
    for step in (pipe.eval_step, lambda x: pipe.train_step(x, y)):
        with pytest.raises(TypeError, match=f"x must be a Tensor or a tuple of Tensors.*{named}"):
            step(bad)
    pipe.train_step(*batches(1)[0])  # a refused batch does not break the pipeline


def _bad_input(rank: int, world: int) -> list[str]:
    options = dict(chunks=2, loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    refused = []
    with pytest.raises(ValueError) as no_timeout:
        pipetrain.Pipeline(mlp(), [6, 6], timeout=-1, **options)
    refused.append(str(no_timeout.value))
    pipe = pipetrain.Pipeline(mlp(), [6, 6], timeout=30, **options)
    x, y = batches(1)[0]
    with pytest.raises(ValueError) as empty:
        pipe.train_step(x[:0], y[:0])
    return refused + [str(empty.value)]


def test_a_non_positive_timeout_and_an_empty_batch_are_refused():
    """Today timeout=-1 is accepted and an empty batch returns a NaN loss."""
    for timeout, empty in values(run_ranks(_bad_input, 2, deadline=60)):
        assert "timeout must be a positive number of seconds" in timeout and "-1" in timeout
        assert "empty batch (batch size 0)" in empty


def _uneven_batch(rank: int, world: int, step: str) -> tuple[str, str, float]:
    """One good step, then a batch chunks=2 does not divide, given only where it is read
    (rank 0's x; in training, the last rank's y too): what each rank raised, how soon."""
    pipe = pipetrain.Pipeline(mlp(), [4, 4, 4], chunks=2, timeout=30,
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    x, y = batches(1)[0]
    pipe.train_step(x, y)
    start = time.monotonic()
    try:
        if step == "eval":
            pipe.eval_step(x[:5] if rank == 0 else None)
        else:
            pipe.train_step(x[:5] if rank == 0 else None, y[:5] if rank == 2 else None)
    except Exception as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "none", "", time.monotonic() - start


@pytest.mark.parametrize("step", ["eval", "train"])
def test_a_batch_one_rank_refuses_stops_every_rank_with_its_reason(step):
    """A middle stage (and in evaluation the last) has no batch to check: it raised only when
    the timeout (30 s) ran out, or named no reason where the refusing rank's process ended."""
    results = values(run_ranks(_uneven_batch, 3, step, deadline=60))
    for rank, (kind, message, seconds) in enumerate(results):
        assert kind in ("ValueError", "PeerError"), (rank, kind, message)
        assert "batch size 5, which chunks=2 does not divide" in message, (rank, message)
        assert seconds < 10, (rank, seconds)
    assert results[1][0] == "PeerError" and "refused its batch" in results[1][1]  # the middle


class Sleepy(nn.Module):
    """Counts its calls and takes 0.1 s over each; with ``until`` (an Event), its second call
    also waits for it (at most 10 s), to be still busy when a later stage fails."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.until: threading.Event | None = None

    def forward(self, x):
        self.calls += 1
        time.sleep(0.1)
        if self.calls == 2 and self.until is not None:
            self.until.wait(10)
        return x


class Refuse(nn.Module):
    def forward(self, x):
        raise RuntimeError("refused")


def _early_stop(layout: str, repeats: int, wait_for_failure: bool) -> None:
    """torchgpipe's early-stop test in eval_step: a stage raises on micro-batch 0 while the one
    before it takes 0.1 s per micro-batch, 3 micro-batches; the earlier stage must stop
    before its third. "two-stages": the earlier stage is the first, which never waits on a
    receive; "torchgpipe": its layout, [Pass, Pass, Sleepy, Refuse]. ``wait_for_failure``
    makes the earlier stage's second forward last until the pipeline knows of the failure:
    then it must stop, whatever the machine's load; without, the failing stage's thread must
    get a processor within 0.1 s, as in torchgpipe's test."""
    for _ in range(repeats):
        sleepy = Sleepy()
        layers = [sleepy, Refuse()] if layout == "two-stages" else [
            nn.Identity(), nn.Identity(), sleepy, Refuse()
        ]
        pipe = pipeline(nn.Sequential(*layers), [1] * len(layers), chunks=3)
        if wait_for_failure:
            sleepy.until = pipe.transports[0].hub.aborted  # type: ignore[attr-defined]
        with pytest.raises(StageError, match="Refuse.*micro-batch 0 failed: RuntimeError: refused"):
            pipe.eval_step(torch.rand(3, 2))
        assert sleepy.calls < 3


@pytest.mark.parametrize("layout", ["two-stages", "torchgpipe"])
def test_a_failure_stops_the_earlier_stages_at_once_in_eval(layout):
    _early_stop(layout, 3, wait_for_failure=True)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["two-stages", "torchgpipe"])
def test_a_failure_stops_the_earlier_stages_at_once_in_eval_repeatedly(layout):
    _early_stop(layout, 50, wait_for_failure=False)


def test_training_needs_an_optimizer_and_a_loss_function():
    """Without an optimizer the weights would never change, silently: train_step refuses.
    Evaluation needs neither, so the pipeline is built. A loss_fn that cannot be called on
    (output, target) is refused at construction."""
    x, y = batches(1)[0]
    for missing in ("optimizer", "loss_fn"):
        pipe = pipeline(mlp(), [6, 6], **{missing: None})
        assert pipe.eval_step(x).shape == (24, 5)
        with pytest.raises(ValueError, match=f"train_step needs {missing}, .*pass Pipeline"):
            pipe.train_step(x, y)
    with pytest.raises(TypeError, match=r"class CrossEntropyLoss.*loss_fn=CrossEntropyLoss\(\)"):
        pipeline(mlp(), [6, 6], loss_fn=nn.CrossEntropyLoss)
    with pytest.raises(TypeError, match="loss_fn must be a function of"):
        pipeline(mlp(), [6, 6], loss_fn="cross_entropy")


def test_an_asynchronous_schedule_names_the_tied_weight_it_refuses():
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    with pytest.raises(ValueError, match=r"'pipedream' does not support .* this pipeline has 1 "
                       r"weight\(s\) tied across stages \(0.weight = 2.weight on stages \[0, 1\]\)"
                       r".*untie them or keep each tie's layers on one stage"):
        pipeline(nn.Sequential(first, nn.ReLU(), last), [1, 2], schedule="pipedream")
