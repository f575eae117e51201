"""A pipeline checkpoint written back as a Hugging Face checkpoint directory.

``save(folder, config_dir, output)`` reads the newest checkpoint in ``folder`` one stage file
at a time (memory-mapped) and writes ``output`` as ``save_pretrained`` would: ``config.json``
and the other non-weight files of ``config_dir`` (generation config, tokenizer), the weights
as safetensors (``model.safetensors``, or shards of at most ``max_shard_size`` with
``model.safetensors.index.json``), a weight tied across keys written once, under the first
key of the model's state_dict that holds it (the embedding, not the head), in the hub's
layout: transformers' conversions undone as ``save_pretrained`` undoes them (one tensor per
expert, Pythia's ``embed_out``; pipetrain/hf/layout.py), one stage at a time. The keys are
checked against the model that ``config_dir`` describes, built on the meta device, first.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from partitioner.units import parse_bytes
from pipetrain.checkpoints.checkpointing import module_states
from pipetrain.checkpoints.layout import Index
from pipetrain.checkpoints.weightfile import INDEX, SINGLE, write_safetensors
from pipetrain.hf.layout import HubLayout
from pipetrain.hf.sequential import transformers_module

WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack")  # not copied over


def _model(config_dir: Path) -> Any:
    """``config_dir``'s model, on the meta device."""
    auto = transformers_module()
    config = auto.AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        return auto.AutoModelForCausalLM.from_config(config)


def _model_keys(model: Any) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """The keys a checkpoint of ``model`` holds, each tensor once, with their shapes; and the
    other keys of tied tensors (written once, under the first)."""
    seen: set[int] = set()
    keys, copies = {}, set()
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            copies.add(key)
        else:
            seen.add(id(tensor))
            keys[key] = tuple(tensor.shape)
    return keys, copies


def _checked_index(folder: str | os.PathLike[str], config_dir: Path, model: Any) -> Index:
    """The checkpoint's tensors to write (dtype, shape), in its order and in the model's keys;
    one error for keys that do not fit ``model``."""
    wanted, copies = _model_keys(model)
    found: Index = {}
    for module in module_states(folder):
        found.update({k: (v.dtype, tuple(v.shape)) for k, v in module.items()})
    index = {k: v for k, v in found.items() if k in wanted}
    missing = [k for k in wanted if k not in found]
    unexpected = [k for k in found if k not in wanted and k not in copies]
    shapes = [f"{k}: {index[k][1]} in the checkpoint, {wanted[k]} in the model"
              for k in index if index[k][1] != wanted[k]]
    problems = [f"{what} ({len(keys)}): {', '.join(keys[:10])}{' ...' if len(keys) > 10 else ''}"
                for what, keys in (("missing", missing), ("unexpected", unexpected),
                                   ("wrong shape", shapes)) if keys]
    if problems:
        raise ValueError(
            f"the checkpoint in {folder} does not fit the model of {config_dir / 'config.json'}: "
            + "; ".join(problems) + ". Pass the config directory of the model that was trained"
        )
    return index


def _shards(index: Index, limit: int) -> list[list[str]]:
    """The keys split in order into shards of at most ``limit`` bytes (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, (dtype, shape) in index.items():
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def save(
    folder: str | os.PathLike[str], config_dir: str | os.PathLike[str],
    output: str | os.PathLike[str], max_shard_size: int | str = "5GB",
) -> Path:
    """Write the newest checkpoint in ``folder`` as a Hugging Face checkpoint directory
    ``output`` (new or empty) for the model of ``config_dir`` (see the module docstring);
    returns ``output``."""
    config_dir, output = Path(config_dir), Path(output)
    if not (config_dir / "config.json").is_file():
        raise ValueError(f"{config_dir} has no config.json: pass the model's Hugging Face "
                         "directory (the one it was loaded from, or config.save_pretrained's)")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"{output} exists and is not an empty directory: write to a new one "
                         "(shards of an earlier save would mix with these)")
    model = _model(config_dir)
    layout = HubLayout(model)
    kept = _checked_index(folder, config_dir, model)
    index: Index = {}
    for module in module_states(folder):  # the hub's keys and shapes, stage by stage
        meta = {k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                for k, v in module.items() if k in kept}
        index.update({k: (v.dtype, tuple(v.shape)) for k, v in layout.to_hub(meta).items()})
    shards = _shards(index, parse_bytes(max_shard_size))
    output.mkdir(exist_ok=True)
    names = [SINGLE] if len(shards) == 1 else [
        f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))
    ]
    stream = _tensors(folder, kept, layout)
    for name, keys in zip(names, shards, strict=True):
        write_safetensors(output / name, {k: index[k] for k in keys},
                          itertools.islice(stream, len(keys)), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum((output / name).stat().st_size for name in names)
        weight_map = {key: name for name, keys in zip(names, shards, strict=True) for key in keys}
        (output / INDEX).write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2
        ) + "\n")
    for file in config_dir.iterdir():
        if file.is_file() and not file.name.endswith(WEIGHTS) and file.name != INDEX:
            shutil.copy2(file, output / file.name)
    return output


def _tensors(
    folder: str | os.PathLike[str], kept: Index, layout: HubLayout,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The hub's tensors, stage by stage, in the order of ``save``'s index."""
    for module in module_states(folder):
        yield from layout.to_hub({k: v for k, v in module.items() if k in kept}).items()
