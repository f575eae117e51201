"""Small models for the runtime tests, built identically in every process from a seed."""

from __future__ import annotations

import torch
from torch import nn

from examples.models import gpt


class Fork(nn.Module):
    """Emits a tuple: a float tensor, a detached copy (no gradient) and integer labels."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x, x.detach() * 0.5, (x.sum(dim=-1) > 0).long()


class Join(nn.Module):
    """Takes Fork's tuple back to one tensor, using every member."""

    def forward(self, parts: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, half, sign = parts
        return x + half + sign.unsqueeze(-1).to(x.dtype)


def mlp(width: int = 12, blocks: int = 3, classes: int = 5, seed: int = 0) -> nn.Sequential:
    """Linear+LayerNorm+ReLU blocks with a tuple crossing the middle (10+ layers)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    layers += [Fork(), Join()]
    for _ in range(blocks - 1):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class MeanOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def sequence_model(width: int = 12, classes: int = 5, seed: int = 0) -> nn.Sequential:
    """For inputs (batch, time, width) whose time length changes from mini-batch to mini-batch."""
    body = mlp(width, blocks=2, classes=classes, seed=seed)
    return nn.Sequential(*body[:-1], MeanOverTime(), body[-1])


def sequence_batches(lengths, batch: int = 8, width: int = 12, classes: int = 5, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [
        (
            torch.randn(batch, t, width, generator=g),
            torch.randint(0, classes, (batch,), generator=g),
        )
        for t in lengths
    ]


def batches(steps: int, batch: int = 24, width: int = 12, classes: int = 5, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, width, generator=g), torch.randint(0, classes, (batch,), generator=g))
        for _ in range(steps)
    ]


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(model: nn.Sequential, data, optimizer=sgd) -> tuple[dict, list[float]]:
    """Plain single-process training: the state_dict after the steps, and each step's loss."""
    opt = optimizer(model.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.state_dict(), losses


class MeanTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def tied_model(vocab: int = 10, width: int = 12, seed: int = 0) -> nn.Sequential:
    """Token embedding whose weight is also the output head's (as in language models)."""
    torch.manual_seed(seed)
    embedding = nn.Embedding(vocab, width)
    head = nn.Linear(width, vocab, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(
        embedding, MeanTokens(), nn.Linear(width, width), nn.LayerNorm(width), nn.ReLU(), head
    )


def token_batches(steps: int, batch: int = 24, length: int = 5, vocab: int = 10, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, vocab, (batch, length), generator=g),
         torch.randint(0, vocab, (batch,), generator=g))
        for _ in range(steps)
    ]


def tiny_gpt(dropout: float = 0.0, seed: int = 0) -> nn.Sequential:
    """The example GPT (embedding, causal attention, head tied to the embedding), test-sized:
    5 layers [Embedding, Block, Block, Block, Head]."""
    return gpt(vocab=32, dim=16, blocks=3, heads=2, context=8, dropout=dropout, seed=seed)


def text_batches(steps: int, batch: int = 8, length: int = 8, vocab: int = 32, seed: int = 4):
    """(ids, next ids) pairs cut from one random token stream, as a language model reads text."""
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, vocab, (steps, batch, length + 1), generator=g)
    return [(s[:, :-1], s[:, 1:]) for s in stream]


class _Amplify(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.factor, None


class GradientAmplifier(nn.Module):
    """Identity forward; multiplies the gradient flowing back by ``factor`` (1 unless a test
    raises it), so that an fp16 gradient overflows on this stage alone, on the step chosen."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Amplify.apply(x, self.factor)


def amplified_mlp() -> tuple[nn.Sequential, GradientAmplifier]:
    """:func:`mlp` with a :class:`GradientAmplifier` after its first Linear (13 layers)."""
    body = mlp()
    amplifier = GradientAmplifier()
    return nn.Sequential(body[0], amplifier, *body[1:]), amplifier
