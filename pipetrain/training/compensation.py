"""Delay compensation for asynchronous stages: change what the optimizer does with a late gradient.

Stage s of an asynchronous schedule applies each gradient ``D = lag[s]`` updates after the
forward that produced it. Weight stashing and prediction (pipetrain/training/weights.py) choose the
weights the gradient is computed on; the remedies here change the update itself. They combine
with "+" (``"spike+lag-lr"``) and with ``weight_prediction``:

* ``"spike"``, spike compensation (Kosson et al., "Pipelined backpropagation at scale", 2020).
  With momentum mu an undelayed gradient g moves the weights by lr (1 + mu + mu^2 + ...) g over
  the following updates; a gradient D updates late has missed the first D terms. The update
  ``w -= lr (mu^D v + (1 - mu^D) / (1 - mu) g)`` (v the velocity, g included) applies the missed
  part at once (the spike) and scales the velocity's tail by mu^D, so from the gradient's arrival
  on the weights follow the undelayed impulse response exactly. Adam(W) gets the same rule on its
  first moment (beta1 in place of mu, the current denominator). Under spike compensation an
  update with a constant velocity (or constant Adam moments) equals the plain one, so the
  "momentum"/"spectrain" and Adam predictors stay exact in the same cases.
* ``"lag-lr"``: the stage's learning rate divided by 1 + D (a baseline: a smaller step where the
  gradient is older).
* ``"lag-momentum"``: the stage's momentum lengthened to average over k = 1 + 2D times as many
  updates, mu' = 1 - (1 - mu) / k, and SGD's learning rate divided by k, so that the long-run
  step of a steady gradient, lr / (1 - mu), is unchanged (Adam's beta1 likewise, its lr kept:
  Adam's step is an average, not a sum). Each update is k times smaller and the velocity turns
  k times more slowly, so a gradient D updates old disturbs it less and the constant-velocity
  prediction ("momentum") is closer to the truth. On a quadratic (SGD, mu = 0.9, prediction)
  the largest stable lr times curvature of a lag-3 stage grows from 0.074 to 0.21 (0.33 with
  spike compensation; synchronous: 3.8); docs/staleness.md has the study that chose k.
* ``"pipemare"`` (Yang et al., "PipeMare", 2021). T1, learning-rate rescheduling: over the first
  ``warmup`` updates the stage's rate is lr / D^(1 - k / warmup) at update k, then lr. T2,
  discrepancy correction, where the backward recomputes on the live weights
  (``weight_stashing=False``): it runs on ``w - D delta`` instead, delta a bias-corrected moving
  average (decay 0.1^(1/D)) of the per-update change of the weights: an estimate of the weights
  the forward read, without stashing them. With stashing or prediction the forward and backward
  already read one version, and only T1 applies.
* ``"error-feedback"``, the error-feedback delay correction for a one-step delay (after Zmushko,
  Petrov, Abdullaev, Khrushchev and Horvath, "One-Step Gradient Delay is Not a Barrier for
  Large-Scale Asynchronous Pipeline Parallel LLM Pretraining", ICML 2026, who correct
  PipeDream-2BW this way for any optimizer). The paper's own equations were not available to
  us (only its abstract and summaries: "an optimizer-agnostic, Error Feedback-inspired
  correction" that "mixes recent delayed updates"); this is our reading, labelled as such in
  docs/staleness.md. With a delay the optimizer's update at step t, u_t (whatever the
  optimizer: AdamW, Muon, ...; weight decay included), comes from a gradient D updates old and
  stands in for the update the current weights would get; the error it commits is estimated by
  how much the update itself has moved, u_t - u_{t-1}, and fed back, D times over (once for
  2BW's one-step delay): ``w += u_t + D beta (u_t - u_{t-1})`` with ``beta``
  (:data:`ERROR_FEEDBACK`, 1: the whole error fed back) -- a linear extrapolation of the update
  sequence over the delay. The first update has no predecessor and is applied as it is. It
  keeps one more copy of the stage's weights (the last update).

The learning-rate rules set each parameter group's ``lr`` (and momentum) for the length of
one ``optimizer.step()`` (and of a prediction, :meth:`Compensator.adjusted`) and restore them,
so a user's LR scheduler keeps working. At lag 0 every
remedy is the identity.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from schedules import lookup

METHODS = ("spike", "lag-lr", "lag-momentum", "pipemare", "error-feedback")
AUTO = "auto"  # the default of weight_prediction and delay_compensation: the study's pick
LR_RULES = {"lag-lr": "lag", "lag-momentum": "momentum", "pipemare": "pipemare"}
PIPEMARE_WARMUP = 400  # updates over which PipeMare's per-stage rate anneals to the user's
DISCREPANCY_MEMORY = 0.1  # weight left on a change D updates old in PipeMare's moving average
ERROR_FEEDBACK = 1.0  # beta: the share of the estimated delay error fed back per update


class CompensationError(ValueError):
    """A delay compensation that is unknown, or that the optimizer cannot take."""


@dataclass(frozen=True)
class DelayCompensation:
    """Which remedies a stage applies: spike compensation, a learning-rate rule ("lag",
    "momentum", "pipemare" or None), PipeMare's discrepancy correction, PipeMare's warm-up
    length, and the error-feedback correction's beta (0: none)."""

    spike: bool = False
    lr_rule: str | None = None
    discrepancy: bool = False
    warmup: int = PIPEMARE_WARMUP
    error_feedback: float = 0.0

    @classmethod
    def parse(cls, spec: str | DelayCompensation) -> DelayCompensation:
        """``"spike"``, ``"lag-lr"``, ``"lag-momentum"``, ``"pipemare"``, ``"error-feedback"``
        or several joined by "+" (at most one of "lag-lr", "lag-momentum" and "pipemare": each
        is a rule for the learning rate)."""
        if isinstance(spec, DelayCompensation):
            return spec
        if not isinstance(spec, str) or not spec:
            raise CompensationError(
                f"delay_compensation must be one of {METHODS} (or several joined by '+'), "
                f"a DelayCompensation or None; got {spec!r}"
            )
        names = spec.split("+")
        unknown = [n for n in names if n not in METHODS]
        if unknown or len(set(names)) != len(names):
            raise CompensationError(
                f"delay_compensation {spec!r}: each part must be one of {METHODS}, once"
            )
        rules = [n for n in names if n in LR_RULES]
        if len(rules) > 1:
            raise CompensationError(
                f"delay_compensation: {' and '.join(map(repr, rules))} are rules for the same "
                "learning rate; pick one"
            )
        rule = LR_RULES[rules[0]] if rules else None
        return cls(spike="spike" in names, lr_rule=rule, discrepancy="pipemare" in names,
                   error_feedback=ERROR_FEEDBACK if "error-feedback" in names else 0.0)


