"""The synchronous step as actions of the list (pipetrain/runtime/update.py): the AGREE of
every rank of this process meets the others, the last to arrive agrees for every stage, and a
waiting AGREE never hangs: it gives up after the timeout, and stops as soon as a peer failed."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.errors import CommunicationTimeout, PeerError
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.update import Update
from schedules import Kind, Schedule, ScheduleSpec, one_f_one_b, register, unregister
from tests.runtime.models import batches, mlp, sgd


def _update(stages: int = 2) -> Update:
    cpu = torch.device("cpu")
    model = mlp()
    cut = len(model) // stages
    parts = [nn.Sequential(*model[k * cut:(k + 1) * cut]) for k in range(stages)]
    return Update([Stage(part, k, stages, k * cut, cpu, sgd, nn.functional.cross_entropy)
                   for k, part in enumerate(parts)])


def test_the_last_to_arrive_agrees_for_every_stage_and_the_other_waits():
    update = _update()
    update.begin(1)
    for stage in update.stages:  # gradients as a backward would leave them
        for p in stage.module.parameters():
            p.grad = torch.ones_like(p)
    done: list[float] = []
    waiter = threading.Thread(
        target=lambda: (update.agree([0], lambda: None, 10.0, "stage 0"),
                        done.append(time.monotonic()))
    )
    waiter.start()
    time.sleep(0.2)
    assert not done, "stage 0 waits for stage 1's gradients"
    arrived = time.monotonic()
    update.agree([1], lambda: None, 10.0, "stage 1")
    waiter.join(5)
    assert done and done[0] >= arrived
    _, metrics = update.result()
    assert metrics["skipped_step"] is False  # sgd: the host decides
    for stage in update.stages:  # STEP then steps each stage as agreed
        before = [p.detach().clone() for p in stage.module.parameters()]
        update.update(stage)
        assert all(not torch.equal(b, p) for b, p in zip(before, stage.module.parameters(),
                                                         strict=True))


def test_a_waiting_agree_gives_up_after_the_timeout_naming_its_stage():
    update = _update()
    update.begin(1)
    start = time.monotonic()
    with pytest.raises(CommunicationTimeout, match=r"stage 0 waited 0.3 s at AGREE"):
        update.agree([0], lambda: None, 0.3, "stage 0")
    assert time.monotonic() - start < 5


def test_a_waiting_agree_stops_when_a_peer_failed():
    update = _update()
    update.begin(1)
    calls = []

    def check() -> None:
        calls.append(1)
        if len(calls) == 3:
            raise PeerError("stage 1 failed")

    start = time.monotonic()
    with pytest.raises(PeerError, match="stage 1 failed"):
        update.agree([0], check, 60.0, "stage 0")
    assert time.monotonic() - start < 5, "polled every 50 ms, not after the timeout"


class _BackwardFails(torch.autograd.Function):
    """Passes its input on; its backward raises on the ``fail_at``-th call."""

    calls = 0
    fail_at = 4

    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        _BackwardFails.calls += 1
        if _BackwardFails.calls == _BackwardFails.fail_at:
            raise RuntimeError("boom in the last backward")
        return grad


class _FailsInBackward(nn.Module):
    def forward(self, x):  # type: ignore[no-untyped-def]
        return _BackwardFails.apply(x)


def test_a_stage_failing_while_its_peer_waits_at_agree_stops_both_at_once():
    """Stage 1 is done with the mini-batch and waits at AGREE when stage 0's last backward
    fails: the failure is raised at once, not after the pipeline's timeout."""
    _BackwardFails.calls = 0
    model = nn.Sequential(*mlp()[:2], _FailsInBackward(), *mlp()[2:])
    pipe = pipetrain.Pipeline(
        model, [7, 6], chunks=4, devices=["cpu", "cpu"], loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, timeout=60,
    )
    x, y = batches(1)[0]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="boom in the last backward"):
        pipe.train_step(x, y)
    assert time.monotonic() - start < 20


def _older_1f1b(stages: int, microbatches: int) -> Schedule:
    """1F1B as a hand-written schedule from before the step's actions: STEPs alone."""
    stock = one_f_one_b(stages, microbatches)
    actions = {r: tuple(a for a in ops if a.kind not in (Kind.REDUCE, Kind.AGREE))
               for r, ops in stock.actions.items()}
    return replace(stock, name="older-1f1b", actions=actions)


def test_an_older_schedule_closed_by_its_steps_alone_trains_as_its_stock_twin():
    """The runtime gives such lists their REDUCEs and AGREE (schedules.with_step_tail): with
    a clip, which needs the agreement, the parameters equal stock 1F1B's exactly (the same
    operations in the same order)."""
    register(ScheduleSpec("older-1f1b", _older_1f1b))
    try:
        states = []
        for name in ("older-1f1b", "1f1b"):
            torch.manual_seed(0)
            pipe = pipetrain.Pipeline(
                mlp(), [6, 6], chunks=4, schedule=name, devices=["cpu", "cpu"],
                loss_fn=nn.functional.cross_entropy, optimizer=sgd, clip_grad_norm=0.1,
            )
            losses = [float(pipe.train_step(x, y)) for x, y in batches(2)]
            assert pipe.metrics["grad_norm"] > 0.1, "the clip acts"
            states.append((losses, pipe.module.state_dict()))
    finally:
        unregister("older-1f1b")
    (older, older_state), (stock, stock_state) = states
    assert older == stock
    assert all(torch.equal(older_state[k], v) for k, v in stock_state.items())
