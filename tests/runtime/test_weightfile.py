"""Whole-model weight files (pipetrain/checkpoints/weightfile.py): safetensors written here and
read with the ``safetensors`` package (files exchanged with its own writer and reader), torch .pt
files, and one clear error for a truncated or damaged file, missing, unexpected or wrongly shaped
keys."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
from examples.models import gpt
from pipetrain.checkpoints import weightfile

KWARGS = dict(vocab=32, dim=16, blocks=2, heads=2, context=8)


def index_of(state: dict) -> weightfile.Index:
    return {k: (v.dtype, tuple(v.shape)) for k, v in state.items()}


def save_st(path: Path, state: dict) -> Path:
    weightfile.write_safetensors(path, index_of(state), state.items())
    return path


def mixed() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int64).view(2, 3),
        "d": torch.tensor([True, False, True]),
        "e": torch.tensor(2.5, dtype=torch.float64),
        "f": torch.randn(4, 2).half(),
        "g": torch.randn(3, 2).to(torch.float8_e4m3fn),
        "h": torch.randn(5).to(torch.float8_e5m2),
        "i": torch.arange(4, dtype=torch.int32),
        "j": torch.arange(4, dtype=torch.int16).view(2, 2),
        "k": torch.arange(4, dtype=torch.int8),
        "l": torch.arange(4, dtype=torch.uint8),
        "m": torch.arange(4).to(torch.uint16),
        "n": torch.arange(4).to(torch.uint32),
        "o": torch.arange(4).to(torch.uint64),
    }


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def test_safetensors_round_trip_every_dtype(tmp_path: Path) -> None:
    state = mixed()
    path = save_st(tmp_path / "x.safetensors", state)
    assert weightfile.read_index(path) == index_of(state)
    module = nn.Module()
    for key, value in state.items():
        module.register_buffer(key, torch.zeros_like(value))
    weightfile.load_into(path, module)
    for key, value in state.items():  # compared as bytes: float8 and uint64 have no equal here
        got = getattr(module, key)
        assert got.dtype == value.dtype and torch.equal(_bytes(got), _bytes(value)), key


def test_files_exchange_with_the_safetensors_package(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = mixed()
    ours = save_st(tmp_path / "ours.safetensors", state)
    for key, value in load_file(ours).items():
        assert value.dtype == state[key].dtype and torch.equal(_bytes(value), _bytes(state[key]))
    theirs = tmp_path / "theirs.safetensors"
    save_file(state, theirs)
    assert weightfile.read_index(theirs) == index_of(state)
    module = nn.Module()
    for key, value in state.items():
        module.register_buffer(key, torch.zeros_like(value))
    weightfile.load_into(theirs, module)
    for key, value in state.items():
        assert torch.equal(_bytes(getattr(module, key)), _bytes(value)), key


def pipeline(weights: Path) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(gpt(**KWARGS, device="meta"), [2, 2], devices=["cpu", "cpu"],
                              weights=weights)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_truncated_file_is_refused(tmp_path: Path, suffix: str) -> None:
    state = gpt(**KWARGS).state_dict()
    path = tmp_path / f"model{suffix}"
    save_st(path, state) if suffix == ".safetensors" else torch.save(state, path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    with pytest.raises(weightfile.WeightFileError, match="truncated"):
        pipeline(path)


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_missing_unexpected_and_misshapen_keys_in_one_error(tmp_path: Path, suffix) -> None:
    state = dict(gpt(**KWARGS).state_dict())
    del state["1.norm1.weight"]
    state["9.extra"] = torch.zeros(2)
    state["2.mlp.0.bias"] = torch.zeros(3)
    path = tmp_path / f"model{suffix}"
    save_st(path, state) if suffix == ".safetensors" else torch.save(state, path)
    with pytest.raises(weightfile.WeightFileError) as error:
        pipeline(path)
    message = str(error.value)
    assert "missing (1): 1.norm1.weight" in message
    assert "unexpected (1): 9.extra" in message
    assert "wrong shape (1): 2.mlp.0.bias: (3,) in the file, (64,) in the model" in message


def test_lower_precision_file_loads_cast(tmp_path: Path) -> None:
    state = gpt(**KWARGS, seed=3).state_dict()
    half = {k: v.to(torch.bfloat16) for k, v in state.items()}
    pipe = pipeline(save_st(tmp_path / "bf16.safetensors", half))
    for key, value in pipe.module.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, half[key].float()), key


def test_pt_file_of_objects_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "model.pt"
    torch.save({"model": gpt(**KWARGS)}, path)
    with pytest.raises(weightfile.WeightFileError, match="objects other than tensors"):
        pipeline(path)


def _with_header(path: Path, change) -> Path:
    """``path`` written again with ``change`` applied to its JSON header (the data kept)."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    change(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
    return path


@pytest.mark.parametrize("damage", ["no data_offsets", "overlapping", "beyond the file"])
def test_a_damaged_header_is_refused_naming_the_file(tmp_path: Path, damage: str) -> None:
    """A header without a tensor's byte range, with two ranges overlapping, or with a range
    past the end of the file: a WeightFileError naming the file and the fix, never a KeyError
    or a tensor read from another's bytes."""
    state = {"a": torch.randn(4), "b": torch.randn(4)}
    path = save_st(tmp_path / "x.safetensors", state)

    def change(header: dict) -> None:
        if damage == "no data_offsets":
            del header["b"]["data_offsets"]
        elif damage == "overlapping":
            header["b"]["data_offsets"] = [8, 24]
        else:
            header["b"]["data_offsets"] = [16, 48]

    _with_header(path, change)
    module = nn.Module()
    for key, value in state.items():
        module.register_buffer(key, torch.zeros_like(value))
    fix = r"truncated or damaged.*write it again \(e.g. pipetrain consolidate .* x.safetensors\)"
    with pytest.raises(weightfile.WeightFileError, match=str(path) + ".*" + fix):
        weightfile.read_index(path)
    with pytest.raises(weightfile.WeightFileError, match=fix):
        weightfile.load_into(path, module)


def test_a_tensor_larger_than_a_block_is_read_in_blocks_of_rows(tmp_path: Path,
                                                                monkeypatch) -> None:
    """A tensor of more bytes than a block is read a block of rows at a time, its rows in place
    (a block of 3 rows of 8 bytes here, 10 rows: blocks of 3, 3, 3, 1), cast on the way."""
    monkeypatch.setattr(weightfile, "_BLOCK", 24)
    state = {"w": torch.randn(10, 2, dtype=torch.float64), "s": torch.tensor(1.5)}
    path = save_st(tmp_path / "x.safetensors", state)
    module = nn.Module()
    module.register_buffer("w", torch.zeros(10, 2, dtype=torch.float32))
    module.register_buffer("s", torch.zeros(()))
    weightfile.load_into(path, module)
    assert torch.equal(module.w, state["w"].float()) and module.s.item() == 1.5
