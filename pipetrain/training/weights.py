"""Weight versions of an asynchronous stage: stashing, prediction, or neither.

In an asynchronous schedule (``schedules/asynchronous.py``) stage s applies
``lag = schedule.lag[s]`` updates between a micro-batch's forward and its backward. Three
policies:

* ``"stash"`` (PipeDream's weight stashing): the forward runs on a copy of the weights taken at
  the forward (one copy per update unit: per micro-batch for PipeDream, per mini-batch for
  2BW); the backward differentiates through that same copy, so forward and backward see
  bit-identical weights, and the gradient is applied to the live weights. A copy is done with
  when its micro-batches' backwards are, and a later forward reuses its memory, so a stage holds
  at most the versions its lag needs (lag + 1 copies for PipeDream, at most 2 for 2BW, none when
  lag is 0).
* ``"predict"``: the forward runs on the weights the stage is expected to have after ``lag``
  more updates (:func:`predict`), the backward through the same tensors, and the gradient is
  applied to the live weights. Memory is that of stashing (the predicted tensors are what the
  graph holds), plus the moment of computing them.
* ``"stale"`` (no stashing): the forward runs on the live weights without keeping a graph; the
  backward recomputes the stage from its stashed inputs with the weights live at that time
  (newer by ``lag`` updates), which is the inconsistent gradient PipeDream's stashing removes.

The predictor, for ``lag`` = s future updates with the optimizer's current state:

* SGD with momentum (PyTorch's v <- mu v + g, w <- w - lr v), default "spectrain" (Chen et al.
  2019, SpecTrain): w_hat = w - s lr v, which is exact when the velocity stays put (future
  gradients equal to (1 - mu) v). "msnag" (FTPipe): w_hat = w - lr mu (1 - mu^s) / (1 - mu) v,
  exact when future gradients are zero (the velocity decays).
* Adam and AdamW: Adam's current update direction m_hat / (sqrt(v_hat) + eps) applied s times
  with the bias corrections of the coming steps (and AdamW's decoupled decay before each), the
  XPipe / PipeOptim rule; exact when the moments stay put (future gradients equal to m with
  v = m^2). Adam's coupled L2 ``weight_decay`` is not modelled.
* Anything else raises :class:`PredictionError` naming what is known.

With a delay compensation (pipetrain/training/compensation.py) the predictor runs inside
``Compensator.adjusted()``, so it extrapolates with the learning rate (and momentum) the
compensated updates will use, and under spike compensation "msnag"
scales its decaying tail by mu^s as the compensated update does; the other rules are exact under
spike compensation in the same cases as without it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from pipetrain.training.compensation import (
    AUTO,
    Compensator,
    DelayCompensation,
    default_compensation,
)

POLICIES = ("stash", "predict", "stale")
METHODS = ("momentum", "spectrain", "msnag")  # "momentum": spectrain for SGD, Adam's rule


class PredictionError(ValueError):
    """The optimizer's future updates cannot be predicted from its state."""


def check_predictable(optimizer: torch.optim.Optimizer | None, method: str) -> None:
    """Raise PredictionError unless :func:`predict` knows ``optimizer`` under ``method``."""
    if method not in METHODS:
        raise PredictionError(f"weight_prediction must be one of {METHODS} or None, got {method!r}")
    if optimizer is None:
        return
    if isinstance(optimizer, torch.optim.SGD):
        if any(g["momentum"] == 0 for g in optimizer.param_groups):
            raise PredictionError(
                "weight prediction extrapolates SGD's momentum buffer, but momentum=0: pass "
                "SGD(..., momentum=0.9) or train with weight_prediction=None (stashing)"
            )
        return
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        if method == "msnag":
            raise PredictionError("'msnag' models SGD momentum; use 'momentum' for Adam/AdamW")
        return
    raise PredictionError(
        f"weight prediction knows SGD with momentum, Adam and AdamW, not "
        f"{type(optimizer).__name__}; use weight_prediction=None (weight stashing) with it"
    )


