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
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

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
