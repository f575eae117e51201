"""The per-layer initialization rule (pipetrain/training/lazy.py), in one process: a model built on
the meta device and materialized, whole or in part, gets bit for bit the weights and buffers that
``pipetrain.init_layers`` gives the same model built eagerly; a layer the rule cannot fill is
refused naming it and the fix."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import pipetrain
from examples.models import gpt, resnet_like
from pipetrain.training.lazy import is_meta, layer_seed, materialize


def meta(factory, **kwargs) -> nn.Sequential:
    with torch.device("meta"):
        return factory(**kwargs)


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_batchnorm_cnn_meta_equals_eager() -> None:
    """Convolutions, BatchNorm (running statistics are buffers) and Linear layers: the meta
    model materialized whole equals the eager one under the same rule, whatever the eager
    constructor drew before."""
    eager = pipetrain.init_layers(resnet_like(norm="batch", seed=3), seed=7)
    lazy = pipetrain.init_layers(meta(resnet_like, norm="batch"), seed=7)
    assert not is_meta(lazy)
    assert_same(lazy.state_dict(), eager.state_dict())
    assert torch.equal(lazy[1].running_var, torch.ones(16))


def test_partial_materialization_matches_and_leaves_the_rest_on_meta() -> None:
    """Layers 2 and 5 (the tied head) alone: their values are the eager model's, the head's
    weight the embedding's (built on the side and dropped), every other layer stays meta."""
    eager = gpt(vocab=32, dim=16, blocks=4, heads=2, context=8, seed=1)
    model = gpt(vocab=32, dim=16, blocks=4, heads=2, context=8, seed=1, device="meta")
    materialize(model, {2: torch.device("cpu"), 5: torch.device("cpu")}, seed=1)
    want = eager.state_dict()
    for key, value in model.state_dict().items():
        here = key.split(".")[0] in ("2", "5")
        assert value.is_meta != here, key
        if here:
            assert torch.equal(value, want[key]), key
    assert torch.equal(model[5].project.weight, eager[0].tokens.weight)


def test_rule_leaves_the_callers_random_stream_alone() -> None:
    torch.manual_seed(0)
    before = torch.get_rng_state()
    pipetrain.init_layers(meta(resnet_like), seed=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert layer_seed(0, 1) != layer_seed(0, 2) != layer_seed(1, 1)


class SinusoidalPositions(nn.Module):
    """A fixed position table computed in __init__: on the meta device it has no data."""

    def __init__(self, length: int = 8, dim: int = 4):
        super().__init__()
        self.length, self.dim = length, dim
        self.register_buffer("table", self._table())

    def _table(self) -> torch.Tensor:
        position = torch.arange(self.length, dtype=torch.float32)[:, None]
        rate = torch.exp(torch.arange(0, self.dim, 2) * (-math.log(10000.0) / self.dim))
        return torch.cat([torch.sin(position * rate), torch.cos(position * rate)], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table


class ResettablePositions(SinusoidalPositions):
    def reset_parameters(self) -> None:
        self.table.copy_(self._table())


def test_buffer_computed_in_init_is_refused_naming_layer_and_fix() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), SinusoidalPositions())
    with pytest.raises(ValueError, match=r"layer 1 \(SinusoidalPositions\).*table.*"
                                         r"reset_parameters\(\)"):
        pipetrain.init_layers(model, seed=0)


def test_buffer_restored_by_its_reset_parameters() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), ResettablePositions())
    pipetrain.init_layers(model, seed=0)
    assert torch.equal(model[1].table, ResettablePositions().table)


def test_user_init_that_misses_a_tensor_is_refused() -> None:
    def weights_only(layer: nn.Module) -> None:
        if isinstance(layer, nn.Linear):
            nn.init.ones_(layer.weight)  # forgets the bias

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    refused = r"layer 0 \(Linear\).*init=\.\.\. left bias unwritten"
    with pytest.raises(ValueError, match=refused):
        pipetrain.init_layers(model, seed=0, init=weights_only)


def test_user_init_is_the_rule_for_both_builds() -> None:
    def constant_bias(layer: nn.Module) -> None:
        for module in layer.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight)
                nn.init.constant_(module.bias, 0.5)

    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    eager = pipetrain.init_layers(build(), seed=2, init=constant_bias)
    lazy = pipetrain.init_layers(meta(build), seed=2, init=constant_bias)
    assert_same(lazy.state_dict(), eager.state_dict())
    assert torch.equal(lazy[2].bias, torch.full((2,), 0.5))


def test_eager_pipeline_with_init_seed_equals_meta_pipeline() -> None:
    kwargs = dict(vocab=32, dim=16, blocks=2, heads=2, context=8)
    eager = pipetrain.Pipeline(gpt(**kwargs, seed=9), [2, 2], devices=["cpu", "cpu"],
                               init_seed=4)
    lazy = pipetrain.Pipeline(gpt(**kwargs, device="meta"), [1, 3], devices=["cpu", "cpu"],
                              init_seed=4)
    assert_same(lazy.module.state_dict(), eager.module.state_dict())