@torch.no_grad()
def predict(
    optimizer: torch.optim.Optimizer, params: Sequence[nn.Parameter], steps: int,
    method: str = "momentum", out: Sequence[torch.Tensor] | None = None,
    spike: bool = False,
) -> list[torch.Tensor]:
    """The values of ``params`` expected after ``steps`` more updates of ``optimizer`` with its
    groups' current settings (``spike``: spike-compensated for a delay of ``steps``),
    written into ``out`` (tensors shaped like ``params``) or new tensors; the parameters and the
    optimizer are left alone. A parameter without optimizer state yet (before its first
    update) is predicted to stay where it is."""
    check_predictable(optimizer, method)
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    targets = list(out) if out is not None else [torch.empty_like(p) for p in params]
    for p, w in zip(params, targets, strict=True):
        state, group = optimizer.state.get(p, {}), group_of.get(id(p))
        if steps == 0 or group is None or not state:
            w.copy_(p)
        elif isinstance(optimizer, torch.optim.SGD):
            _sgd(p, state, group, steps, method, w, spike)
        else:
            adamw = isinstance(optimizer, torch.optim.AdamW)
            _adam(p, state, group, steps, adamw, w)
    return targets


def _sgd(
    p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], steps: int, method: str,
    w: torch.Tensor, spike: bool,
) -> None:
    buf = state.get("momentum_buffer")
    if buf is None:
        w.copy_(p)
        return
    mu, lr = float(group["momentum"]), float(group["lr"])
    factor = float(steps) if method != "msnag" else mu * (1 - mu**steps) / (1 - mu)
    if method == "msnag" and spike:
        factor *= mu**steps
    sign = 1.0 if group.get("maximize", False) else -1.0
    torch.add(p.detach(), buf, alpha=sign * lr * factor, out=w)


def _adam(
    p: torch.Tensor, state: dict[str, Any], group: dict[str, Any], steps: int, adamw: bool,
    w: torch.Tensor,
) -> None:
    lr, (b1, b2), eps = float(group["lr"]), group["betas"], group["eps"]
    decoupled = adamw or group.get("decoupled_weight_decay", False)
    wd = float(group["weight_decay"]) if decoupled else 0.0
    m = state["exp_avg"]
    v = state["max_exp_avg_sq"] if group.get("amsgrad", False) else state["exp_avg_sq"]
    t = float(state["step"])
    sign = 1.0 if group.get("maximize", False) else -1.0
    w.copy_(p)
    root = v.sqrt()
    for k in range(1, steps + 1):
        bc1, bc2 = 1 - b1 ** (t + k), 1 - b2 ** (t + k)
        if wd:
            w.mul_(1 - lr * wd)
        w.addcdiv_(m, root / math.sqrt(bc2) + eps, value=sign * lr / bc1)