def parse_option(spec: str | DelayCompensation | None) -> DelayCompensation | str | None:
    """``delay_compensation=`` as given to Pipeline: None, "auto" (resolved per stage once its
    optimizer exists, pipetrain/training/weights.py) or a compensation, parsed here."""
    return spec if spec is None or spec == AUTO else DelayCompensation.parse(spec)


def check_compensable(optimizer: torch.optim.Optimizer | None, spec: DelayCompensation) -> None:
    """Raise CompensationError unless :class:`Compensator` can apply ``spec`` to ``optimizer``."""
    if spec.error_feedback < 0:
        raise CompensationError(f"error_feedback must be at least 0, got {spec.error_feedback}")
    if optimizer is None:
        return
    if spec.lr_rule and any("lr" not in g for g in optimizer.param_groups):
        raise CompensationError(
            f"{type(optimizer).__name__} has no 'lr' in its parameter groups for the "
            f"{spec.lr_rule!r} learning-rate rule to scale; drop that rule"
        )
    if spec.lr_rule == "momentum" and not all(
        g.get("momentum") or "betas" in g for g in optimizer.param_groups
    ):
        raise CompensationError(
            "'lag-momentum' lengthens the optimizer's momentum, and this one has none: pass "
            "SGD(..., momentum=0.9), Adam or AdamW, or use 'lag-lr'"
        )
    if not spec.spike:
        return
    name = type(optimizer).__name__
    if isinstance(optimizer, torch.optim.SGD):
        for g in optimizer.param_groups:
            if g["momentum"] == 0 or g["nesterov"] or g["dampening"] or g.get("maximize"):
                raise CompensationError(
                    "spike compensation models SGD's heavy-ball momentum: pass SGD(..., "
                    "momentum=0.9) without nesterov, dampening or maximize, or drop 'spike'"
                )
        return
    if isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW):
        if any(g.get("maximize") for g in optimizer.param_groups):
            raise CompensationError("spike compensation does not model maximize=True; drop it")
        return
    raise CompensationError(
        f"spike compensation knows SGD with momentum, Adam and AdamW, not {name}; drop "
        "'spike' from delay_compensation (the learning-rate rules work with any optimizer)"
    )


