"""An asynchronous schedule's update sequence in one thread, for studies of staleness.

PipeDream-style schedules give stage s a fixed lag D_s: update unit k's forward on stage s
reads the weights of version k - D_s (after that many updates), and its backward becomes the
stage's update k. :class:`DelayedPipeline` drives the runtime's own :class:`Stage` objects, with
their weight versions and delay compensation (pipetrain/training/weights.py, compensation.py), in
that order without threads or messages: tick t forwards on each stage s the units up to t + D_s
(inputs from the stage before, which is further ahead), then backpropagates unit t through every
stage and updates each. A unit is a micro-batch for "pipedream" (an update each) and a whole
mini-batch for "pipedream-2bw"; a synchronous schedule name gives lag 0 everywhere (plain
training, one update per unit). The weights are those of :class:`Pipeline` on the same data
(tests/benchmarks/test_delayed.py), at a fraction of the cost: what a sweep over learning rates,
seeds and methods needs (benchmarks/staleness_study.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import torch
from torch import nn

from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.runtime.assembly import split
from pipetrain.runtime.data_parallel import tied_parameters
from pipetrain.runtime.stage import (
    LossFn,
    OptimizerFactory,
    SchedulerFactory,
    Stage,
    StageOptions,
)
from pipetrain.training.compensation import AUTO, DelayCompensation, parse_option
from pipetrain.training.weights import stage_versions
from schedules import build, lookup

Unit = tuple[object, object]  # (input, target) of one update unit


class DelayedPipeline:
    """``model`` split by ``balance``, trained one unit per :meth:`train_step` with the lags of
    ``schedule`` and Pipeline's asynchronous options (``lr_scheduler``: stepped after each
    stage's update, as in Pipeline; ``clip_grad_norm``: each stage's update clipped by that
    stage's own gradient norm, as in Pipeline under an asynchronous schedule). ``lags`` replaces
    the schedule's lags, for studies of where staleness hurts (e.g. only the first stage late);
    the first stage's must be the largest, as in every pipeline."""

    def __init__(
        self,
        model: nn.Sequential | LayerTree,
        balance: list[int],
        *,
        schedule: str = "pipedream",
        loss_fn: LossFn,
        optimizer: OptimizerFactory,
        weight_stashing: bool = True,
        weight_prediction: str | None = AUTO,
        delay_compensation: str | DelayCompensation | None = AUTO,
        lr_scheduler: SchedulerFactory | None = None,
        clip_grad_norm: float | None = None,
        lags: Sequence[int] | None = None,
    ):
        model = layer_tree(model, "DelayedPipeline")
        if lags is None:
            lags = build(schedule, len(balance), len(balance)).lag or (0,) * len(balance)
        elif len(lags) != len(balance) or min(lags) < 0 or lags[0] != max(lags):
            raise ValueError(
                f"lags={list(lags)} for {len(balance)} stages: give one lag >= 0 per stage, the "
                "first stage's the largest (its forward runs furthest ahead)"
            )
        if lags[-1] and not weight_stashing:
            raise ValueError(
                f"lags={list(lags)}: without stashing a late stage recomputes its forward at the "
                "backward, which the last stage cannot (its loss comes from the forward): give "
                "it lag 0 or keep weight_stashing=True"
            )
        if not any(lags) and (weight_prediction not in (None, AUTO) or not weight_stashing
                              or delay_compensation not in (None, AUTO)):
            raise ValueError(
                f"schedule {schedule!r} has no lag: weight_stashing, weight_prediction and "
                "delay_compensation apply to 'pipedream' and 'pipedream-2bw'"
            )
        stale = not weight_stashing and weight_prediction in (None, AUTO)
        spec = lookup(schedule)
        if spec.asynchronous and not spec.update_per_microbatch and stale:  # "pipedream-2bw"
            raise ValueError(
                "without stashing a 2BW micro-batch's forward reads the weights live at its own "
                "forward, some before its unit's predecessor's update and some after; one unit "
                "per mini-batch cannot show that: study it with Pipeline"
            )
        if tied_parameters(model, balance):
            raise ValueError(
                "a weight is shared by layers on different stages; each stage would update it "
                "on its own: untie it (e.g. a head with its own weight) or keep its users on one "
                "stage"
            )
        compensation = parse_option(delay_compensation)
        parts = split(model, balance)
        self.stages = [
            Stage(
                module, s, len(parts), offset, torch.device("cpu"), optimizer, loss_fn,
                options=StageOptions(lr_scheduler=lr_scheduler, weight_versions=partial(
                    stage_versions, lag=lag, update_every=1, weight_stashing=weight_stashing,
                    weight_prediction=weight_prediction, compensation=compensation,
                    schedule=schedule,
                )),
            )
            for s, ((offset, module), lag) in enumerate(zip(parts, lags, strict=True))
        ]
        self.lags = list(lags)
        self.clip_grad_norm = clip_grad_norm
        self._units: dict[int, Unit] = {}  # fed, not yet backpropagated
        self._fed = 0
        self._done = 0  # units backpropagated (and updated)
        self._forwarded = [0] * len(self.stages)  # units forwarded, per stage
        self._acts: list[dict[int, tuple[torch.Tensor, ...]]] = [{} for _ in self.stages]
        self.losses: list[float] = []  # per unit, in order, as the last stage computed them

    @property
    def module(self) -> LayerTree:
        return LayerTree(kv for stage in self.stages for kv in stage.module.positions())

    def train_step(self, x: object, y: object) -> None:
        """Feed one unit; run every tick it makes possible."""
        self._units[self._fed] = (x, y)
        self._fed += 1
        while self._fed > self._done + self.lags[0]:
            self._tick(self._done)

    def flush(self) -> None:
        """Backpropagate every unit fed (as Pipeline.flush drains the pipeline)."""
        while self._done < self._fed:
            self._tick(self._done)

    def eval_step(self, x: object) -> object:
        """Forward on settled weights (flushes first), in eval mode, without gradients."""
        self.flush()
        value = x
        for stage in self.stages:
            mode = stage.module.training
            stage.module.eval()
            value = stage.forward(0, (), value, training=False)  # under no_grad
            stage.module.train(mode)
        return value

    @torch.enable_grad()  # training, even when flushed from a caller's torch.no_grad()
    def _tick(self, t: int) -> None:
        for s in range(len(self.stages)):
            while self._forwarded[s] <= t + self.lags[s] and self._forwarded[s] < self._fed:
                self._forward(s, self._forwarded[s])
                self._forwarded[s] += 1
        grads: list[torch.Tensor | None] = []
        for stage in reversed(self.stages):
            grads = stage.backward(t, grads)
        self._update(*self._units.pop(t))
        self._done += 1

    def _update(self, x: object, y: object) -> None:
        """Every stage's update after the backward of the unit ``(x, y)``; a study may change
        the gradients first (benchmarks/staleness_gpt.py)."""
        for stage in self.stages:
            if self.clip_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(stage.module.parameters(), self.clip_grad_norm)
            stage.step()

    def _forward(self, s: int, unit: int) -> None:
        stage = self.stages[s]
        x, y = self._units[unit]
        inputs = self._acts[s].pop(unit) if s else ()
        value: object = x if not s else inputs[0] if len(inputs) == 1 else inputs
        output = stage.forward(unit, inputs, value, y if stage.is_last else None)
        if stage.is_last:
            self.losses.append(float(stage.losses.pop(unit)))
            return
        tensors = output if isinstance(output, tuple) else (output,)
        self._acts[s + 1][unit] = tuple(
            t.detach().requires_grad_(t.requires_grad) for t in tensors
        )
