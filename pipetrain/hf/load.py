"""Hugging Face checkpoint directories read per stage: ``model.safetensors``, or shards listed
by ``model.safetensors.index.json``.

Each rank reads only its own layers' tensors, shard by shard, straight into its parameters
(pipetrain/checkpoints/weightfile.py: ``safe_open``, a block of rows at a time);
``Pipeline(weights=DIR)`` dispatches here for a directory. Needs no transformers.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from pipetrain.checkpoints import weightfile

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def source(directory: str | os.PathLike[str]) -> Path:
    """The file that lists the directory's tensors: the index, or the single file."""
    root = Path(directory)
    for name in (INDEX, SINGLE):
        if (root / name).is_file():
            return root / name
    raise weightfile.WeightFileError(
        f"{root} holds neither {SINGLE} nor {INDEX}: pass a Hugging Face checkpoint directory "
        "in safetensors (a model saved as pytorch_model.bin can be converted with transformers: "
        "from_pretrained(...).save_pretrained(dir))"
    )


def shards(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Every key of the checkpoint and the safetensors file that holds it."""
    listing = source(directory)
    if listing.name == SINGLE:
        return dict.fromkeys(weightfile.read_index(listing), listing)
    try:
        weight_map = json.loads(listing.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise weightfile.WeightFileError(
            f"{listing} is damaged: no weight_map ({error}); write the checkpoint again"
        ) from None
    files = {name: listing.parent / name for name in set(weight_map.values())}
    absent = sorted(name for name, path in files.items() if not path.is_file())
    if absent:
        raise weightfile.WeightFileError(
            f"{listing} lists shards that are not there: {', '.join(absent)}; copy the whole "
            "checkpoint directory"
        )
    return {key: files[name] for key, name in weight_map.items()}


def read_index(directory: str | os.PathLike[str]) -> weightfile.Index:
    """Every key with its dtype and shape, from the shards' headers."""
    where = shards(directory)
    index: weightfile.Index = {}
    for path in sorted(set(where.values())):
        header = weightfile.read_index(path)
        listed = [key for key, file in where.items() if file == path]
        lost = [key for key in listed if key not in header]
        if lost:
            raise weightfile.WeightFileError(
                f"{source(directory)} places {', '.join(lost[:5])} in {path.name}, which does "
                "not hold them: the index and the shards are from different saves"
            )
        index.update({key: header[key] for key in listed})
    return index


def load_into(directory: str | os.PathLike[str], targets: Mapping[str, torch.Tensor]) -> None:
    """Read each key of ``targets`` (a file key) into its tensor, one shard at a time."""
    where = shards(directory)
    for path in sorted({where[key] for key in targets}):
        weightfile.load_safetensors(path, {k: t for k, t in targets.items() if where[k] == path})
