"""On a GPU: a bf16, clipped 1F1B step with a fused optimizer makes no host sync, a NaN step
is skipped on the device, and HostCopy brings flags to the host without waiting.

Skipped with the reason without a GPU (the CPU tests in tests/runtime/test_step_cost.py count
the same calls); run ``python -m pytest tests/gpu -q -rs`` on a GPU machine.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pipetrain
from examples.models import lm_loss
from pipetrain.runtime.readback import HostCopy
from tests.runtime.models import batches, mlp, text_batches, tiny_gpt
from tests.runtime.test_step_cost import host_syncs

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def fused_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


@needs_gpu
def test_no_host_sync_in_a_bf16_clipped_1f1b_step_on_cuda():
    pipe = pipetrain.Pipeline(
        tiny_gpt(), [2, 3], chunks=4, precision="bf16", clip_grad_norm=0.5, loss_fn=lm_loss,
        optimizer=fused_adamw, devices=["cuda:0", "cuda:0"],
    )
    data = [(x.cuda(), y.cuda()) for x, y in text_batches(4)]
    pipe.train_step(*data[0])
    assert host_syncs(lambda: pipe.train_step(*data[1])) == 0


@needs_gpu
def test_a_nan_step_is_skipped_on_the_device_and_reported_when_read():
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=2, loss_fn=nn.functional.cross_entropy, optimizer=fused_sgd,
        devices=["cuda:0", "cuda:0"],
    )
    data = [(x.cuda(), y.cuda()) for x, y in batches(2)]
    pipe.train_step(*data[0])
    before = {k: v.clone() for k, v in pipe.module.state_dict().items()}
    x, y = data[1]
    x[0, 0] = float("nan")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe.train_step(x, y)
        assert pipe.metrics["skipped_step"] is True
    assert all(torch.equal(v, before[k]) for k, v in pipe.module.state_dict().items())
    assert any("step 2: non-finite" in str(w.message) for w in caught)


@needs_gpu
def test_host_copy_lands_without_a_sync():
    value = torch.arange(4.0, device="cuda") * 2
    copy = HostCopy(value)
    torch.cuda.synchronize()
    assert copy.ready() and copy.values() == [0.0, 2.0, 4.0, 6.0]
