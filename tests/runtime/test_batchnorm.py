"""Deferred BatchNorm: running statistics of the whole mini-batch under micro-batching."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from pipetrain.training.batchnorm import DeferredBatchNorm
from tests.runtime.test_local import pipeline


def conv_model(first_norm: bool = True) -> nn.Sequential:
    """BatchNorm first (its input is the data, whatever the weights) or after a convolution.
    Only one BatchNorm each: a second one would see input normalised per micro-batch."""
    torch.manual_seed(0)
    norm: list[nn.Module] = [nn.BatchNorm2d(3, momentum=0.3)] if first_norm else [nn.Identity()]
    return nn.Sequential(
        *norm,
        nn.Conv2d(3, 4, 3, padding=1),
        nn.Identity() if first_norm else nn.BatchNorm2d(4, momentum=None),
        nn.ReLU(), nn.Flatten(), nn.Linear(4 * 5 * 5, 3),
    )


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 3, 5, 5, generator=g) * 2 + 1, torch.randint(0, 3, (8,), generator=g)


def buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if "running" in k or "tracked" in k}


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("first_norm", [True, False])
def test_running_statistics_are_those_of_the_whole_mini_batch(checkpoint, first_norm):
    plain = conv_model(first_norm)
    pipe = pipeline(copy.deepcopy(plain), [3, 3], chunks=4, recompute=checkpoint,
                    deferred_batch_norm=True)
    assert isinstance(pipe.stages[0].module[0 if first_norm else 2], DeferredBatchNorm)
    x, y = data(0)
    pipe.train_step(x, y)
    plain(x)  # plain BatchNorm on the whole mini-batch, before any update: same weights
    got, want = buffers(pipe.module), buffers(plain)
    assert got.keys() == want.keys() and want
    for key in want:
        assert torch.allclose(got[key].float(), want[key].float(), atol=1e-5), key


def test_first_layer_statistics_over_several_steps():
    plain = conv_model()
    pipe = pipeline(copy.deepcopy(plain), [3, 3], chunks=2, deferred_batch_norm=True)
    for step in range(3):
        x, y = data(step)
        pipe.train_step(x, y)
        plain[0](x)
    for key in ("running_mean", "running_var", "num_batches_tracked"):
        got, want = pipe.module.state_dict()["0." + key], plain.state_dict()["0." + key]
        assert torch.allclose(got.float(), want.float(), atol=1e-5), key


def test_plain_batch_norm_would_differ():
    """The test above can fail: per-micro-batch statistics give other running values."""
    plain = conv_model()
    pipe = pipeline(copy.deepcopy(plain), [3, 3], chunks=4)
    x, y = data(0)
    pipe.train_step(x, y)
    plain(x)
    got, want = pipe.module.state_dict(), plain.state_dict()
    assert not torch.allclose(got["0.running_var"], want["0.running_var"], atol=1e-5)


def test_eval_uses_running_statistics():
    plain = conv_model()
    pipe = pipeline(copy.deepcopy(plain), [3, 3], chunks=2, deferred_batch_norm=True)
    pipe.train_step(*data(0))
    x = data(1)[0]
    reference = copy.deepcopy(pipe.module).eval()
    with torch.no_grad():
        assert torch.allclose(pipe.eval_step(x), reference(x), atol=1e-6)


def test_a_second_pipeline_of_the_same_model_converts_with_its_own_chunks():
    """Building pipelines leaves the user's model's BatchNorm as it was (no conversion leaks
    into it), so a second pipeline with other chunks commits once per mini-batch, not once per
    2 micro-batches as the first one's conversion would; the statistics it trains are still the
    model's own tensors."""
    model, plain = conv_model(), conv_model()
    pipeline(model, [3, 3], chunks=2, deferred_batch_norm=True)
    pipe = pipeline(model, [3, 3], chunks=4, deferred_batch_norm=True)
    x, y = data(0)
    pipe.train_step(x, y)
    plain(x)
    got, want = buffers(pipe.module), buffers(plain)
    assert int(want["0.num_batches_tracked"]) == 1
    for key in want:
        assert torch.allclose(got[key].float(), want[key].float(), atol=1e-5), key
        assert torch.equal(buffers(model)[key], got[key]), f"{key} is not the model's own"
    assert type(model[0]) is nn.BatchNorm2d


def _weights(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in module.state_dict().items() if k not in buffers(module)}


@pytest.mark.parametrize("deferred", [False, True])
def test_training_normalizes_each_micro_batch_as_the_readme_says(deferred):
    """The README's caveat: with BatchNorm and chunks > 1 the weights are those of one process
    accumulating gradients over the same micro-batches (1e-6: only the order of sums differs),
    not those of one process fed the whole mini-batch; deferred_batch_norm changes only the
    running statistics."""
    x, y = data(0)
    pipe = pipeline(conv_model(False), [3, 3], chunks=4, deferred_batch_norm=deferred)
    pipe.train_step(x, y)
    whole, accumulated = conv_model(False), conv_model(False)
    micro = list(zip(x.chunk(4), y.chunk(4), strict=True))
    for model, parts in ((whole, [(x, y)]), (accumulated, micro)):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for xs, ys in parts:
            (nn.functional.cross_entropy(model(xs), ys) / len(parts)).backward()
        optimizer.step()
    got = _weights(pipe.module)
    for key, value in _weights(accumulated).items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=1e-6, msg=key)
    apart = max((got[k] - v).abs().max().item() for k, v in _weights(whole).items())
    assert apart > 1e-3
    statistics = buffers(whole if deferred else accumulated)
    for key, value in statistics.items():
        torch.testing.assert_close(buffers(pipe.module)[key], value, rtol=0, atol=1e-5, msg=key)


def test_adamw_turns_the_noise_of_a_zero_gradient_into_a_step_as_the_readme_says():
    """The README's exception to the 1e-5 bound, in plain PyTorch: a Linear's bias before
    BatchNorm has a gradient that is zero in exact arithmetic; AdamW (eps=1e-8) moves it by a
    share of lr that depends on the order of the batch's samples alone."""
    x, y = data(0)
    x = x.flatten(1)
    biases = []
    for order in (torch.arange(8), torch.arange(8).flip(0)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(75, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        nn.functional.cross_entropy(model(x[order]), y[order]).backward()
        assert model[0].bias.grad.abs().max() < 1e-6  # zero but for rounding
        optimizer.step()
        biases.append(model[0].bias.detach().clone())
    assert (biases[0] - biases[1]).abs().max() > 1e-4