class WeightVersions:
    """The weight versions of one asynchronous stage (see the module docstring).

    ``forward_weights(key)`` gives the tensors micro-batch ``key``'s forward runs on (None: the
    live parameters, with a graph; "stale" mode at lag > 0 runs without one);
    ``backward_weights(key)`` the tensors its backward differentiates through;
    ``release(key)`` ends the micro-batch; ``stepped()`` counts an update. A ``compensator``
    (pipetrain/training/compensation.py) steers the prediction's learning rate and, for PipeMare's
    discrepancy correction, the weights a "stale" backward recomputes on. ``record=True`` keeps
    what tests compare: the lag each micro-batch saw and whether its forward and backward read
    bit-identical weights.
    """

    def __init__(
        self,
        params: Sequence[nn.Parameter],
        optimizer: torch.optim.Optimizer | None,
        lag: int,
        update_every: int,
        policy: str = "stash",
        method: str = "momentum",
        record: bool = False,
        compensator: Compensator | None = None,
    ):
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "predict":
            check_predictable(optimizer, method)
        self.params, self.optimizer = list(params), optimizer
        self.lag, self.update_every, self.policy, self.method = lag, update_every, policy, method
        self.compensator = compensator
        self.version = 0  # updates applied so far
        self._units: dict[int, tuple[int, list[torch.Tensor] | None, set[int]]] = {}
        self._read: dict[int, int] = {}  # key -> version its forward read
        self.record = record
        self.lags: dict[int, int] = {}  # key -> updates between its forward and backward
        self.identical: dict[int, bool] = {}  # key -> forward and backward saw equal weights
        self._seen: dict[int, list[torch.Tensor]] = {}
        self.peak_versions = 0  # most weight copies held at once
        self.peak_bytes = 0
        self._bytes = sum(p.numel() * p.element_size() for p in self.params)
        self._spare: list[list[torch.Tensor]] = []  # copies of finished units, to reuse

    @torch.no_grad()
    def _copy(self) -> list[torch.Tensor]:
        """The weights this unit's forward reads: the live ones stashed or predicted, written
        into the copy of a finished unit when one is free (an update per micro-batch would
        otherwise allocate and fault in a whole copy of the stage's weights each time)."""
        spare = self._spare.pop() if self._spare else None
        if self.policy == "predict" and self.optimizer is not None:
            comp = self.compensator
            with comp.adjusted() if comp else nullcontext():
                copies = predict(self.optimizer, self.params, self.lag, self.method, out=spare,
                                 spike=bool(comp and comp.spec.spike))
        elif spare is not None:
            copies = spare
            for c, p in zip(copies, self.params, strict=True):
                c.copy_(p)
        else:
            copies = [p.detach().clone() for p in self.params]
        return [c.requires_grad_() for c in copies]

    @property
    def recomputes(self) -> bool:
        """Whether the backward recomputes the forward with the live weights ("stale")."""
        return self.policy == "stale" and self.lag > 0

    def forward_weights(self, key: int) -> list[torch.Tensor] | None:
        unit = key // self.update_every
        if unit not in self._units:
            copies = None
            if self.lag > 0 and (
                self.policy == "stash" or self.policy == "predict" and self.optimizer is not None
            ):
                copies = self._copy()
            self._units[unit] = (self.version, copies, set())
            held = sum(c is not None for _, c, _ in self._units.values())
            self.peak_versions = max(self.peak_versions, held)
            self.peak_bytes = max(self.peak_bytes, held * self._bytes)
        version, copies, users = self._units[unit]
        users.add(key)
        self._read[key] = version
        if self.record:
            self._seen[key] = [t.detach().clone() for t in copies or self.params]
        return copies

    def backward_weights(self, key: int) -> list[torch.Tensor]:
        _, copies, _ = self._units[key // self.update_every]
        used = self.params if copies is None or self.recomputes else copies
        if self.recomputes and self.compensator is not None and self.compensator.corrects:
            used = self.compensator.backward_weights()
        if self.record:
            self.lags[key] = self.version - self._read[key]
            self.identical[key] = all(
                torch.equal(a, b) for a, b in zip(self._seen.pop(key), used, strict=True)
            )
        return list(used)

    def release(self, key: int) -> None:
        unit = key // self.update_every
        self._read.pop(key, None)
        _, _, users = self._units[unit]
        users.discard(key)
        if not users and (key + 1) % self.update_every == 0:
            _, copies, _ = self._units.pop(unit)  # the unit's last micro-batch is done
            if copies is not None:  # its backward has freed the graph that read them
                self._spare.append(copies)

    def stepped(self) -> None:
        self.version += 1


def stage_versions(
    params: Sequence[nn.Parameter], optimizer: torch.optim.Optimizer | None, lag: int,
    update_every: int, weight_stashing: bool, weight_prediction: str | None,
    compensation: DelayCompensation | str | None, schedule: str,
) -> WeightVersions:
    """The WeightVersions of a stage under Pipeline's asynchronous options (checked here).
    ``"auto"`` (the default of both options) predicts where the optimizer can be predicted
    and stashing is on, and then compensates as :func:`default_compensation` says."""
    if weight_prediction == AUTO:
        weight_prediction = "momentum" if weight_stashing and _predictable(optimizer) else None
    if compensation == AUTO:
        compensation = default_compensation(
            optimizer, schedule, predicted=bool(weight_prediction),
        ) if weight_stashing else None
    if weight_prediction is not None:
        check_predictable(optimizer, weight_prediction)
    policy = "predict" if weight_prediction else "stash" if weight_stashing else "stale"
    compensator = (
        Compensator(compensation, optimizer, params, lag)
        if isinstance(compensation, DelayCompensation) else None
    )
    return WeightVersions(
        params, optimizer, lag, update_every, policy, weight_prediction or "momentum",
        compensator=compensator,
    )


def _predictable(optimizer: torch.optim.Optimizer | None) -> bool:
    try:
        check_predictable(optimizer, "momentum")
    except PredictionError:
        return False
    return optimizer is not None
