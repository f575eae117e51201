"""How many forwards a recomputing stage runs per micro-batch: what the planner's cost model
counts (partitioner/costs.py ``Problem.rebuilds``). A whole backward rebuilds the forward once;
a split one (B, then W) rebuilds it in B and again in W, except in the first stage, whose B
has no input gradient to find."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

import pipetrain


class Counted(nn.Module):
    """A block (its weights inside a child) that counts its forwards."""

    def __init__(self, calls: Counter[int], index: int) -> None:
        super().__init__()
        self.calls, self.index = calls, index
        self.inner = nn.Sequential(nn.Linear(4, 4), nn.Tanh())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls[self.index] += 1
        return self.inner(x)


@pytest.mark.parametrize(("schedule", "per_stage"), [("1f1b", (2, 2)), ("zb-h1", (2, 3))])
def test_forwards_per_microbatch_under_recomputation(schedule: str, per_stage: tuple[int, ...]
                                                     ) -> None:
    calls: Counter[int] = Counter()
    pipe = pipetrain.Pipeline(
        nn.Sequential(*[Counted(calls, k) for k in range(4)]), [2, 2], chunks=4,
        schedule=schedule, recompute="always", loss_fn=lambda o, y: (o - y).pow(2).mean(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), devices=["cpu", "cpu"],
    )
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe.train_step(x, y)
    calls.clear()
    pipe.train_step(x, y)
    assert [calls[k] / 4 for k in range(4)] == [per_stage[0]] * 2 + [per_stage[1]] * 2