def default_compensation(
    optimizer: torch.optim.Optimizer | None, schedule: str, predicted: bool = True,
) -> DelayCompensation | None:
    """What ``delay_compensation="auto"`` (the default) applies, chosen by the staleness
    studies (docs/staleness.md). Under "pipedream-2bw" (lag 1, an update per mini-batch) with
    Muon (``torch.optim.Muon``, or pipetrain.optim.MuonAdamW: a group marked "muon") on stashed
    weights, "error-feedback" (issue 49.2: on the GPT it cut Muon's 2BW gap to 1F1B from 13.4 %
    to 9.2 %). With prediction (``predicted``), for SGD with heavy-ball momentum:
    "spike+lag-momentum" under "pipedream" (an update per micro-batch, lags up to stages - 1)
    and "spike" under "pipedream-2bw". Nothing for Adam(W), for which no remedy beat prediction
    alone on the language model over a long run, nor for other optimizers."""
    per_microbatch = lookup(schedule).update_per_microbatch  # "pipedream"
    if not per_microbatch and _muon(optimizer):
        return DelayCompensation(error_feedback=ERROR_FEEDBACK)
    if not predicted:
        return None
    if not isinstance(optimizer, torch.optim.SGD):
        return None
    try:
        check_compensable(optimizer, DelayCompensation(spike=True))
    except CompensationError:  # nesterov, dampening or maximize: no spike
        return DelayCompensation(lr_rule="momentum") if per_microbatch else None
    return DelayCompensation(spike=True, lr_rule="momentum" if per_microbatch else None)


def _muon(optimizer: torch.optim.Optimizer | None) -> bool:
    """Whether ``optimizer`` steps some weights with Muon."""
    muon = getattr(torch.optim, "Muon", None)
    return optimizer is not None and (
        (muon is not None and isinstance(optimizer, muon))
        or any(g.get("muon") for g in optimizer.param_groups)
    )


