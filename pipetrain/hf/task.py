"""A Hugging Face model for the command line: its layers from a directory or a config, and a
``pipetrain train`` task that trains it on a token file.

``pipetrain profile hf:DIR --meta ...`` profiles ``layers(DIR)`` built on the meta device (one
layer at a time, never the whole model); ``pipetrain train pipetrain.hf.task:text --kwargs
'{"model": DIR, "tokens": FILE, "batch": B, "seq": T}' --plan plan.json ...`` trains it:
from DIR's weights where it has them, else from transformers' initialization per layer.
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipetrain.checkpoints.weightfile import INDEX, SINGLE
from pipetrain.hf.loss import causal_lm_loss, causal_lm_targets
from pipetrain.hf.sequential import (
    CausalLMLayers,
    initializer,
    sequential,
    transformers_module,
)
from pipetrain.runtime.train_task import TrainTask


def build_model(source: str | os.PathLike[str]) -> Any:
    """The causal LM that ``source`` (a Hugging Face directory or its config.json) describes,
    built from the config alone, on the current default device (meta, under
    ``with torch.device("meta")``): no weights are read here."""
    auto = transformers_module()
    path = Path(source)
    if not (path / "config.json").is_file() and not (path.is_file() and path.suffix == ".json"):
        raise ValueError(f"{source} is neither a Hugging Face directory (with config.json) nor "
                         "a config JSON file")
    config = auto.AutoConfig.from_pretrained(path)
    return auto.AutoModelForCausalLM.from_config(config)


def layers(source: str | os.PathLike[str]) -> CausalLMLayers:
    """``pipetrain.hf.sequential`` of :func:`build_model` (what ``pipetrain profile hf:DIR``
    runs)."""
    return sequential(build_model(source))


def read_tokens(path: str | os.PathLike[str]) -> torch.Tensor:
    """Token ids of a file: a ``.npy`` array of ids, or any other file's bytes (gunzipped for
    ``.gz``) as byte-level tokens 0..255."""
    path = Path(path)
    if path.suffix == ".npy":
        return torch.from_numpy(np.load(path).astype(np.int64).reshape(-1))
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def text(
    model: str, tokens: str, batch: int, seq: int, lr: float = 1e-3, weight_decay: float = 0.0,
    clip: float | None = 1.0, seed: int = 0, precision: str = "fp32",
) -> TrainTask:
    """A TrainTask of the Hugging Face model in directory (or config) ``model`` on the token
    file ``tokens``: each step ``batch`` windows of ``seq`` tokens at random offsets (drawn
    from ``seed`` and the step), AdamW, transformers' causal-LM loss. The model is built on the
    meta device; each rank reads its stage from the directory's weights, or, for a config
    alone, initializes it by transformers' rule (per layer, from ``seed``)."""
    ids = read_tokens(tokens)
    with torch.device("meta"):
        built = build_model(model)
    vocab = built.config.vocab_size
    if int(ids.max()) >= vocab:
        raise ValueError(f"{tokens} holds token id {int(ids.max())}, beyond the model's "
                         f"vocabulary of {vocab}")
    if len(ids) <= seq:
        raise ValueError(f"{tokens} holds {len(ids)} tokens, too few for windows of {seq}")
    folder = Path(model)
    options: dict[str, Any] = {"precision": precision, "clip_grad_norm": clip}
    if (folder / SINGLE).is_file() or (folder / INDEX).is_file():
        options["weights"] = folder
    else:
        options.update(init_seed=seed, init=initializer(built))

    def windows(step: int) -> tuple[tuple[torch.Tensor, torch.Tensor], Any]:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(ids) - seq, (batch,), generator=generator)
        rows = ids[starts[:, None] + torch.arange(seq)]
        return (rows, torch.ones_like(rows)), causal_lm_targets(rows)

    return TrainTask(
        sequential(built), causal_lm_loss,
        lambda params: torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay),
        windows, options,
    )
