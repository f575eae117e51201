"""Optimizer factories for pipelines: what ``Pipeline(optimizer=...)`` takes.

:func:`nadamw` is the optimizer of the Nesterov method for asynchronous pipelines (Ajanthan,
Ramasinghe, Zuo, Avraham and Long, "Nesterov Method for Asynchronous Pipeline Parallel
Optimization", ICML 2025): Adam with Nesterov's look-ahead (NAdam, Dozat 2016) and decoupled
weight decay, at a momentum of 0.99, each stage's gradient taken on its stashed weights (the
asynchronous schedules' ``weight_stashing=True``, their default for this optimizer). The
authors' public code runs exactly this: ``torch.optim.NAdam`` with
``decoupled_weight_decay=True`` and ``betas=(0.99, ...)`` under PipeDream's weight stashing.

Per parameter, with gradient g_t (taken on the weights the forward read, ``lag`` updates
before the update t that applies it), lr, momentum mu, eps, weight decay lambda::

    w   <- w (1 - lr lambda)
    m_t  = mu m_{t-1} + (1 - mu) g_t                  v_t = beta2 v_{t-1} + (1 - beta2) g_t^2
    w   <- w - lr [mu m_t / (1 - mu^(t+1)) + (1 - mu) g_t / (1 - mu^t)]
                 / (sqrt(v_t / (1 - beta2^t)) + eps)

The bracket is the look-ahead: the step moves by the momentum as it will be after one more
update (mu m_t), and by the new gradient only through its own small share (1 - mu), 0.01 at
mu = 0.99. A gradient that arrives late therefore moves the weights mostly through the
momentum it joins, which turns over once every 1 / (1 - mu) = 100 updates, so a delay of a few
updates is a small part of the momentum's memory; that is the method's case for the high
momentum under asynchrony.

``torch.optim.NAdam`` warms its momentum up, mu_t = mu (1 - 0.5 * 0.96^(t momentum_decay)),
from mu / 2 over some 10,000 updates at its default momentum_decay 0.004, which the authors'
code keeps (their runs, 50,000 updates, spend most of their time past the warm-up); so does
:func:`nadamw`. ``momentum_decay=CONSTANT`` holds mu from the first update instead: on the
staleness study's GPT (docs/staleness.md) that trains worse under delay, not better.

:func:`muon_adamw` is the Muon recipe (Jordan et al. 2024; Liu et al., "Muon is Scalable for
LLM Training", 2025): ``torch.optim.Muon`` (torch >= 2.9) on a stage's 2-D weight matrices,
``torch.optim.AdamW`` on the rest (biases, norms, and the matrices the user names: embeddings
and the output head), as one optimizer, :class:`MuonAdamW`, at one learning rate and weight
decay: Muon's ``adjust_lr_fn="match_rms_adamw"`` scales its orthogonalized update to AdamW's
typical RMS (0.2 sqrt(max(rows, cols))), so the AdamW lr serves both. Muon is the optimizer
that survives a one-step delay (Zmushko et al., ICML 2026): use it with ``"pipedream-2bw"``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

MUON_TORCH = "2.9"  # the first torch with torch.optim.Muon
NESTEROV_MOMENTUM = 0.99  # the method's momentum (the authors' run script: --momentum 0.99)
CONSTANT = 1e4  # a momentum_decay with 0.96^(t momentum_decay) = 0 in float32 from t = 1 on


def nadamw(
    lr: float, *, momentum: float = NESTEROV_MOMENTUM, beta2: float = 0.999,
    weight_decay: float = 0.01, eps: float = 1e-8, momentum_decay: float = 0.004,
) -> Callable[[Iterable[nn.Parameter] | Iterable[dict[str, Any]]], torch.optim.NAdam]:
    """A factory of NAdamW (``torch.optim.NAdam`` with decoupled weight decay) for each stage:
    ``Pipeline(..., optimizer=pipetrain.optim.nadamw(3e-4))``. ``momentum`` is beta1 (the
    method's 0.99); ``momentum_decay`` is NAdam's warm-up of it (0.004: torch's default and
    the authors'; CONSTANT: none)."""
    if not 0.0 <= momentum < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(
            f"nadamw: momentum and beta2 must lie in [0, 1), got {momentum} and {beta2}; the "
            f"method's momentum is {NESTEROV_MOMENTUM}"
        )
    if not lr > 0 or weight_decay < 0 or not momentum_decay > 0:
        raise ValueError(
            f"nadamw: lr and momentum_decay must be positive and weight_decay at least 0, got "
            f"lr={lr}, momentum_decay={momentum_decay}, weight_decay={weight_decay}"
        )

    def build(params: Iterable[nn.Parameter] | Iterable[dict[str, Any]]) -> torch.optim.NAdam:
        return torch.optim.NAdam(
            params, lr=lr, betas=(momentum, beta2), eps=eps, weight_decay=weight_decay,
            momentum_decay=momentum_decay, decoupled_weight_decay=True,
        )

    return build


class MuonAdamW(torch.optim.Optimizer):
    """Muon on ``params``' 2-D tensors, AdamW on the others and on ``adamw`` (embeddings and
    the head: the recipe keeps them on AdamW although they are matrices). One optimizer for a
    stage: its ``param_groups`` are Muon's group (``group["muon"]`` True) then AdamW's, with
    one ``lr`` and ``weight_decay`` each, which LR schedules and delay compensations scale."""

    def __init__(
        self, params: Iterable[nn.Parameter], *, lr: float, adamw: Iterable[nn.Parameter] = (),
        weight_decay: float = 0.1, momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
    ):
        if not hasattr(torch.optim, "Muon"):
            raise RuntimeError(
                f"MuonAdamW needs torch.optim.Muon, in torch >= {MUON_TORCH}; this is torch "
                f"{torch.__version__}: upgrade torch or pass another optimizer"
            )
        params, plain = list(params), {id(p) for p in adamw}
        matrices = [p for p in params if p.ndim == 2 and id(p) not in plain]
        rest = [p for p in params if p.ndim != 2 or id(p) in plain]
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})
        self._muon = torch.optim.Muon(
            matrices, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True,
            adjust_lr_fn="match_rms_adamw",
        ) if matrices else None
        self._adamw = torch.optim.AdamW(
            rest, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay) if rest else None
        for inner, muon in ((self._muon, True), (self._adamw, False)):
            for group in inner.param_groups if inner is not None else []:
                group["muon"] = muon
        self.param_groups = [g for o in self._parts() for g in o.param_groups]
        self._link()

    def _parts(self) -> list[torch.optim.Optimizer]:
        return [o for o in (self._muon, self._adamw) if o is not None]

    def _link(self) -> None:
        """The inner optimizers read this one's groups and state: one set of hyperparameters
        for schedules, compensations and checkpoints to change."""
        for inner in self._parts():
            muon = inner is self._muon
            inner.param_groups = [g for g in self.param_groups if g["muon"] == muon]
            inner.state = self.state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One Muon step on the matrices and one AdamW step on the rest."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for inner in self._parts():
            inner.step()
        return loss


def muon_adamw(
    lr: float, *, adamw: Iterable[nn.Parameter] = (), weight_decay: float = 0.1,
    momentum: float = 0.95, betas: tuple[float, float] = (0.9, 0.95),
) -> Callable[[list[nn.Parameter]], MuonAdamW]:
    """A factory of :class:`MuonAdamW` for each stage: ``Pipeline(..., optimizer=
    pipetrain.optim.muon_adamw(3e-3, adamw=[*embed.parameters(), *head.parameters()]))``.
    ``adamw``: the matrices to keep on AdamW (the embeddings and head), matched by identity
    among each stage's parameters; every tensor that is not 2-D goes to AdamW anyway."""
    if not lr > 0 or weight_decay < 0:
        raise ValueError(f"muon_adamw: lr must be positive and weight_decay at least 0, got "
                         f"lr={lr}, weight_decay={weight_decay}")
    kept = list(adamw)

    def build(params: list[nn.Parameter]) -> MuonAdamW:
        return MuonAdamW(params, lr=lr, adamw=kept, weight_decay=weight_decay,
                         momentum=momentum, betas=betas)

    return build
