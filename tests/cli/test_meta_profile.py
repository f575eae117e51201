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
        assert a.backward_weight is not None and a.backward_weight > 0  # every layer has weights
    assert lazy.layers[0].tied_bytes == lazy.layers[-1].tied_bytes > 0  # the embedding's tie
    assert "meta device" in lazy.device


def test_identical_blocks_timed_once_and_named() -> None:
    profile = pipetrain.profile(gpt(**KWARGS, device="meta"), sample(), warmup=0, repeats=1,
                                reuse_times=True)
    blocks = profile.layers[1:4]
    assert [b.timed_as for b in profile.layers] == [None, None, "1:Block", "1:Block", None]
    times = {(b.forward, b.backward, b.backward_input, b.backward_weight) for b in blocks}
    assert len(times) == 1 and None not in next(iter(times))
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


def test_counted_flops_time_each_layer_at_the_given_rate() -> None:
    """``flops_per_second``: a Linear's forward is 2 x in x out FLOPs per sample, its backward
    the weight gradient's as many again plus, where its input needs a gradient, the input
    gradient's; nothing is built, and the bytes are the timed meta profile's."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(5, 4)
    counted = pipetrain.profile(model, x, flops_per_second=1e6)
    assert is_meta(model)
    first, act, last = counted.layers
    assert first.forward == pytest.approx(2 * 5 * 4 * 8 / 1e6)
    assert first.backward == pytest.approx(first.forward)  # x needs no gradient: weight only
    assert act.forward == act.backward == 0.0  # elementwise work is not counted
    assert last.backward == pytest.approx(2 * last.forward)  # weight and input gradients
    assert "1e+06 FLOP/s (estimated" in counted.device
    timed = pipetrain.profile(model, x, warmup=0, repeats=1)
    for a, b in zip(counted.layers, timed.layers, strict=True):
        assert (a.activation_bytes, a.param_bytes, a.saved_bytes) == (
            b.activation_bytes, b.param_bytes, b.saved_bytes)


def test_counted_flops_are_refused_for_a_built_model_and_a_rate_of_zero() -> None:
    with pytest.raises(ValueError, match="apply to a model built on the meta device"):
        pipetrain.profile(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.randn(1, 2),
                          flops_per_second=1e12)
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="must be positive"):
        pipetrain.profile(model, torch.randn(1, 2), flops_per_second=0.0)


def test_the_70b_example_profiles_on_the_meta_device_in_seconds(tmp_path: Path) -> None:
    """examples/llama_70b/config.json (Llama 3 70B's shapes) from the command line: a block is
    2 x 855,654,400 FLOPs per token for its matrices plus attention's 4 x seq x hidden."""
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
    out = tmp_path / "70b.json"
    assert main(["profile", "hf:examples/llama_70b", "--meta", "--flops-per-second", "4e14",
                 "--input-shape", "1,512", "--input-dtype", "int64", "--input-high", "128256",
                 "-o", str(out)]) == 0
    layers = Profile.from_json(out.read_text()).layers
    assert len(layers) == 83 and sum(layer.param_count for layer in layers) == 70_553_706_496
    block = next(layer for layer in layers if layer.name == "model.layers.0:LlamaDecoderLayer")
    flops = 2 * 855_654_400 * 512 + 4 * 512 * 512 * 8192
    assert block.forward == pytest.approx(flops / 4e14, rel=1e-3)
    assert block.backward == pytest.approx(2 * block.forward, rel=1e-3)
