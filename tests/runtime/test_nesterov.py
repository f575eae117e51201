"""The Nesterov method for asynchronous pipelines (pipetrain.optim.nadamw, issue 32): NAdamW at
momentum 0.99 on stashed weights.

Checked against references written here: the update's equations by hand (float64 weights,
1e-7: torch keeps NAdam's momentum product mu^t in float32, which moves the bias correction by
about 1e-7 of the step; a wrong term moves it by far more), a late stage's update (stashed
weights of the right version, float32, 1e-6), lag 0 against torch's own NAdam in one process on
a GPT (1e-6: the pipeline runs the same operations, in float32), the Pipeline against
DelayedPipeline (1e-5, as tests/benchmarks/test_delayed.py), and a checkpoint resumed mid-run
(bit-identical, and not so when the optimizer's state is left out of the checkpoint)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain
from benchmarks.delayed import DelayedPipeline
from examples.models import gpt, lm_loss
from pipetrain.checkpoints import checkpointing
from pipetrain.optim import nadamw
from tests.runtime.models import batches, mlp

LR, MU, BETA2, EPS, DECAY, WARMUP = 0.01, 0.99, 0.999, 1e-8, 0.1, 0.004


def momentum(t: int, warmup: float = WARMUP) -> float:
    """NAdam's momentum at update t: mu (1 - 0.5 * 0.96^(t warmup)), mu from t large on."""
    return MU * (1 - 0.5 * 0.96 ** (t * warmup))


def method(w: torch.Tensor, g: torch.Tensor, state: dict, lr: float = LR) -> torch.Tensor:
    """One update of the method, from its equations: decoupled decay, then Adam's moments and
    the Nesterov look-ahead mu_(t+1) m_t / (1 - prod_(i<=t+1) mu_i) + (1 - mu_t) g / (1 -
    prod_(i<=t) mu_i)."""
    t = state["t"] = state.get("t", 0) + 1
    product = state["product"] = state.get("product", 1.0) * momentum(t)
    m = state["m"] = MU * state.get("m", torch.zeros_like(w)) + (1 - MU) * g
    v = state["v"] = BETA2 * state.get("v", torch.zeros_like(w)) + (1 - BETA2) * g * g
    look_ahead = (momentum(t + 1) * m / (1 - product * momentum(t + 1))
                  + (1 - momentum(t)) * g / (1 - product))
    return w * (1 - lr * DECAY) - lr * look_ahead / ((v / (1 - BETA2**t)).sqrt() + EPS)


def factory(params):
    return nadamw(LR, beta2=BETA2, weight_decay=DECAY)(params)


def test_the_update_follows_the_equations():
    w = nn.Parameter(torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64))
    optimizer = factory([w])
    expected, state = w.detach().clone(), {}
    for g in ([0.3, -0.2, 0.1], [0.1, 0.4, -0.5], [-0.2, 0.05, 0.3]):
        w.grad = torch.tensor(g, dtype=torch.float64)
        optimizer.step()
        expected = method(expected, w.grad, state)
        assert torch.allclose(w.detach(), expected, rtol=0, atol=1e-7)
    product = momentum(1) * momentum(2) * momentum(3)
    assert float(optimizer.state[w]["mu_product"]) == pytest.approx(product, abs=1e-7)


