"""Profiling a model built on the meta device (pipetrain/tools/meta_profile.py): bytes from
shapes, times from one materialized layer at a time, a run of identical blocks timed once when asked
(and said so in the profile)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipetrain
from examples.models import gpt
from partitioner import Profile
from pipetrain.tools.cli import main
from pipetrain.training.lazy import is_meta

KWARGS = dict(vocab=32, dim=16, blocks=3, heads=2, context=8)


def sample() -> torch.Tensor:
    return torch.randint(0, 32, (4, 8), generator=torch.Generator().manual_seed(0))


def test_meta_profile_has_the_eager_profiles_bytes() -> None:
    eager = pipetrain.profile(gpt(**KWARGS), sample(), warmup=0, repeats=1)
    model = gpt(**KWARGS, device="meta")
    lazy = pipetrain.profile(model, sample(), warmup=0, repeats=1)
    assert is_meta(model)  # the caller's model is never built
    for a, b in zip(lazy.layers, eager.layers, strict=True):
        assert (a.name, a.param_count, a.param_bytes, a.activation_bytes,
                a.optimizer_state_bytes, a.tied_bytes, a.saved_input_bytes) == (
                    b.name, b.param_count, b.param_bytes, b.activation_bytes,
                    b.optimizer_state_bytes, b.tied_bytes, b.saved_input_bytes)
        # On the meta device attention takes the math path (it saves its score matrices),
        # on the CPU the fused kernel (its output and log-sum-exp): a few % apart at this size.
        assert a.saved_bytes == pytest.approx(b.saved_bytes, rel=0.1)
        assert a.forward > 0 and a.backward > 0 and a.timed_as is None
    assert lazy.layers[0].tied_bytes == lazy.layers[-1].tied_bytes > 0  # the embedding's tie
    assert "meta device" in lazy.device


def test_identical_blocks_timed_once_and_named() -> None:
    profile = pipetrain.profile(gpt(**KWARGS, device="meta"), sample(), warmup=0, repeats=1,
                                reuse_times=True)
    blocks = profile.layers[1:4]
    assert [b.timed_as for b in profile.layers] == [None, None, "1:Block", "1:Block", None]
    assert {(b.forward, b.backward) for b in blocks} == {(blocks[0].forward, blocks[0].backward)}
    again = Profile.from_json(profile.to_json())
    assert [b.timed_as for b in again.layers] == [b.timed_as for b in profile.layers]


def test_eager_profile_json_has_no_timed_as() -> None:
    profile = pipetrain.profile(gpt(**KWARGS), sample(), warmup=0, repeats=1)
    assert all("timed_as" not in layer for layer in json.loads(profile.to_json())["layers"])
    with pytest.raises(ValueError, match="meta device"):
        pipetrain.profile(gpt(**KWARGS), sample(), reuse_times=True)


def test_cli_profiles_a_meta_built_model(tmp_path: Path, capsys) -> None:
    out = tmp_path / "profile.json"
    code = main([
        "profile", "examples.models:gpt", "--meta", "--reuse-times", "--input-shape", "4,8",
        "--input-dtype", "int64", "--input-high", "32", "--kwargs", json.dumps(KWARGS),
        "--warmup", "0", "--repeats", "1", "-o", str(out),
    ])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "(times of 1:Block)" in printed
    assert len(Profile.load(out).layers) == 5
