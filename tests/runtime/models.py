"""Small models for the runtime tests, built identically in every process from a seed."""

from __future__ import annotations

import torch
from torch import nn

from examples.models import CausalSelfAttention, Embedding, Head, gpt


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


def reference(
    model: nn.Sequential, data, optimizer=sgd, loss_fn=nn.functional.cross_entropy
) -> tuple[dict, list[float]]:
    """Plain single-process training: the state_dict after the steps, and each step's loss."""
    opt = optimizer(model.parameters())
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
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


# -- layers whose outputs share a path, and weights shared by stages (zero bubble's pitfalls) --


class Branch(nn.Module):
    """A layer with weights returning a tensor and a function of it, ``(tanh(h), h)`` with
    ``h = Linear(x)``: the shape of a residual branch that crosses a layer boundary."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.linear(x)
        return torch.tanh(h), h


class Merge(nn.Module):
    """Adds the members of a pair back into one tensor."""

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return pair[0] + pair[1]


class Keep(nn.Module):
    """A layer with weights that returns its input too: ``(x, Linear(x))``."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, self.linear(x)


class Halves(nn.Module):
    """A layer with weights whose outputs are views: ``Linear(x)`` cut in two halves."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, 2 * width)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x).chunk(2, dim=-1)


def branchy(width: int = 12, classes: int = 5, seed: int = 0) -> nn.Sequential:
    """10 layers whose outputs share paths: a tensor and its tanh, a layer passing its input
    on, a ReLU modifying a layer's output in place, and outputs that are views."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, width), Branch(width), Merge(), Keep(width), Merge(),
        nn.Linear(width, width), nn.ReLU(inplace=True), Halves(width), Merge(),
        nn.Linear(width, classes),
    )


class SharedAffine(nn.Module):
    """``x * scale + bias`` with a scale and a bias that other layers may share."""

    def __init__(self, scale: nn.Parameter, bias: nn.Parameter):
        super().__init__()
        self.scale, self.bias = scale, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.bias


def shared_affine(stages: int, width: int = 12, classes: int = 5, seed: int = 0) -> nn.Sequential:
    """``stages`` pairs [Linear, SharedAffine], every SharedAffine with the same scale and bias,
    then a Linear to ``classes``: balance [2, ..., 2, 3] puts one SharedAffine on each stage."""
    torch.manual_seed(seed)
    scale, bias = nn.Parameter(1 + 0.1 * torch.randn(width)), nn.Parameter(torch.randn(width))
    layers: list[nn.Module] = []
    for _ in range(stages):
        layers += [nn.Linear(width, width), SharedAffine(scale, bias)]
    return nn.Sequential(*layers, nn.Linear(width, classes))


class Attending(nn.Module):
    """A pre-norm transformer block's first half: ``r = x + attention(norm1(x))``, returned
    with ``norm2(r)``, its MLP's input. The residual stream and a function of it cross the
    boundary to :class:`Mixing`."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, heads)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = x + self.attention(self.norm1(x))
        return r, self.norm2(r)


class Mixing(nn.Module):
    """The block's second half: ``r + mlp(norm2(r))``."""

    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        r, normed = pair
        return r + self.mlp(normed)


def residual_gpt(vocab: int = 32, dim: int = 16, blocks: int = 3, heads: int = 2,
                 context: int = 8, seed: int = 0) -> nn.Sequential:
    """The example GPT with each block cut in two layers (:class:`Attending`,
    :class:`Mixing`) so that its residual stream crosses layer (and stage) boundaries: 8
    layers with 3 blocks, the head tied to the embedding. Reads :func:`text_batches`."""
    torch.manual_seed(seed)
    embedding = Embedding(vocab, dim, context)
    layers: list[nn.Module] = [embedding]
    for _ in range(blocks):
        layers += [Attending(dim, heads), Mixing(dim)]
    layers.append(Head(embedding))
    return nn.Sequential(*layers)
