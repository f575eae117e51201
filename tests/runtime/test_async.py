"""Asynchronous PipeDream 1F1B and 2BW in the runtime: weight stashing, weight prediction, lag,
flush; real gloo processes against the same pipeline run as threads of one process.

What each test pins down:
* the predictor reproduces the weights that real optimizer steps reach, in the cases its model
  is exact (SGD: constant velocity / decaying velocity; Adam(W): constant moments);
* every stage's measured lag (updates between a micro-batch's forward and backward) equals the
  schedule's p-1-s (PipeDream) or min(1, p-1-s) (2BW);
* under stashing the forward and backward of every micro-batch read bit-identical weights (and
  without stashing they do not, on stages with lag);
* prediction with lr=0 equals stashing; with one stage, asynchronous training equals plain
  training (PipeDream: one update per micro-batch; 2BW: one per mini-batch);
* across processes the results equal the single-process (threads) run of the same pipeline.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.training.weights import PredictionError, predict
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, reference, sgd

BALANCE = {2: [4, 8], 4: [2, 3, 4, 3]}
CHUNKS = 4
STEPS = 5
PLAIN = dict(weight_prediction=None, delay_compensation=None)  # not the "auto" defaults
CONFIGS = {
    "stash": dict(PLAIN, schedule="pipedream"),
    "stale": dict(PLAIN, schedule="pipedream", weight_stashing=False),
    "predict": dict(PLAIN, schedule="pipedream", weight_prediction="momentum"),
    "default": dict(schedule="pipedream"),
    "2bw": dict(PLAIN, schedule="pipedream-2bw"),
    "2bw-predict": dict(PLAIN, schedule="pipedream-2bw", weight_prediction="momentum"),
    "2bw-default": dict(schedule="pipedream-2bw"),
    # train_step and eval_step called inside the caller's torch.no_grad(): trains all the same
    "default-no-grad": dict(schedule="pipedream", caller_no_grad=True),
}


def _train(world: int, devices: bool, optimizer=sgd, steps: int = STEPS, **options) -> dict:
    if devices:
        options["devices"] = ["cpu"] * world
    caller = torch.no_grad() if options.pop("caller_no_grad", False) else nullcontext()
    pipe = pipetrain.Pipeline(
        mlp(), BALANCE[world], chunks=CHUNKS, loss_fn=nn.functional.cross_entropy,
        optimizer=optimizer, timeout=60, **options,
    )
    for stage in pipe.stages:
        assert stage.versions is not None
        stage.versions.record = True
    data = batches(steps)
    with caller:
        losses = [float(pipe.train_step(x, y)) for x, y in data]
        in_flight = pipe.in_flight
        output = pipe.eval_step(data[0][0])  # flushes first
    return {
        "losses": losses,
        "in_flight": (in_flight, pipe.in_flight),
        "state": pipe.module.state_dict(),
        "output": output,
        "lags": {s.index: dict(s.versions.lags) for s in pipe.stages},  # type: ignore[union-attr]
        "identical": {s.index: dict(s.versions.identical) for s in pipe.stages},  # type: ignore[union-attr]
        "versions": {s.index: s.versions.peak_versions for s in pipe.stages},  # type: ignore[union-attr]
        "lag": pipe.schedule.lag,
    }


def _every_config(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {name: _train(world, False, **options) for name, options in CONFIGS.items()}


@pytest.fixture(scope="module", params=[2, 4], ids=["2-stages", "4-stages"])
def runs(request):
    world = request.param
    per_rank = values(run_ranks(_every_config, world, deadline=120))
    merged: dict = {}
    for name in CONFIGS:
        first = per_rank[0][name]
        merged[name] = {
            "losses": first["losses"],
            "in_flight": first["in_flight"],
            "output": per_rank[-1][name]["output"],
            "state": {k: v for r in per_rank for k, v in r[name]["state"].items()},
            **{
                key: {s: v for r in per_rank for s, v in r[name][key].items()}
                for key in ("lags", "identical", "versions")
            },
            "lag": first["lag"],
        }
    return world, merged


@pytest.mark.parametrize("name", list(CONFIGS))
def test_processes_equal_threads(runs, name):
    world, results = runs
    here = _train(world, True, **CONFIGS[name])
    got = results[name]
    assert got["losses"] == pytest.approx(here["losses"], abs=1e-6)
    for key, value in here["state"].items():
        assert (got["state"][key] - value).abs().max().item() <= 1e-6, key
    assert (got["output"] - here["output"]).abs().max().item() <= 1e-6
    assert got["in_flight"] == (world > 1, False)  # eval_step flushed the pipeline


@pytest.mark.parametrize("name", list(CONFIGS))
def test_measured_lag_equals_the_schedule_formula(runs, name):
    world, results = runs
    got = results[name]
    two = name.startswith("2bw")
    expected = tuple(min(1, world - 1 - s) if two else world - 1 - s for s in range(world))
    assert got["lag"] == expected
    for s in range(world):
        lags = got["lags"][s]
        assert sorted(lags) == list(range(STEPS * CHUNKS)), "every micro-batch went backward"
        assert max(lags.values()) == expected[s]
        if not two:  # once the pipeline is full, every micro-batch sees the whole lag
            assert all(v == expected[s] for g, v in lags.items() if expected[s] <= g < 16)


@pytest.mark.parametrize("name", ["stash", "2bw", "predict", "2bw-predict", "default",
                                  "2bw-default"])
def test_forward_and_backward_read_bit_identical_weights(runs, name):
    world, results = runs
    got = results[name]
    for s in range(world):
        assert all(got["identical"][s].values()), f"stage {s}"
    # stage s holds at most lag+1 copies (PipeDream) or 2 (2BW), none on the last stage
    for s, peak in got["versions"].items():
        bound = 2 if name.startswith("2bw") else world - s
        assert peak <= (bound if s < world - 1 else 0)


def test_without_stashing_the_backward_reads_newer_weights(runs):
    world, results = runs
    got = results["stale"]
    first = got["identical"][0]  # stage 0 has weights and lag world-1
    assert not all(first.values())
    assert all(got["identical"][world - 1].values())  # no lag, nothing changes
    assert all(v == 0 for v in got["versions"].values())  # nothing is copied


def _sgd_zero(params):
    return torch.optim.SGD(params, lr=0.0, momentum=0.9)


def test_prediction_with_zero_learning_rate_equals_stashing():
    stash = _train(4, True, optimizer=_sgd_zero, schedule="pipedream", **PLAIN)
    predicted = _train(4, True, optimizer=_sgd_zero, schedule="pipedream",
                       **dict(PLAIN, weight_prediction="momentum"))
    assert stash["losses"] == predicted["losses"]
    for key, value in stash["state"].items():
        assert torch.equal(value, predicted["state"][key])


def test_one_stage_pipedream_is_plain_training_on_micro_batches():
    data = batches(3)
    pipe = pipetrain.Pipeline(
        mlp(), [len(mlp())], chunks=CHUNKS, schedule="pipedream", devices=["cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, weight_prediction="momentum",
    )
    losses = [pipe.train_step(x, y) for x, y in data]
    pipe.flush()
    micro = [(x[k : k + 6], y[k : k + 6]) for x, y in data for k in range(0, 24, 6)]
    expected_state, expected_losses = reference(mlp(), micro)
    for key, value in pipe.module.state_dict().items():
        assert (value - expected_state[key]).abs().max().item() <= 1e-5, key
    per_call = [sum(expected_losses[4 * c : 4 * c + 4]) / 4 for c in range(3)]
    assert losses == pytest.approx(per_call, abs=1e-6)


def test_one_stage_2bw_is_plain_training_on_mini_batches():
    data = batches(3)
    pipe = pipetrain.Pipeline(
        mlp(), [len(mlp())], chunks=CHUNKS, schedule="pipedream-2bw", devices=["cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=sgd,
    )
    losses = [pipe.train_step(x, y) for x, y in data]
    pipe.flush()
    expected_state, expected_losses = reference(mlp(), data)
    for key, value in pipe.module.state_dict().items():
        assert (value - expected_state[key]).abs().max().item() <= 1e-5, key
    assert losses == pytest.approx(expected_losses, abs=1e-6)


# -- the predictor against real optimizer steps ---------------------------------------------


def _param(seed: int = 0) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(7, 5, generator=g, dtype=torch.float64))


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 3, 5])
def test_spectrain_is_exact_when_the_velocity_stays(steps, nesterov):
    p = _param()
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9, nesterov=nesterov)
    p.grad = torch.randn_like(p)
    opt.step()
    predicted = predict(opt, [p], steps, "spectrain")[0]
    v = opt.state[p]["momentum_buffer"]
    for _ in range(steps):  # gradients (1 - mu) v keep v where it is
        p.grad = (1 - 0.9) * v.clone()
        opt.step()
    assert torch.allclose(predicted, p.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_msnag_is_exact_when_future_gradients_vanish(steps):
    p = _param(1)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.8)
    p.grad = torch.randn_like(p)
    opt.step()
    predicted = predict(opt, [p], steps, "msnag")[0]
    for _ in range(steps):
        p.grad = torch.zeros_like(p)
        opt.step()
    assert torch.allclose(predicted, p.detach(), rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("steps", [1, 3])
def test_adam_prediction_is_exact_when_the_moments_stay(kind, steps):
    p = _param(2)
    # betas with (1 - b1)^2 = 1 - b2: after one step v = m^2, and gradients equal to m keep
    # both moments where they are; Adam's bias corrections still change every step
    if kind == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam([p], lr=0.01, betas=(0.9, 0.99))
    else:
        opt = torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    p.grad = torch.randn_like(p)
    opt.step()
    predicted = predict(opt, [p], steps)[0]
    m = opt.state[p]["exp_avg"].clone()
    for _ in range(steps):
        p.grad = m.clone()
        opt.step()
    assert torch.allclose(opt.state[p]["exp_avg"], m, rtol=0, atol=1e-15)
    assert torch.allclose(predicted, p.detach(), rtol=0, atol=1e-12)


def test_prediction_refuses_optimizers_it_cannot_model():
    p = _param()
    with pytest.raises(PredictionError, match="Adagrad"):
        predict(torch.optim.Adagrad([p]), [p], 1)
    with pytest.raises(PredictionError, match="momentum=0"):
        predict(torch.optim.SGD([p], lr=0.1), [p], 1)
    with pytest.raises(PredictionError, match="Adagrad"):
        pipetrain.Pipeline(
            mlp(), [4, 8], chunks=2, schedule="pipedream", devices=["cpu"] * 2,
            loss_fn=nn.functional.cross_entropy, weight_prediction="momentum",
            optimizer=lambda ps: torch.optim.Adagrad(ps),
        )


def test_asynchronous_options_are_checked():
    with pytest.raises(ValueError, match="weight_stashing=False keeps no copy"):
        pipetrain.Pipeline(mlp(), [4, 8], schedule="pipedream", recompute="always",
                           weight_stashing=False, devices=["cpu"] * 2)
    with pytest.raises(ValueError, match="asynchronous"):
        pipetrain.Pipeline(mlp(), [4, 8], schedule="1f1b", weight_prediction="momentum",
                           devices=["cpu"] * 2)
