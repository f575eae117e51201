"""Example models for profiling, planning and pipelined training, each an nn.Sequential.

    pipetrain profile examples.models:resnet_like --input-shape 64,3,32,32 -o profile.json
    pipetrain profile examples.models:gpt --input-shape 16,64 \
        --input-dtype int64 --input-high 256 -o profile.json

Both build deterministically from ``seed``, so every process of a pipeline builds the same
weights (``gpt`` by pipetrain's per-layer rule, which a meta-device build shares). Their
layers are deliberately uneven, which is what a planner is for: ``resnet_like`` spends most
of its time in its first, full-resolution layers and ends in a run of cheap layers, so
splitting it by layer count puts nearly all the work on the first stage;
``gpt`` is a small GPT-2-shaped language model whose head shares the embedding's weight.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn

import pipetrain
from pipetrain.training.lazy import is_meta


def _norm(kind: str, channels: int) -> nn.Module:
    """GroupNorm (the default) normalises each sample on its own, so a pipeline's micro-batches
    train exactly like the whole batch; BatchNorm's statistics would be per micro-batch."""
    if kind == "group":
        groups = max(g for g in range(1, 9) if channels % g == 0)
        return nn.GroupNorm(groups, channels)
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"norm must be 'group', 'batch' or 'none', got {kind!r}")


class ResidualBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection; ``stride`` 2 halves the resolution (and a
    1x1 convolution matches the skip's shape)."""

    def __init__(self, channels_in: int, channels_out: int, stride: int = 1, norm: str = "group"):
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.norm1 = _norm(norm, channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.norm2 = _norm(norm, channels_out)
        self.skip: nn.Module = nn.Identity()
        if stride != 1 or channels_in != channels_out:
            self.skip = nn.Conv2d(channels_in, channels_out, 1, stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        return torch.relu(y + self.skip(x))


def resnet_like(
    width: int = 16,
    full_res_blocks: int = 2,
    classes: int = 10,
    in_channels: int = 3,
    norm: str = "group",
    seed: int = 0,
) -> nn.Sequential:
    """A small CNN for 32x32 images, 16 layers: a stem (conv, norm, ReLU) and
    ``full_res_blocks`` residual blocks at full resolution (about half of the compute), two
    downsampling blocks whose width grows more slowly than their resolution shrinks (so each
    costs less) and one more block, then pooling and a small MLP head (many cheap layers).
    A split by layer count puts every convolution on the first of two stages; the cut after the
    full-resolution blocks halves the work. About 160-200 ms forward+backward for a 64x3x32x32
    batch on one core of the 2-core development machine.
    """
    torch.manual_seed(seed)
    mid, top = width + width // 2, 2 * width
    layers: list[nn.Module] = [
        nn.Conv2d(in_channels, width, 3, 1, 1, bias=False),
        _norm(norm, width),
        nn.ReLU(),
    ]
    layers += [ResidualBlock(width, width, norm=norm) for _ in range(full_res_blocks)]
    layers += [
        ResidualBlock(width, mid, stride=2, norm=norm),
        ResidualBlock(mid, top, stride=2, norm=norm),
        ResidualBlock(top, top, norm=norm),
    ]
    layers += [
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(top, 4 * top),
        nn.ReLU(),
        nn.Dropout(0.0),
        nn.Linear(4 * top, top),
        nn.ReLU(),
        nn.Linear(top, classes),
    ]
    return nn.Sequential(*layers)


class Embedding(nn.Module):
    """Token and learned position embeddings: (batch, time) int ids -> (batch, time, dim)."""

    def __init__(self, vocab: int, dim: int, context: int, dropout: float = 0.0):
        super().__init__()
        self.tokens = nn.Embedding(vocab, dim)
        self.positions = nn.Parameter(torch.zeros(context, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > len(self.positions):
            raise ValueError(
                f"sequence of {ids.shape[1]} tokens is longer than the context of "
                f"{len(self.positions)}; cut it or build the model with a longer context"
            )
        return self.dropout(self.tokens(ids) + self.positions[: ids.shape[1]])

    def reset_parameters(self) -> None:
        """GPT-2's start, N(0, 0.02), for the token and the position tables (also what
        pipetrain's per-layer rule calls on a model built on the meta device)."""
        nn.init.normal_(self.tokens.weight, std=0.02)
        nn.init.normal_(self.positions, std=0.02)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which each position sees only itself and earlier ones."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        if dim % heads:
            raise ValueError(f"width {dim} is not a multiple of heads={heads}")
        self.heads, self.dropout = heads, dropout
        self.qkv = nn.Linear(dim, 3 * dim)
        self.project = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, dim = x.shape
        q, k, v = (
            t.view(batch, time, self.heads, dim // self.heads).transpose(1, 2)
            for t in self.qkv(x).split(dim, dim=2)
        )
        y = nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.project(y.transpose(1, 2).reshape(batch, time, dim))


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention and an MLP, each a residual branch
    that ends in dropout."""

    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attention = CausalSelfAttention(dim, heads, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norm1(x)))
        return x + self.dropout(self.mlp(self.norm2(x)))

    def reset_parameters(self) -> None:
        """GPT-2's start: every projection N(0, 0.02) with zero biases (the norms keep their
        own reset, which runs first)."""
        _gpt2_linears(self)


class Head(nn.Module):
    """Final norm and the projection to the vocabulary, whose weight is the token embedding's
    when ``tied`` (as in GPT-2): (batch, time, dim) -> (batch, time, vocab) logits."""

    def __init__(self, embedding: Embedding, tied: bool = True):
        super().__init__()
        vocab, dim = embedding.tokens.weight.shape
        self.norm = nn.LayerNorm(dim)
        self.project = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.project.weight = embedding.tokens.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(self.norm(x))

    def reset_parameters(self) -> None:
        """N(0, 0.02) for the projection; tied, it keeps the embedding's value (the first
        layer holding a shared weight initializes it)."""
        _gpt2_linears(self)


def _gpt2_linears(module: nn.Module) -> None:
    for part in module.modules():
        if isinstance(part, nn.Linear):
            nn.init.normal_(part.weight, std=0.02)
            if part.bias is not None:
                nn.init.zeros_(part.bias)


def gpt(
    vocab: int = 256,
    dim: int = 128,
    blocks: int = 4,
    heads: int = 4,
    context: int = 128,
    dropout: float = 0.0,
    seed: int = 0,
    tied: bool = True,
    device: str | torch.device | None = None,
) -> nn.Sequential:
    """A decoder-only language model (GPT-2's shape): token + position embedding, ``blocks``
    pre-norm causal self-attention blocks, and a head tied to the token embedding, so a split
    puts one weight on the first and the last stage (``tied=False``: a head of its own, for the
    asynchronous schedules, which do not take tied weights). Input: token ids (batch, time <=
    context), int64; output: logits (batch, time, vocab); train with :func:`lm_loss`. The
    default vocabulary of 256 reads text as bytes. Weights start as GPT-2's, N(0, 0.02), by
    pipetrain's per-layer rule (pipetrain.init_layers: layer i seeded from ``seed`` and i, then
    the modules' reset_parameters()), so a pipeline of this model built on the meta device
    (``device="meta"``: shapes only, no memory) with ``Pipeline(..., init_seed=seed)`` gets
    these very weights on any split. A meta model is returned uninitialized."""
    with torch.device(device) if device is not None else nullcontext():
        embedding = Embedding(vocab, dim, context, dropout)
        layers: list[nn.Module] = [embedding]
        layers += [Block(dim, heads, dropout) for _ in range(blocks)]
        layers.append(Head(embedding, tied))
    model = nn.Sequential(*layers)
    if not is_meta(model):
        pipetrain.init_layers(model, seed)
    torch.manual_seed(seed)  # the same generator state after an eager and a meta build
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: logits (batch, time, vocab) against ids (batch, time)."""
    return nn.functional.cross_entropy(logits.flatten(0, -2), targets.flatten())
