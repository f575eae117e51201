"""DelayedPipeline (one thread, one unit at a time) against Pipeline (the executor, stages as
threads) on the same data: the same losses and weights for each asynchronous policy and delay
compensation, so that a study run on the first speaks for the second. Tolerance 1e-5 (float32;
2BW's mini-batch gradient is a sum of micro-batch gradients in the Pipeline and one gradient in
DelayedPipeline, equal up to rounding)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipetrain
from benchmarks.delayed import DelayedPipeline
from tests.runtime.models import batches, mlp, reference, sgd

BALANCE = [2, 3, 4, 3]
CHUNKS = 4
CONFIGS = {
    "stash": {},
    "stale": dict(weight_stashing=False),
    "predict": dict(weight_prediction="momentum"),
    "spike+predict": dict(delay_compensation="spike", weight_prediction="momentum"),
    "pipemare": dict(delay_compensation="pipemare", weight_stashing=False),
    "lag-lr": dict(delay_compensation="lag-lr"),
    "lag-momentum+predict": dict(delay_compensation="lag-momentum", weight_prediction="momentum"),
    "spike+lag-momentum+predict": dict(delay_compensation="spike+lag-momentum",
                                       weight_prediction="momentum"),
    "error-feedback": dict(delay_compensation="error-feedback", weight_prediction=None),
}


@pytest.mark.parametrize(("name", "schedule"), [
    (name, schedule) for name in CONFIGS for schedule in ("pipedream", "pipedream-2bw")
    if schedule == "pipedream" or CONFIGS[name].get("weight_stashing", True)
])
def test_delayed_pipeline_equals_the_pipeline(name, schedule):
    data = batches(4)
    pipe = pipetrain.Pipeline(
        mlp(), BALANCE, chunks=CHUNKS, schedule=schedule, devices=["cpu"] * 4,
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, **CONFIGS[name],
    )
    losses = [float(pipe.train_step(x, y)) for x, y in data]
    delayed, per_step = delayed_run(mlp(), BALANCE, schedule, data, CHUNKS, optimizer=sgd,
                                    **CONFIGS[name])
    expected = pipe.eval_step(data[0][0])
    assert (delayed.eval_step(data[0][0]) - expected).abs().max().item() <= 1e-5  # type: ignore[operator]
    for key, value in pipe.module.state_dict().items():
        assert (delayed.module.state_dict()[key] - value).abs().max().item() <= 1e-5, key
    assert per_step == pytest.approx(losses, abs=1e-5)


def delayed_run(
    model: nn.Sequential, balance: list[int], schedule: str, data: list, chunks: int,
    **options: Any,
) -> tuple[DelayedPipeline, list[float]]:
    """``data``'s mini-batches fed to a DelayedPipeline of ``schedule`` as Pipeline feeds them
    (PipeDream: its ``chunks`` micro-batches, a unit each; 2BW: the mini-batch, one unit),
    flushed; with each mini-batch's mean loss, as Pipeline.train_step returns it."""
    delayed = DelayedPipeline(model, balance, schedule=schedule,
                              loss_fn=nn.functional.cross_entropy, **options)
    micro = schedule == "pipedream"
    for x, y in data:
        for k in range(0, len(x), len(x) // chunks) if micro else [0]:
            end = k + len(x) // chunks if micro else len(x)
            delayed.train_step(x[k:end], y[k:end])
    delayed.flush()
    per_step = [sum(delayed.losses[i : i + chunks]) / chunks
                for i in range(0, len(delayed.losses), chunks)] if micro else delayed.losses
    return delayed, per_step


def test_synchronous_schedule_is_plain_training():
    data = batches(3)
    delayed = DelayedPipeline(mlp(), BALANCE, schedule="1f1b",
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    for x, y in data:
        delayed.train_step(x, y)
    delayed.flush()
    state, losses = reference(mlp(), data)
    for key, value in state.items():
        assert (delayed.module.state_dict()[key] - value).abs().max().item() <= 1e-5, key
    assert delayed.losses == pytest.approx(losses, abs=1e-6)
    with pytest.raises(ValueError, match="Pipeline"):  # 2BW without stashing: see the message
        DelayedPipeline(mlp(), BALANCE, schedule="pipedream-2bw", weight_stashing=False,
                        loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    with pytest.raises(ValueError, match="no lag"):
        DelayedPipeline(mlp(), BALANCE, schedule="1f1b", loss_fn=nn.functional.cross_entropy,
                        optimizer=sgd, weight_prediction="momentum")


def test_lags_replace_the_schedules():
    data = batches(3)

    def trained(**options) -> torch.Tensor:
        delayed = DelayedPipeline(mlp(), BALANCE, loss_fn=nn.functional.cross_entropy,
                                  optimizer=sgd, **options)
        for x, y in data:
            delayed.train_step(x, y)
        return delayed.eval_step(data[0][0])  # type: ignore[return-value]

    pipedream = trained()
    assert torch.equal(trained(lags=(3, 2, 1, 0)), pipedream)  # PipeDream's own lags
    assert torch.equal(trained(lags=(0, 0, 0, 0)), trained(schedule="1f1b"))
    assert (trained(lags=(3, 0, 0, 0)) - pipedream).abs().max() > 1e-4  # stages 1-2 on time
    for wrong in [(0, 1, 0, 0), (1, 1, 1), (1, 0, 0, -1)]:
        with pytest.raises(ValueError, match="first stage's the largest"):
            trained(lags=wrong)
    with pytest.raises(ValueError, match="give it lag 0"):
        trained(lags=(3, 3, 3, 3), weight_stashing=False)


@pytest.mark.parametrize("stashing", [True, False])
def test_a_flush_under_no_grad_still_trains(stashing):
    """eval_step flushes the units in flight; a caller's torch.no_grad() must not drop their
    gradients (stashing: silently) or break their backward (without stashing)."""
    data = batches(2)
    outputs = []
    for no_grad in (False, True):
        delayed = DelayedPipeline(mlp(), BALANCE, loss_fn=nn.functional.cross_entropy,
                                  optimizer=sgd, weight_stashing=stashing)
        for x, y in data:
            delayed.train_step(x, y)
        with torch.no_grad() if no_grad else torch.enable_grad():
            outputs.append(delayed.eval_step(data[0][0]))
    assert torch.equal(outputs[0], outputs[1])


def test_weights_tied_across_stages_are_refused():
    model = mlp()
    model[8].weight = model[0].weight  # layers 0 and 8 sit on stages 0 and 2 of BALANCE
    with pytest.raises(ValueError, match="untie"):
        DelayedPipeline(model, BALANCE, loss_fn=nn.functional.cross_entropy, optimizer=sgd)
