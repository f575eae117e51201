"""Delay compensation (pipetrain/training/compensation.py) against real optimizer steps and real
pipelines.

What each test pins down:
* spike compensation makes a gradient that arrives D updates late move the weights exactly as
  the undelayed gradient does from its arrival on (SGD momentum: the whole impulse response);
* the weight predictor stays exact under each compensation where it was exact without one
  (constant velocity / constant Adam moments; vanishing gradients for "msnag"), with the
  learning rate the compensation scales;
* the learning-rate rules scale the step the real optimizer takes and leave the user's lr alone;
  "lag-momentum" keeps the long-run step of a steady gradient;
* the default ("auto") resolves per optimizer and schedule to the study's pick, and a pipeline
  left at its defaults trains exactly as one given that pick explicitly;
* PipeMare's discrepancy correction recovers the weights the forward read when the weights
  move at a constant rate;
* at lag 0 (one stage) every compensation is plain training (PipeDream: an update per
  micro-batch; 2BW: per mini-batch), and across processes the results equal the threads run of
  the same pipeline.
How close 2BW (lag 1) with prediction comes to synchronous 1F1B at the same mini-batch is a
measurement, not an identity: benchmarks/staleness_study.py reports it.
Tolerances: float64 where a formula is checked (1e-12: rounding of a few additions); float32
pipelines against plain training 1e-5, as in tests/runtime/test_async.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.training.compensation import CompensationError, Compensator, DelayCompensation
from pipetrain.training.weights import predict, stage_versions
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, reference, sgd

CHUNKS = 4


def _param(seed: int = 0) -> nn.Parameter:
    g = torch.Generator().manual_seed(seed)
    return nn.Parameter(torch.randn(7, 5, generator=g, dtype=torch.float64))


def _compensator(spec: str | DelayCompensation, optimizer, p, lag: int) -> Compensator:
    return Compensator(DelayCompensation.parse(spec), optimizer, [p], lag)


@pytest.mark.parametrize("lag", [1, 2, 3])
def test_spike_follows_the_undelayed_impulse_response(lag):
    impulse = torch.randn(7, 5, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    undelayed, delayed = _param(), _param()
    plain = torch.optim.SGD([undelayed], lr=0.05, momentum=0.9)
    spiked = _compensator("spike", torch.optim.SGD([delayed], lr=0.05, momentum=0.9), delayed, lag)
    for step in range(lag + 6):
        undelayed.grad = impulse.clone() if step == 0 else torch.zeros_like(impulse)
        plain.step()
        delayed.grad = impulse.clone() if step == lag else torch.zeros_like(impulse)
        spiked.step()
        if step < lag:
            assert torch.equal(delayed, _param()), "nothing has arrived yet"
        else:
            assert torch.allclose(delayed, undelayed, rtol=0, atol=1e-12), step


def _optimizer(kind: str, p: nn.Parameter) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD([p], lr=0.05, momentum=0.9, weight_decay=0.01)
    # (1 - b1)^2 = 1 - b2: gradients equal to m keep both moments (see test_async.py)
    if kind == "adam":
        return torch.optim.Adam([p], lr=0.01, betas=(0.9, 0.99))
    return torch.optim.AdamW([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)


def _steady_gradient(kind: str, optimizer: torch.optim.Optimizer, p: nn.Parameter):
    """The gradient that keeps the optimizer's state where it is under the groups' current
    momentum."""
    state, group = optimizer.state[p], optimizer.param_groups[0]
    if kind == "sgd":  # v <- mu v + (g + wd w): g = (1 - mu) v - wd w
        return (1 - group["momentum"]) * state["momentum_buffer"] - 0.01 * p.detach()
    return state["exp_avg"].clone()


@pytest.mark.parametrize("spec", ["spike", "lag-lr", "spike+lag-lr", "lag-momentum",
                                  "spike+lag-momentum"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("lag", [1, 3])
def test_prediction_is_exact_under_compensation(spec, kind, lag):
    p = _param(2)
    opt = _optimizer(kind, p)
    compensator = _compensator(spec, opt, p, lag)
    p.grad = torch.randn_like(p)
    opt.step()  # a first plain step builds the optimizer's state
    with compensator.adjusted():
        predicted = predict(opt, [p], lag, spike=compensator.spec.spike)[0]
    for _ in range(lag):
        with compensator.adjusted():
            p.grad = _steady_gradient(kind, opt, p)
        compensator.step()
    assert torch.allclose(predicted, p.detach(), rtol=0, atol=1e-12)
    assert opt.param_groups[0]["lr"] == (0.05 if kind == "sgd" else 0.01), "lr restored"
    assert opt.param_groups[0].get("momentum", 0.9) == 0.9, "momentum restored"
    assert opt.param_groups[0].get("betas", (0.9, 0.99)) == (0.9, 0.99), "betas restored"


@pytest.mark.parametrize("lag", [1, 2, 4])
def test_msnag_is_exact_under_spike_when_future_gradients_vanish(lag):
    p = _param(1)
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.8)
    compensator = _compensator("spike", opt, p, lag)
    p.grad = torch.randn_like(p)
    opt.step()
    predicted = predict(opt, [p], lag, "msnag", spike=True)[0]
    for _ in range(lag):
        p.grad = torch.zeros_like(p)
        compensator.step()
    assert torch.allclose(predicted, p.detach(), rtol=0, atol=1e-12)


def test_learning_rate_rules_scale_the_real_step():
    lag, warmup = 4, 10
    expected = {"lag-lr": lambda k: 1 / (1 + lag),
                "pipemare": lambda k: lag ** -(1 - min(k / warmup, 1))}
    for name, scale in expected.items():
        p = _param()
        opt = torch.optim.SGD([p], lr=0.1)  # no momentum: the step is lr * scale * g
        rule = DelayCompensation.parse(name)
        compensator = Compensator(
            DelayCompensation(lr_rule=rule.lr_rule, warmup=warmup), opt, [p], lag
        )
        for k in range(2 * warmup):
            assert compensator.lr_scale == pytest.approx(scale(k), rel=1e-12), (name, k)
            before = p.detach().clone()
            p.grad = torch.ones_like(p)
            compensator.step()
            assert torch.allclose(before - p.detach(), torch.full_like(p, 0.1 * scale(k)),
                                  rtol=1e-12, atol=0), (name, k)
            assert opt.param_groups[0]["lr"] == 0.1
        assert compensator.lr_scale == 1.0 or name == "lag-lr"


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("lag", [1, 3])
def test_lag_momentum_keeps_the_long_run_step(kind, lag):
    """Under a constant gradient the compensated stage ends up moving as fast as the plain
    one (SGD: lr / (1 - mu) per update; Adam: lr), with momentum 1 - (1 - mu) / k and, for
    SGD, lr / k in each update, k = 1 + 2 lag."""
    plain, slow = _param(2), _param(2)
    opts = [_optimizer(kind, q) for q in (plain, slow)]
    for g in opts:
        g.param_groups[0]["weight_decay"] = 0.0
    compensator = _compensator("lag-momentum", opts[1], slow, lag)
    with compensator.adjusted():
        group = opts[1].param_groups[0]
        mu = group["momentum"] if kind == "sgd" else group["betas"][0]
        assert mu == pytest.approx(1 - 0.1 / (1 + 2 * lag), rel=1e-12)
        assert group["lr"] == pytest.approx((0.05 / (1 + 2 * lag)) if kind == "sgd" else 0.01)
    gradient = torch.randn_like(plain)
    for _ in range(800):
        moves = []
        for q, step in ((plain, opts[0].step), (slow, compensator.step)):
            before = q.detach().clone()
            q.grad = gradient.clone()
            step()
            moves.append(q.detach() - before)
    assert torch.allclose(moves[1], moves[0], rtol=1e-3, atol=0)
    assert opts[1].param_groups[0]["lr"] == opts[0].param_groups[0]["lr"]


@pytest.mark.parametrize("lag", [1, 3])
def test_discrepancy_correction_recovers_the_weights_the_forward_read(lag):
    p = _param(3)
    opt = torch.optim.SGD([p], lr=0.05, momentum=0.9)
    compensator = Compensator(DelayCompensation(discrepancy=True), opt, [p], lag)
    velocity = torch.randn_like(p)
    history = [p.detach().clone()]
    assert compensator.backward_weights()[0] is p, "no update yet: the live weights"
    for step in range(8):  # the first gradient sets v; then (1 - mu) v keeps it
        p.grad = velocity.clone() if step == 0 else 0.1 * velocity
        compensator.step()
        history.append(p.detach().clone())
        if len(history) > lag:
            corrected = compensator.backward_weights()[0]
            assert corrected.requires_grad and corrected is not p
            assert torch.allclose(corrected, history[-1 - lag], rtol=0, atol=1e-12), step


# -- pipelines ----------------------------------------------------------------------------------

PIPELINE_CONFIGS = {
    "spike": dict(delay_compensation="spike"),
    "lag-lr": dict(delay_compensation="lag-lr"),
    "pipemare": dict(delay_compensation="pipemare", weight_stashing=False),
    "spike+predict": dict(delay_compensation="spike", weight_prediction="momentum"),
    "spike+lag-lr+predict": dict(delay_compensation="spike+lag-lr", weight_prediction="momentum"),
    "lag-momentum+predict": dict(delay_compensation="lag-momentum", weight_prediction="momentum"),
}


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
@pytest.mark.parametrize("name", list(PIPELINE_CONFIGS))
def test_lag_zero_is_plain_training(name, schedule):
    data = batches(3)
    pipe = pipetrain.Pipeline(
        mlp(), [len(mlp())], chunks=CHUNKS, schedule=schedule, devices=["cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, **PIPELINE_CONFIGS[name],
    )
    losses = [pipe.train_step(x, y) for x, y in data]
    pipe.flush()
    if schedule == "pipedream":  # an update per micro-batch
        micro = [(x[k : k + 6], y[k : k + 6]) for x, y in data for k in range(0, 24, 6)]
        expected_state, expected_losses = reference(mlp(), micro)
        expected_losses = [sum(expected_losses[4 * c : 4 * c + 4]) / 4 for c in range(3)]
    else:
        expected_state, expected_losses = reference(mlp(), data)
    for key, value in pipe.module.state_dict().items():
        assert (value - expected_state[key]).abs().max().item() <= 1e-5, key
    assert losses == pytest.approx(expected_losses, abs=1e-6)


def _train(devices: bool, name: str, schedule: str = "pipedream", steps: int = 4) -> dict:
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=CHUNKS, schedule=schedule, loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, timeout=60, devices=["cpu"] * 2 if devices else None,
        **PIPELINE_CONFIGS.get(name, {}),
    )
    losses = [float(pipe.train_step(x, y)) for x, y in batches(steps)]
    pipe.flush()
    return {"losses": losses, "state": pipe.module.state_dict()}


def _both(rank: int, world: int) -> dict:
    return {name: _train(False, name) for name in ("spike+predict", "pipemare")}


def test_processes_equal_threads():
    per_rank = values(run_ranks(_both, 2, deadline=120))
    for name in ("spike+predict", "pipemare"):
        here = _train(True, name)
        assert per_rank[0][name]["losses"] == pytest.approx(here["losses"], abs=1e-6)
        state = {k: v for r in per_rank for k, v in r[name]["state"].items()}
        for key, value in here["state"].items():
            assert (state[key] - value).abs().max().item() <= 1e-6, (name, key)
    stashed = _train(True, "stash")
    assert any(not torch.equal(stashed["state"][k], v) for k, v in here["state"].items()), (
        "the compensation changed nothing"
    )


def test_compensation_options_are_checked():
    for bad in ("spikes", "spike+spike", "lag-lr+pipemare", "lag-lr+lag-momentum", ""):
        with pytest.raises(CompensationError, match="delay_compensation"):
            DelayCompensation.parse(bad)
    with pytest.raises(ValueError, match="asynchronous"):
        pipetrain.Pipeline(mlp(), [4, 8], schedule="1f1b", delay_compensation="spike",
                           devices=["cpu"] * 2)
    p = _param()
    with pytest.raises(CompensationError, match="momentum=0.9"):
        _compensator("spike", torch.optim.SGD([p], lr=0.1), p, 1)
    with pytest.raises(CompensationError, match="Adagrad"):
        pipetrain.Pipeline(
            mlp(), [4, 8], chunks=2, schedule="pipedream", devices=["cpu"] * 2,
            loss_fn=nn.functional.cross_entropy, delay_compensation="spike",
            optimizer=lambda ps: torch.optim.Adagrad(ps),
        )
    with pytest.raises(CompensationError, match="lag-momentum"):
        _compensator("lag-momentum", torch.optim.SGD([p], lr=0.1), p, 1)
    # the learning-rate rules take any optimizer with an lr
    _compensator("lag-lr", torch.optim.Adagrad([p]), p, 2).step()


@pytest.mark.parametrize(("make", "schedule", "policy", "expected"), [
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "pipedream", "predict",
     DelayCompensation(spike=True, lr_rule="momentum")),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "pipedream-2bw", "predict",
     DelayCompensation(spike=True)),
    (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), "pipedream",
     "predict", DelayCompensation(lr_rule="momentum")),
    (lambda ps: torch.optim.AdamW(ps, lr=0.01), "pipedream", "predict", None),
    (lambda ps: torch.optim.SGD(ps, lr=0.1), "pipedream", "stash", None),  # no momentum
    (lambda ps: torch.optim.Adagrad(ps), "pipedream", "stash", None),
])
def test_auto_resolves_to_the_studys_pick(make, schedule, policy, expected):
    p = _param()
    versions = stage_versions([p], make([p]), lag=2, update_every=1, weight_stashing=True,
                              weight_prediction="auto", compensation="auto", schedule=schedule)
    assert versions.policy == policy
    got = versions.compensator.spec if versions.compensator else None
    assert got == expected
    stale = stage_versions([p], make([p]), lag=2, update_every=1, weight_stashing=False,
                           weight_prediction="auto", compensation="auto", schedule=schedule)
    assert stale.policy == "stale" and stale.compensator is None, "no stashing: PipeDream's own"


def test_defaults_train_as_the_explicit_pick():
    def train(**options) -> dict:
        pipe = pipetrain.Pipeline(
            mlp(), [4, 8], chunks=CHUNKS, schedule="pipedream", devices=["cpu"] * 2,
            loss_fn=nn.functional.cross_entropy, optimizer=sgd, **options,
        )
        for x, y in batches(3):
            pipe.train_step(x, y)
        pipe.flush()
        return pipe.module.state_dict()

    default = train()
    explicit = train(weight_prediction="momentum", delay_compensation="spike+lag-momentum")
    stashed = train(weight_prediction=None, delay_compensation=None)
    assert all(torch.equal(default[k], explicit[k]) for k in default)
    assert any(not torch.equal(default[k], stashed[k]) for k in default), "auto changed nothing"


@pytest.mark.parametrize("stashing", [True, False])
def test_pipemare_state_survives_a_checkpoint(tmp_path, stashing):
    """PipeMare's warm-up counter and (without stashing) its moving average of the weights'
    change are part of a stage's state: a resumed run goes on bit for bit as the run that
    saved (both drained by save()), not from the start of the warm-up."""
    options = dict(chunks=CHUNKS, schedule="pipedream", devices=["cpu"] * 2,
                   loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                   delay_compensation=DelayCompensation(lr_rule="pipemare",
                                                        discrepancy=not stashing, warmup=40),
                   weight_prediction=None, weight_stashing=stashing)
    data = batches(5)
    first = pipetrain.Pipeline(mlp(), [4, 8], **options)
    for x, y in data[:3]:
        first.train_step(x, y)
    first.save(tmp_path)
    again = pipetrain.Pipeline(mlp(seed=99), [4, 8], checkpoint_dir=tmp_path, **options)
    assert [s.versions.compensator.updates for s in again.stages] == [12, 12]
    for x, y in data[3:]:
        first.train_step(x, y)
        again.train_step(x, y)
    first.flush()
    again.flush()
    expected = first.module.state_dict()
    for key, value in again.module.state_dict().items():
        assert torch.equal(value, expected[key]), key
