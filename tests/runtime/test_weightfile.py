"""Whole-model weight files (pipetrain/checkpoints/weightfile.py): safetensors written and read
here (and, where the ``safetensors`` package is installed, exchanged with it), torch .pt files, and
one clear error for a truncated file, missing, unexpected or wrongly shaped keys."""

from __future__ import annotations

import importlib.util
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
    }


def test_safetensors_round_trip_every_dtype(tmp_path: Path) -> None:
    state = mixed()
    path = save_st(tmp_path / "x.safetensors", state)
    assert weightfile.read_index(path) == index_of(state)
    module = nn.Module()
    for key, value in state.items():
        module.register_buffer(key, torch.zeros_like(value))
    weightfile.load_into(path, module)
    for key, value in state.items():
        assert torch.equal(getattr(module, key), value), key


needs_package = pytest.mark.skipif(
    importlib.util.find_spec("safetensors") is None,
    reason="the safetensors package is not installed (pip install safetensors) to check "
    "files against the reference implementation",
)


@needs_package
def test_files_exchange_with_the_safetensors_package(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    state = mixed()
    ours = save_st(tmp_path / "ours.safetensors", state)
    for key, value in load_file(ours).items():
        assert torch.equal(value, state[key]), key
    theirs = tmp_path / "theirs.safetensors"
    save_file(state, theirs)
    assert weightfile.read_index(theirs) == index_of(state)
    module = nn.Module()
    for key, value in state.items():
        module.register_buffer(key, torch.zeros_like(value))
    weightfile.load_into(theirs, module)
    for key, value in state.items():
        assert torch.equal(getattr(module, key), value), key


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
