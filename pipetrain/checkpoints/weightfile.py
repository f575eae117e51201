"""Whole-model weight files read per stage: safetensors and torch ``.pt``.

Keys are those of the whole model's ``state_dict()``; a rank reads only the keys of its own
layers. A safetensors file is read with the ``safetensors`` package's ``safe_open``, one tensor
at a time (its header checked whole: offsets in the file, not overlapping), each copied into its
parameter at once, so a rank holds its parameters plus one tensor in flight. It is written here
tensor by tensor after a header computed from shapes alone (``save_file`` needs every tensor at
once), so a checkpoint is consolidated one stage at a time. A ``.pt`` file is read with
``torch.load(mmap=True, weights_only=True)``: only the pages of this rank's tensors are read.
Hosts are assumed little-endian, as safetensors' format is. A directory holds one
``model.safetensors`` or safetensors shards listed by ``model.safetensors.index.json`` (the
sharded-safetensors convention, which Hugging Face checkpoints follow): each rank reads its own
keys shard by shard. A checkpoint in another program's keys (a Hugging Face hub checkpoint) is
read through the model's layout (pipetrain/checkpoints/layout.py).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import pickle
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pipetrain.checkpoints import layout
from pipetrain.checkpoints.layout import Index

DTYPES: dict[str, torch.dtype] = {  # safetensors' dtype names, every one torch has
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}


class WeightFileError(ValueError):
    """A weights file that cannot be read, or does not fit the model: says what and the fix."""




def is_safetensors(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix == ".safetensors"


# -- safetensors -----------------------------------------------------------------------------


@contextmanager
def _opened(path: Path) -> Iterator[Any]:
    """``safe_open`` on ``path``, a damaged or truncated file refused with the fix."""
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            yield f
    except SafetensorError as error:
        raise WeightFileError(
            f"{path} is truncated or damaged, not a readable safetensors file ({error}); write "
            f"it again (e.g. pipetrain consolidate ... -o {path.name})"
        ) from None


def _safetensors_index(path: Path) -> Index:
    index = {}
    with _opened(path) as f:
        for key in f.keys():
            entry = f.get_slice(key)
            dtype = entry.get_dtype()
            if dtype not in DTYPES:
                raise WeightFileError(
                    f"{path}: tensor {key!r} has dtype {dtype}, which torch has no type for "
                    f"(pipetrain reads {', '.join(DTYPES)})"
                )
            index[key] = (DTYPES[dtype], tuple(entry.get_shape()))
    return index


def load_safetensors(path: Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Read each key of ``targets`` from the safetensors file ``path`` into its tensor (cast to
    its dtype where the file holds another), a block of rows of at most ``_BLOCK`` bytes at a
    time: the file is opened for each block and closed after it, so that neither its mapped
    pages nor the block's copy add more than that to the rank's resident memory."""
    for key, target in targets.items():
        rows = len(target) if target.dim() else 1
        step = max(1, _BLOCK * rows // max(target.nbytes, 1))
        for start in range(0, rows, step):
            with _opened(path) as f:
                if target.dim():
                    target[start : start + step].copy_(f.get_slice(key)[start : start + step])
                else:
                    target.copy_(f.get_tensor(key))


_BLOCK = 16 * 2**20


def write_safetensors(
    path: str | os.PathLike[str], index: Mapping[str, tuple[torch.dtype, tuple[int, ...]]],
    tensors: Iterable[tuple[str, torch.Tensor]], metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file of the keys in ``index`` (in its order), taking their tensors
    from ``tensors`` one at a time, in the same order: the file never needs them all at once.
    ``metadata``: the header's string-to-string ``__metadata__``."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for key, (dtype, shape) in index.items():
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {"dtype": NAMES[dtype], "shape": list(shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    keys = iter(index)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for key, tensor in tensors:
            expected = next(keys, None)
            if key != expected or (tensor.dtype, tuple(tensor.shape)) != index[key]:
                raise ValueError(f"tensor {key!r} came where {expected!r} of the index belongs")
            f.write(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
        if next(keys, None) is not None:
            raise ValueError("fewer tensors came than the index lists")


# -- torch .pt -------------------------------------------------------------------------------


def open_pt(path: Path) -> Mapping[str, torch.Tensor]:
    """A .pt file's state_dict, memory-mapped (pages are read when a tensor is used)."""
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except pickle.UnpicklingError as error:
        raise WeightFileError(
            f"{path} holds objects other than tensors ({str(error).splitlines()[0]}); save the "
            "state_dict alone (torch.save(model.state_dict(), path))"
        ) from None
    except Exception as error:  # a truncated zip fails anywhere inside torch.load
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise WeightFileError(f"{path} is damaged (truncated or overwritten?): {first}") from None
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise WeightFileError(
            f"{path} is not a state_dict (a mapping of names to tensors); save "
            "model.state_dict(), or consolidate a checkpoint with `pipetrain consolidate`"
        )
    return state


def _release(tensor: torch.Tensor) -> None:
    """Drop a memory-mapped tensor's pages from this process's resident memory once copied
    (Linux ``madvise(MADV_DONTNEED)`` on the whole pages it spans; the mapping is private and
    never written, so a later read gets the file's bytes again). Without it a rank's peak holds
    its share twice: the mapped pages and the parameters."""
    if _LIBC is None:
        return
    page = mmap.PAGESIZE
    start = tensor.data_ptr()
    low, high = -(-start // page) * page, (start + tensor.nbytes) // page * page
    if high > low:
        _LIBC.madvise(ctypes.c_void_p(low), ctypes.c_size_t(high - low), _MADV_DONTNEED)


_MADV_DONTNEED = 4
_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None


# -- a directory of safetensors shards ------------------------------------------------------

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def source(directory: str | os.PathLike[str]) -> Path:
    """The file that lists the directory's tensors: the index, or the single file."""
    root = Path(directory)
    for name in (INDEX, SINGLE):
        if (root / name).is_file():
            return root / name
    raise WeightFileError(
        f"{root} holds neither {SINGLE} nor {INDEX}: pass a Hugging Face checkpoint directory "
        "in safetensors (a model saved as pytorch_model.bin can be converted with transformers: "
        "from_pretrained(...).save_pretrained(dir))"
    )


def shards(directory: str | os.PathLike[str]) -> dict[str, Path]:
    """Every key of the directory and the safetensors file that holds it."""
    listing = source(directory)
    if listing.name == SINGLE:
        return dict.fromkeys(_safetensors_index(listing), listing)
    try:
        weight_map = json.loads(listing.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise WeightFileError(
            f"{listing} is damaged: no weight_map ({error}); write the checkpoint again"
        ) from None
    files = {name: listing.parent / name for name in set(weight_map.values())}
    absent = sorted(name for name, path in files.items() if not path.is_file())
    if absent:
        raise WeightFileError(
            f"{listing} lists shards that are not there: {', '.join(absent)}; copy the whole "
            "checkpoint directory"
        )
    return {key: files[name] for key, name in weight_map.items()}


def _directory_index(directory: Path) -> Index:
    """Every key with its dtype and shape, from the shards' headers."""
    where = shards(directory)
    index: Index = {}
    for path in sorted(set(where.values())):
        header = _safetensors_index(path)
        listed = [key for key, file in where.items() if file == path]
        lost = [key for key in listed if key not in header]
        if lost:
            raise WeightFileError(
                f"{source(directory)} places {', '.join(lost[:5])} in {path.name}, which does "
                "not hold them: the index and the shards are from different saves"
            )
        index.update({key: header[key] for key in listed})
    return index


def _load_directory(directory: Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Read each key of ``targets`` (a file key) into its tensor, one shard at a time."""
    where = shards(directory)
    for path in sorted({where[key] for key in targets}):
        load_safetensors(path, {k: t for k, t in targets.items() if where[k] == path})


# -- any of them -----------------------------------------------------------------------------


def read_index(path: str | os.PathLike[str]) -> Index:
    """Every key of the file with its dtype and shape, read without the tensors' data."""
    path = Path(path)
    if path.is_dir():
        return _directory_index(path)
    if not path.is_file():
        raise WeightFileError(
            f"{path} does not exist; pass a .safetensors or .pt file, or a Hugging Face "
            "checkpoint directory"
        )
    if is_safetensors(path):
        return _safetensors_index(path)
    return {k: (v.dtype, tuple(v.shape)) for k, v in open_pt(path).items()}


@dataclass(frozen=True)
class Reading:
    """Where each key of a model's state_dict comes from in one weights file: the group of
    file keys that makes it (pipetrain/checkpoints/layout.py), by the model key; ``tied``: a
    key the file lacks whose tensor is tied to one it makes (a head tied to the embedding,
    saved once as transformers does), and that key."""

    path: Path
    groups: dict[str, layout.Group]
    tied: dict[str, str]


def reading(
    path: str | os.PathLike[str], model: nn.Module, check: bool = True,
) -> Reading:
    """How ``model`` (the whole model, on the meta device or real) reads ``path``, by its
    layout; ``check``: refuse, in one error, every key the file lacks, every key the model
    lacks and every shape that differs."""
    path = Path(path)
    groups = layout.groups(model, read_index(path))
    made = {key: group for group in groups for key in group.targets}
    tied = _tied(made.keys(), model)
    if check:
        _check(path, groups, made.keys() | tied.keys(), model)
    return Reading(path, made, tied)


def _check(
    path: Path, groups: list[layout.Group], found: Iterable[str], model: nn.Module,
) -> None:
    wanted = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = sorted(wanted.keys() - set(found))
    unexpected = sorted(
        key for group in groups if not group.targets.keys() <= wanted.keys()
        for key in group.sources
    )
    shapes = sorted(
        f"{k}: {shape} in the file, {wanted[k]} in the model"
        for group in groups for k, (_, shape) in group.targets.items()
        if k in wanted and shape != wanted[k]
    )
    problems = [
        f"{what} ({len(keys)}): {', '.join(keys[:10])}{' ...' if len(keys) > 10 else ''}"
        for what, keys in (("missing", missing), ("unexpected", unexpected),
                           ("wrong shape", shapes))
        if keys
    ]
    if problems:
        raise WeightFileError(
            f"{source(path) if path.is_dir() else path} does not fit the model: "
            + "; ".join(problems) + ". Pass the file saved from this model (keys as in "
            "model.state_dict(), or a Hugging Face checkpoint of its architecture), or build "
            "the model the file was saved from"
        )


def _tied(made: Iterable[str], model: nn.Module) -> dict[str, str]:
    """The keys of ``model``'s state_dict not in ``made`` whose tensor is a key's in it."""
    made = set(made)
    keys: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        keys.setdefault(id(tensor), []).append(key)
    return {
        key: saved[0]
        for group in keys.values()
        if (saved := [k for k in group if k in made])
        for key in group if key not in made
    }


def load_into(
    path: str | os.PathLike[str], module: nn.Module, plan: Reading | None = None,
) -> None:
    """Read the tensors of ``module``'s state_dict keys (a stage's slice, keyed as the whole
    model) from ``path`` into them, in place, as ``plan`` (from :func:`reading` of the whole
    model; by default ``module``'s own, unchecked) says: a kept or renamed key straight into
    its tensor, a converted group read whole, made and copied."""
    plan = plan or reading(path, module, check=False)
    straight: dict[str, torch.Tensor] = {}  # file key -> the model's tensor
    converted: dict[int, tuple[layout.Index, layout.Make, dict[str, torch.Tensor]]] = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        made = plan.tied.get(key, key)
        group = plan.groups.get(made)
        if group is None:
            raise WeightFileError(f"{plan.path} holds no tensor for {key!r}: pass the file saved "
                                  "from this model")
        if group.make is None:
            straight[next(iter(group.sources))] = tensor.data
        else:
            converted.setdefault(id(group), (group.sources, group.make, {}))[2][made] = tensor.data
    with torch.no_grad():
        _read(plan.path, straight)
        for sources, make, targets in converted.values():
            inputs = {k: torch.empty(shape, dtype=dtype) for k, (dtype, shape) in sources.items()}
            _read(plan.path, inputs)
            outputs = make(inputs)
            for key, target in targets.items():
                target.copy_(outputs[key])


def _read(path: Path, targets: Mapping[str, torch.Tensor]) -> None:
    """Each file key of ``targets`` into its tensor (cast to its dtype)."""
    if path.is_dir():
        _load_directory(path, targets)
    elif is_safetensors(path):
        load_safetensors(path, targets)
    else:
        state = open_pt(path)
        for key, target in targets.items():
            target.copy_(state[key])
            _release(state[key])
