"""A learnable synthetic task shared by the examples: points labelled by a fixed random teacher."""

from __future__ import annotations

import torch
from torch import nn


def classifier(width: int = 256, depth: int = 8, classes: int = 10) -> nn.Sequential:
    """An MLP of ``depth`` Linear+LayerNorm+ReLU blocks and a head: 3*depth+1 layers."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


def teacher_batches(steps: int, batch: int, width: int, classes: int = 10, seed: int = 0):
    """``steps`` mini-batches (x, y) where y is the argmax of a fixed random linear teacher;
    ``seed`` picks the points, never the teacher, so every seed poses the same task."""
    teacher = torch.randn(width, classes, generator=torch.Generator().manual_seed(1234))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(batch, width, generator=g)
        yield x, (x @ teacher).argmax(dim=1)
