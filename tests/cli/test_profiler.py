"""pipetrain.tools.profiler.profile: what it records per layer, and that it leaves the model
alone."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from examples.models import resnet_like
from pipetrain.runtime.planning import layer_signature
from pipetrain.tools.profiler import profile
from tests.runtime.models import mlp

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tuples_cross_layers_and_only_grad_outputs_get_gradients():
    model = mlp(width=6)  # Fork emits (x, detached copy, int labels); Join takes them back
    x = torch.randn(5, 6)
    result = profile(model, x, optimizer="momentum", warmup=0, repeats=1)
    names, counts = layer_signature(model)
    assert result.names == names and [layer.param_count for layer in result.layers] == counts
    fork = result.layers[3]
    assert fork.name == "3:Fork"
    assert fork.activation_bytes == 5 * 6 * 4 * 2 + 5 * 8  # two fp32 tensors and int64 labels
    assert result.batch_size == 5 and result.input_bytes == 5 * 6 * 4
    for layer in result.layers:
        assert layer.param_bytes == 4 * layer.param_count
        assert layer.optimizer_state_bytes == layer.param_bytes  # one momentum buffer


def test_tuple_input_in_place_layers_and_frozen_parameters():
    class Add(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    model = nn.Sequential(Add(), nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True))
    model[2].bias.requires_grad_(False)
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    result = profile(model, (a, b), optimizer="adam", warmup=1, repeats=2)
    assert result.batch_size == 3 and result.input_bytes == 2 * 3 * 4 * 4
    assert [layer.backward for layer in result.layers[:2]] == [0.0, 0.0]  # nothing needs grad
    assert result.layers[2].backward > 0 and result.layers[3].backward > 0
    linear = result.layers[2]
    assert linear.param_bytes == 20 * 4 and linear.optimizer_state_bytes == 2 * 16 * 4
    assert torch.equal(a + b, model[0]((a, b)))  # the in-place layers left the input alone


def test_saved_bytes_count_each_kept_tensor_once_along_the_chain():
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
    result = profile(model, torch.randn(5, 6), warmup=0, repeats=1)
    first, relu, last = result.layers
    # Linear keeps its input, ReLU its output; the last Linear's input is ReLU's output,
    # already counted there, so it adds nothing.
    assert (first.saved_bytes, first.saved_input_bytes) == (5 * 6 * 4, 5 * 6 * 4)
    assert (relu.saved_bytes, relu.saved_input_bytes) == (5 * 8 * 4, 0)
    assert (last.saved_bytes, last.saved_input_bytes) == (0, 0)
    assert last.kept_bytes == 0 and last.activation_bytes == 5 * 3 * 4


def test_a_failing_layer_is_named():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(5, 2))
    with pytest.raises(ValueError, match=r"layer 2 \(2:Linear\) failed on an input of \(3, 4\)"):
        profile(model, torch.randn(3, 4), warmup=0, repeats=1)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        profile(model, torch.randn(3, 4), optimizer="lion")


def test_profile_leaves_the_model_as_it_was():
    net = resnet_like(width=8, norm="batch").eval()
    before = copy.deepcopy(net.state_dict())
    x = torch.randn(4, 3, 8, 8)
    rng = torch.get_rng_state()
    profile(net, x, warmup=1, repeats=1)
    assert not net.training and all(p.grad is None for p in net.parameters())
    assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())  # BN stats too
    assert torch.equal(torch.get_rng_state(), rng)


def test_profile_leaves_existing_gradients_bit_identical():
    """A model mid-training (gradients accumulated, not yet stepped) keeps its .grad tensors,
    values and identity: profiling's own backwards must not add into them."""
    model = mlp(width=6)
    x, y = torch.randn(5, 6), torch.randint(0, 5, (5,))
    nn.functional.cross_entropy(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    values = [g.clone() for g in grads]
    profile(model, x, warmup=1, repeats=1)
    for p, g, v in zip(model.parameters(), grads, values, strict=True):
        assert p.grad is g and torch.equal(p.grad, v)


def test_example_models_build_deterministically():
    for build in (lambda: resnet_like(width=8), lambda: mlp()):
        a, b = build().state_dict(), build().state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_split_backward_is_timed_apart_and_positive():
    # B (input gradients) and W (weight gradients) as the zero-bubble schedules run them
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64), nn.ReLU())
    result = profile(model, torch.randn(32, 64), warmup=1, repeats=3)
    first, act, second, _ = result.layers
    assert first.backward_input == 0.0  # fed plain data: no input gradient to compute
    assert first.backward_weight is not None and first.backward_weight > 0
    assert act.backward_input is not None and act.backward_input > 0
    assert act.backward_weight == 0.0  # no weights: no W
    assert second.backward_input is not None and second.backward_input > 0
    assert second.backward_weight is not None and second.backward_weight > 0
    assert all(p.grad is None for p in model.parameters())  # W's gradients were set aside
