"""The bundled text as bytes for a byte-level language model: training windows, held-out
windows and sampling from a trained model (examples/train_gpt.py and its benchmarks use it)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

CORPUS = Path(__file__).with_name("data") / "kjv-gospels-acts.txt.gz"  # see data/README.md


def load_corpus(
    path: str | Path = CORPUS, held_out: float = 0.05
) -> tuple[torch.Tensor, torch.Tensor]:
    """The text's bytes as int64 token ids, split into (training, held-out): the held-out part
    is the last ``held_out`` of the text (the end of Acts), never seen in training."""
    if not 0.0 < held_out < 1.0:
        raise ValueError(f"held_out is a fraction of the text, in (0, 1); got {held_out}")
    data = torch.frombuffer(bytearray(gzip.decompress(Path(path).read_bytes())), dtype=torch.uint8)
    cut = int(len(data) * (1.0 - held_out))
    return data[:cut].long(), data[cut:].long()


def training_batches(
    data: torch.Tensor, batch: int, context: int, seed: int, start: int = 0
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless (inputs, targets) batches of ``batch`` windows of ``context`` bytes at random
    offsets (drawn from ``seed`` alone, so every process draws the same), targets shifted by
    one byte. ``start`` skips that many batches' offsets: a run resumed at step ``start``
    trains on the very batches an uninterrupted run would."""
    if len(data) <= context + 1:
        raise ValueError(f"a text of {len(data)} bytes is too short for a context of {context}")
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(context + 1)
    high = len(data) - context - 1
    for _ in range(start):  # a draw per batch, a few microseconds each
        torch.randint(0, high, (batch, 1), generator=generator)
    while True:
        starts = torch.randint(0, high, (batch, 1), generator=generator)
        windows = data[starts + offsets]
        yield windows[:, :-1], windows[:, 1:]


def held_out_batches(
    data: torch.Tensor, batch: int, context: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The held-out text cut into consecutive windows of ``context`` bytes, in batches of
    ``batch`` windows (the windows that do not fill a last batch are left out)."""
    windows = (len(data) - 1) // context // batch * batch
    if windows == 0:
        raise ValueError(
            f"the held-out text ({len(data)} bytes) has fewer than {batch} windows of {context} "
            "bytes; hold out more or evaluate in smaller batches"
        )
    used = windows * context
    x, y = data[:used].view(-1, context), data[1 : used + 1].view(-1, context)
    return list(zip(x.split(batch), y.split(batch), strict=True))


@torch.no_grad()
def sample(
    model: nn.Module, prompt: str, length: int, context: int, temperature: float = 0.8,
    seed: int = 0,
) -> str:
    """``prompt`` continued by ``length`` bytes drawn one at a time from ``model``'s
    next-byte distribution (softmax of logits / ``temperature``), seeing at most ``context``
    bytes back."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor([list(prompt.encode())], dtype=torch.long)
    for _ in range(length):
        logits = model(ids[:, -context:])[0, -1].float() / temperature
        following = torch.multinomial(logits.softmax(-1), 1, generator=generator)
        ids = torch.cat([ids, following[None]], dim=1)
    return bytes(ids[0].tolist()).decode("utf-8", errors="replace")