class Compensator:
    """Applies a :class:`DelayCompensation` to one stage's updates at lag ``lag``."""

    def __init__(
        self, spec: DelayCompensation, optimizer: torch.optim.Optimizer | None,
        params: Sequence[nn.Parameter], lag: int,
    ):
        check_compensable(optimizer, spec)
        self.spec, self.optimizer, self.params, self.lag = spec, optimizer, list(params), lag
        self.updates = 0  # optimizer steps taken through this compensator
        self.decay = DISCREPANCY_MEMORY ** (1.0 / lag) if lag else 0.0
        self._delta: list[torch.Tensor] | None = None  # PipeMare's moving average, not debiased
        self._last: list[torch.Tensor] | None = None  # error feedback: the last update, u_{t-1}
        mine = {id(p) for p in self.params}
        self._by_group = [  # (group, this stage's parameters in it)
            (g, [p for p in g["params"] if id(p) in mine])
            for g in (optimizer.param_groups if optimizer is not None else [])
        ]

    @property
    def lr_scale(self) -> float:
        """The factor on every group's lr at the next update."""
        if self.lag == 0 or self.spec.lr_rule is None:
            return 1.0
        if self.spec.lr_rule == "lag":
            return 1.0 / (1 + self.lag)
        if self.spec.lr_rule == "momentum":
            return 1.0 / self.stretch if isinstance(self.optimizer, torch.optim.SGD) else 1.0
        done = min(self.updates / max(self.spec.warmup, 1), 1.0)
        return float(float(self.lag) ** -(1.0 - done))

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the updates taken (PipeMare's warm-up), PipeMare's
        moving average of the weights' change and error feedback's last update."""
        return {"updates": self.updates, "delta": self._delta, "last_update": self._last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state``; a moving average or last update whose shapes do not fit this
        stage's parameters (the model was split otherwise) starts afresh."""
        self.updates = int(state["updates"])
        self._delta, self._last = self._fitting(state.get("delta")), self._fitting(
            state.get("last_update"))

    def _fitting(self, tensors: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """``tensors`` on this stage's devices if they are shaped like its parameters."""
        if tensors is None or [t.shape for t in tensors] != [p.shape for p in self.params]:
            return None
        return [t.to(p.device) for t, p in zip(tensors, self.params, strict=True)]

    @property
    def stretch(self) -> int:
        """k of "lag-momentum": how many times longer the momentum averages, 1 + 2 lag."""
        return 1 + 2 * self.lag

    @property
    def corrects(self) -> bool:
        """Whether backward weights get PipeMare's discrepancy correction."""
        return self.spec.discrepancy and self.lag > 0

    @contextmanager
    def adjusted(self) -> Iterator[None]:
        """The optimizer's groups hold this stage's learning rate (and, under "lag-momentum",
        its momentum or Adam's beta1) inside the block, the user's values after it."""
        groups = self.optimizer.param_groups if self.optimizer is not None else []
        saved: list[dict[str, object]] = [
            {k: g[k] for k in ("lr", "momentum", "betas") if k in g} for g in groups
        ]
        scale, stretch = self.lr_scale, self.stretch
        try:
            for g in groups:
                if scale != 1.0:
                    g["lr"] = g["lr"] * scale
                if self.spec.lr_rule != "momentum" or not self.lag:
                    continue
                if "betas" in g:
                    g["betas"] = (1 - (1 - g["betas"][0]) / stretch, g["betas"][1])
                else:
                    g["momentum"] = 1 - (1 - g["momentum"]) / stretch
            yield
        finally:
            for g, values in zip(groups, saved, strict=True):
                g.update(values)

    @torch.no_grad()
    def step(self) -> None:
        """One ``optimizer.step()`` with the compensation applied."""
        optimizer = self.optimizer
        if optimizer is None:
            return
        feedback = bool(self.spec.error_feedback and self.lag)
        keep = self.corrects or feedback
        before = [p.detach().clone() for p in self.params] if keep else None
        with self.adjusted():
            spike = self._prepare_spike() if self.spec.spike and self.lag else None
            optimizer.step()
            if spike is not None:
                self._apply_spike(spike)
        if before is not None and self.corrects:
            self._track(before)
        if before is not None and feedback:
            self._feed_back(before)
        self.updates += 1

    def _feed_back(self, before: list[torch.Tensor]) -> None:
        """Error feedback: the step just moved the weights by u_t; add ``lag beta (u_t -
        u_{t-1})`` and keep u_t (the optimizer's own update, not the corrected one)."""
        update = torch._foreach_sub([p.detach() for p in self.params], before)
        if self._last is not None:
            error = torch._foreach_sub(update, self._last)
            weights: list[torch.Tensor] = list(self.params)
            torch._foreach_add_(weights, error, alpha=self.lag * self.spec.error_feedback)
        self._last = list(update)

    def _prepare_spike(
        self,
    ) -> list[tuple[dict[str, Any], float, list[nn.Parameter], list[torch.Tensor]]]:
        """Before the step, per parameter group: its lr, this stage's parameters in it that
        have a gradient, and the gradient that enters the momentum (weight decay included).
        For SGD it also scales the group's lr by mu^D, so that the step itself moves the
        weights by lr mu^D v and :meth:`_apply_spike` adds only the gradient's part: an update
        per micro-batch makes every pass over the weights count."""
        sgd = isinstance(self.optimizer, torch.optim.SGD)
        terms = []
        for group, members in self._by_group:
            params = [p for p in members if p.grad is not None]
            if not params:
                continue
            grads = [p.grad.detach() for p in params if p.grad is not None]
            decoupled = isinstance(self.optimizer, torch.optim.AdamW) or group.get(
                "decoupled_weight_decay", False)
            if group["weight_decay"] and (sgd or not decoupled):
                grads = list(torch._foreach_add(grads, [p.detach() for p in params],
                                                alpha=group["weight_decay"]))
            terms.append((group, float(group["lr"]), params, grads))
            if sgd:
                group["lr"] = group["lr"] * group["momentum"] ** self.lag
        return terms

    def _apply_spike(
        self, terms: list[tuple[dict[str, Any], float, list[nn.Parameter], list[torch.Tensor]]]
    ) -> None:
        """After the step, complete ``w -= lr (mu^D v + b g)``, b = (1 - mu^D) / (1 - mu), for
        SGD; for Adam turn ``w -= lr m_hat / d`` into ``w -= lr (m + (1 - beta1^D)(g - m)) /
        ((1 - beta1^t) d)``, the same rule on its first moment."""
        assert self.optimizer is not None
        state = self.optimizer.state
        for group, lr, params, grads in terms:
            if isinstance(self.optimizer, torch.optim.SGD):
                mu = group["momentum"]
                weights: list[torch.Tensor] = list(params)
                torch._foreach_add_(weights, grads, alpha=-lr * (1 - mu**self.lag) / (1 - mu))
                continue
            b1, b2 = group["betas"]
            a = b1**self.lag
            for p, g in zip(params, grads, strict=True):
                t = float(state[p]["step"])
                v = state[p]["max_exp_avg_sq" if group.get("amsgrad", False) else "exp_avg_sq"]
                denom = v.sqrt() / (1 - b2**t) ** 0.5 + group["eps"]
                change = (g - state[p]["exp_avg"]).mul_(1 - a)
                p.addcdiv_(change, denom, value=-lr / (1 - b1**t))

    def _track(self, before: list[torch.Tensor]) -> None:
        """PipeMare's moving average of the weights' change per update."""
        if self._delta is None:
            self._delta = [torch.zeros_like(p) for p in self.params]
        for d, p, old in zip(self._delta, self.params, before, strict=True):
            d.mul_(self.decay).add_(p.detach() - old, alpha=1 - self.decay)

    @torch.no_grad()
    def backward_weights(self) -> list[torch.Tensor]:
        """PipeMare T2: the live weights moved back by ``lag`` average updates, as leaves that
        take gradients (the live weights themselves before the first update)."""
        if self._delta is None:
            return list(self.params)
        debias = 1 - self.decay**self.updates
        return [
            p.detach().add(d, alpha=-self.lag / debias).requires_grad_()
            for p, d in zip(self.params, self._delta, strict=True)
        ]