def test_a_late_stage_applies_the_method_to_its_stashed_weights():
    """Two stages under PipeDream (lags 1 and 0): unit u's forward reads the first stage's
    weights after u - 1 updates (stashed), and its gradient updates the live weights."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))
    first = [p.detach().clone() for p in model[0].parameters()]
    last = [p.detach().clone() for p in model[2].parameters()]
    pipe = DelayedPipeline(copy.deepcopy(model), [2, 1], loss_fn=nn.functional.mse_loss,
                           optimizer=factory)
    assert pipe.lags == [1, 0]
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(6, 4, generator=g), torch.randn(6, 3, generator=g)) for _ in range(6)]
    history, states = [first], [{}, {}, {}, {}]
    for u, (x, y) in enumerate(data):
        pipe.train_step(x, y)
        read = [w.clone().requires_grad_() for w in history[max(u - 1, 0)]]
        used = [w.clone().requires_grad_() for w in last]
        hidden = torch.tanh(nn.functional.linear(x, *read))
        loss = nn.functional.mse_loss(nn.functional.linear(hidden, *used), y)
        grads = torch.autograd.grad(loss, read + used)
        live = history[-1]
        history.append([method(w, gr, s) for w, gr, s in zip(live, grads[:2], states[:2],
                                                              strict=True)])
        last = [method(w, gr, s) for w, gr, s in zip(last, grads[2:], states[2:], strict=True)]
    pipe.flush()
    for got, want in zip(pipe.module.parameters(), history[-1] + last, strict=True):
        assert (got.detach() - want).abs().max().item() <= 1e-6


def tiny_gpt(seed: int = 0) -> nn.Sequential:
    return gpt(vocab=32, dim=16, blocks=2, heads=2, context=8, dropout=0.1, seed=seed,
               tied=False)


def tokens(steps: int, batch: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 32, (batch, 9), generator=g)
        out.append((ids[:, :-1], ids[:, 1:]))
    return out


def test_lag_zero_is_synchronous_nadamw():
    """A one-stage PipeDream (lag 0, an update per micro-batch) with nadamw equals torch's NAdam
    with decoupled weight decay at momentum 0.99 (torch's momentum warm-up, as the authors'
    code), stepped in one process on each micro-batch; dropout off (eval) so that both draw
    nothing at random."""
    data, chunks = tokens(3), 2
    model = tiny_gpt()
    plain = copy.deepcopy(model).eval()
    optimizer = torch.optim.NAdam(plain.parameters(), lr=LR, betas=(MU, BETA2), eps=EPS,
                                  weight_decay=DECAY, momentum_decay=WARMUP,
                                  decoupled_weight_decay=True)
    for x, y in data:
        for k in range(0, len(x), len(x) // chunks):
            optimizer.zero_grad()
            lm_loss(plain(x[k : k + len(x) // chunks]), y[k : k + len(x) // chunks]).backward()
            optimizer.step()
    pipe = pipetrain.Pipeline(model.eval(), [len(model)], chunks=chunks, schedule="pipedream",
                              devices=["cpu"], loss_fn=lm_loss, optimizer=factory)
    for x, y in data:
        pipe.train_step(x, y)
    pipe.flush()
    for key, value in plain.state_dict().items():
        assert (pipe.module.state_dict()[key] - value).abs().max().item() <= 1e-6, key


def test_the_pipeline_equals_delayed_pipeline_under_nadamw():
    balance, chunks, data = [2, 3, 4, 3], 4, batches(4)
    pipe = pipetrain.Pipeline(mlp(), balance, chunks=chunks, schedule="pipedream",
                              devices=["cpu"] * 4, loss_fn=nn.functional.cross_entropy,
                              optimizer=factory)
    delayed = DelayedPipeline(mlp(), balance, loss_fn=nn.functional.cross_entropy,
                              optimizer=factory)
    for x, y in data:
        pipe.train_step(x, y)
        for k in range(0, len(x), len(x) // chunks):
            delayed.train_step(x[k : k + len(x) // chunks], y[k : k + len(x) // chunks])
    pipe.flush()
    delayed.flush()
    for key, value in pipe.module.state_dict().items():
        assert (delayed.module.state_dict()[key] - value).abs().max().item() <= 1e-5, key


def resumed_run(tmp_path, data) -> tuple[dict, dict]:
    """A 4-stage PipeDream GPT (dropout on) saved after 2 steps and trained 2 more, and a fresh
    pipeline resumed from that checkpoint and trained the same 2 steps."""
    def build(**options) -> pipetrain.Pipeline:
        return pipetrain.Pipeline(tiny_gpt(seed=options.pop("seed", 0)), [1, 1, 1, 1],
                                  chunks=2, schedule="pipedream", devices=["cpu"] * 4,
                                  loss_fn=lm_loss, optimizer=factory, **options)

    straight = build()
    for x, y in data[:2]:
        straight.train_step(x, y)
    straight.save(tmp_path)
    for x, y in data[2:]:
        straight.train_step(x, y)
    straight.flush()
    again = build(seed=7, checkpoint_dir=tmp_path)
    assert again.step == 2
    for x, y in data[2:]:
        again.train_step(x, y)
    again.flush()
    return straight.module.state_dict(), again.module.state_dict()


def test_resume_mid_run_is_bit_identical(tmp_path):
    straight, again = resumed_run(tmp_path, tokens(4))
    for key, value in straight.items():
        assert torch.equal(again[key], value), key


def test_resume_without_the_optimizer_state_differs(tmp_path, monkeypatch):
    """The check above can fail: a checkpoint without NAdam's moments and momentum product
    resumes to other weights."""
    saved = checkpointing._optimizer_state

    def without_state(stage, *state):
        return {**saved(stage, *state), "state": {}}

    monkeypatch.setattr(checkpointing, "_optimizer_state", without_state)
    straight, again = resumed_run(tmp_path, tokens(4))
    assert any(not torch.equal(again[key], value) for key, value in straight.items())


@pytest.mark.parametrize("options", [dict(momentum=1.0), dict(beta2=-0.1), dict(lr=0.0),
                                     dict(weight_decay=-1.0), dict(momentum_decay=0.0)])
def test_bad_settings_are_refused_with_the_fix(options):
    settings = {"lr": 0.01, **options}
    with pytest.raises(ValueError, match="nadamw: .*(0.99|positive)"):
        pipetrain.optim.nadamw(**settings)
