"""The error-feedback delay correction (``delay_compensation="error-feedback"``,
pipetrain/training/compensation.py) and MuonAdamW (pipetrain/optim.py).

What each test pins down:
* the correction is ``w += u_t + lag (u_t - u_{t-1})``, u_t the optimizer's own update: against
  the closed form for plain SGD, and against the optimizer's uncorrected steps for AdamW and
  Muon (their u_t depend on the weights only through weight decay, checked by a twin);
* at lag 0 it is the identity; it survives a checkpoint;
* a real 2-process gloo Pipeline under "pipedream-2bw" with the correction (AdamW, and Muon on
  the matrices with AdamW on the rest) equals the same delayed updates computed by hand in one
  process: stage 0 (lag 1) differentiates mini-batch k on its weights after k - 1 updates and
  applies the corrected update to the live weights, the last stage (lag 0) trains plainly;
* MuonAdamW puts the 2-D tensors on Muon and the rest (and the named matrices) on AdamW, and
  its state round-trips.
Tolerances: 1e-12 where a float64 formula is checked; float32 pipelines against the hand
computation 1e-5 (2BW's gradient is a sum of micro-batch gradients), as in test_delayed.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

import pipetrain
from pipetrain.optim import MuonAdamW, muon_adamw
from pipetrain.training.compensation import Compensator, DelayCompensation
from pipetrain.training.weights import stage_versions
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp

HAS_MUON = hasattr(torch.optim, "Muon")
NO_MUON = f"torch.optim.Muon needs torch >= 2.9; this is torch {torch.__version__}"
BALANCE = [4, 8]  # 2BW on 2 stages: lags (1, 0)
CHUNKS = 4


def adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def muon(params):
    return muon_adamw(0.01)(list(params))


OPTIMIZERS = {"adamw": adamw, "muon": muon}


def _needs(name: str) -> None:
    if name == "muon" and not HAS_MUON:
        print(NO_MUON)
        pytest.skip(NO_MUON)


def _grads(steps: int, shape: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randn(*shape, generator=g, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("lag", [1, 2])
def test_sgd_closed_form(lag):
    p = nn.Parameter(torch.zeros(4, 3, dtype=torch.float64))
    comp = Compensator(DelayCompensation.parse("error-feedback"),
                       torch.optim.SGD([p], lr=0.1), [p], lag)
    expected, previous = torch.zeros_like(p), None
    for g in _grads(6, (4, 3)):
        p.grad = g.clone()
        comp.step()
        expected -= 0.1 * g if previous is None else 0.1 * (g + lag * (g - previous))
        previous = g
        assert (p.detach() - expected).abs().max().item() <= 1e-12


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_correction_adds_the_change_of_the_optimizers_update(name):
    _needs(name)
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
            "muon": lambda ps: torch.optim.Muon(ps, lr=0.01, adjust_lr_fn="match_rms_adamw")}[name]
    p = nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(0),
                                 dtype=torch.float64))
    twin = nn.Parameter(p.detach().clone())
    comp = Compensator(DelayCompensation.parse("error-feedback"), make([p]), [p], 1)
    plain = make([twin])
    previous = None
    for g in _grads(5, (6, 4)):
        p.grad, twin.grad = g.clone(), g.clone()
        start = p.detach().clone()
        twin.data.copy_(start)  # the uncorrected step from the same weights and state
        plain.step()
        update = twin.detach() - start
        comp.step()
        expected = start + update + (0 if previous is None else update - previous)
        assert (p.detach() - expected).abs().max().item() <= 1e-12
        previous = update


def test_lag_zero_is_the_identity_and_state_round_trips():
    p, q = (nn.Parameter(torch.ones(3, dtype=torch.float64)) for _ in range(2))
    comp = Compensator(DelayCompensation.parse("error-feedback"), torch.optim.SGD([p], lr=0.1),
                       [p], 0)
    plain = torch.optim.SGD([q], lr=0.1)
    for g in _grads(3, (3,)):
        p.grad, q.grad = g.clone(), g.clone()
        comp.step()
        plain.step()
    assert torch.equal(p, q)
    late = Compensator(DelayCompensation.parse("error-feedback"), torch.optim.SGD([p], lr=0.1),
                       [p], 1)
    p.grad = torch.ones(3, dtype=torch.float64)
    late.step()
    again = Compensator(DelayCompensation.parse("error-feedback"), torch.optim.SGD([q], lr=0.1),
                        [q], 1)
    again.load_state_dict(copy.deepcopy(late.state_dict()))
    assert again._last is not None and torch.equal(again._last[0], late._last[0])  # type: ignore[index]


def test_options_parse():
    spec = DelayCompensation.parse("spike+error-feedback")
    assert spec.spike and spec.error_feedback == 1.0
    with pytest.raises(ValueError, match="error-feedback"):
        DelayCompensation.parse("error-feedback+error-feedback")


def by_hand(optimizer, data) -> dict[str, torch.Tensor]:
    """2BW on BALANCE in one process: stage 0's gradient of mini-batch k on its weights after
    k - 1 updates (k = 0: the initial ones), applied with error feedback; stage 1 plain."""
    model = mlp()
    first = {n for n, _ in model.named_parameters() if int(n.split(".")[0]) < BALANCE[0]}
    live = dict(model.named_parameters())
    opts = [optimizer([p for n, p in live.items() if n in first]),
            optimizer([p for n, p in live.items() if n not in first])]
    stashed = {n: live[n].detach().clone() for n in first}  # version k - 1
    last: dict[str, torch.Tensor] = {}
    for x, y in data:
        read = {n: t.clone().requires_grad_() for n, t in stashed.items()}
        stashed = {n: live[n].detach().clone() for n in first}  # the next unit reads this one
        loss = nn.functional.cross_entropy(functional_call(model, {**live, **read}, (x,)), y)
        loss.backward()
        for n in first:
            live[n].grad = read[n].grad
        before = {n: live[n].detach().clone() for n in first}
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for n in first:
                update = live[n] - before[n]
                if n in last:
                    live[n] += update - last[n]
                last[n] = update.clone()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _pipeline(name: str, steps: int) -> dict:
    pipe = pipetrain.Pipeline(
        mlp(), BALANCE, chunks=CHUNKS, schedule="pipedream-2bw",
        loss_fn=nn.functional.cross_entropy, optimizer=OPTIMIZERS[name], timeout=60,
        weight_prediction=None, delay_compensation="error-feedback",
    )
    for x, y in batches(steps):
        pipe.train_step(x, y)
    pipe.flush()
    return pipe.module.state_dict()


def _ranks(rank: int, world: int, name: str) -> dict:
    return _pipeline(name, 5)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_two_processes_equal_the_delayed_updates_by_hand(name):
    _needs(name)
    per_rank = values(run_ranks(_ranks, 2, name, deadline=120))
    state = {k: v for r in per_rank for k, v in r.items()}
    expected = by_hand(OPTIMIZERS[name], batches(5))
    assert set(state) == set(expected)
    for key, value in expected.items():
        assert (state[key] - value).abs().max().item() <= 1e-5, key
    plain = dict(mlp().named_parameters())
    assert any((state[k] - v).abs().max().item() > 1e-3 for k, v in plain.items())


@pytest.mark.skipif(not HAS_MUON, reason=NO_MUON)
def test_muon_adamw_splits_and_round_trips():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    opt = muon_adamw(0.01, adamw=[model[0].weight, *model[3].parameters()])(
        list(model.parameters()))
    muon_group, adamw_group = opt.param_groups
    assert muon_group["muon"] and [id(p) for p in muon_group["params"]] == [id(model[1].weight)]
    assert not adamw_group["muon"] and len(adamw_group["params"]) == 6
    x = torch.randint(0, 10, (4,))
    model(x).square().mean().backward()
    opt.step()
    clone = copy.deepcopy(model)
    again = muon_adamw(0.01, adamw=[clone[0].weight, *clone[3].parameters()])(
        list(clone.parameters()))
    again.load_state_dict(copy.deepcopy(opt.state_dict()))  # as a checkpoint file holds it
    for m in (model, clone):
        m.zero_grad()
        m(x).square().mean().backward()
    opt.step()
    again.step()
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)


def test_muon_adamw_names_the_torch_it_needs(monkeypatch):
    monkeypatch.delattr(torch.optim, "Muon", raising=False)
    with pytest.raises(RuntimeError, match=r"torch >= 2\.9"):
        MuonAdamW([nn.Parameter(torch.ones(2, 2))], lr=0.1)


@pytest.mark.skipif(not HAS_MUON, reason=NO_MUON)
@pytest.mark.parametrize(("schedule", "stashing", "expected"), [
    ("pipedream-2bw", True, DelayCompensation(error_feedback=1.0)),
    ("pipedream-2bw", False, None),  # PipeDream's own, unstashed
    ("pipedream", True, None),
])
def test_auto_gives_muon_error_feedback_under_2bw(schedule, stashing, expected):
    p = nn.Parameter(torch.ones(3, 3))
    for opt in (muon([p]), torch.optim.Muon([p])):
        versions = stage_versions([p], opt, lag=1, update_every=1, weight_stashing=stashing,
                                  weight_prediction="auto", compensation="auto",
                                  schedule=schedule)
        got = versions.compensator.spec if versions.compensator else None
        assert got == expected
