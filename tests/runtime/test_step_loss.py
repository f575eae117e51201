"""The loss train_step returns: a plain 0-d float64 tensor, read only when the caller reads it."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

import pipetrain
from tests.runtime.models import batches, mlp, reference, sgd


def _losses() -> tuple[list[torch.Tensor], list[float]]:
    data = batches(2)
    pipe = pipetrain.Pipeline(mlp(), [6, 6], devices=["cpu", "cpu"], chunks=2,
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    return [pipe.train_step(x, y) for x, y in data], reference(mlp(), data)[1]


def test_the_loss_is_a_plain_detached_0d_float64_tensor_that_reads_as_a_number() -> None:
    losses, expected = _losses()
    loss = losses[0]
    assert type(loss) is torch.Tensor and loss.dim() == 0 and loss.dtype == torch.float64
    assert not loss.requires_grad
    value = float(loss)
    assert f"{loss:.3f}" == f"{value:.3f}" and loss.item() == value
    assert bool(loss < value + 1) and not bool(loss > value) and math.isclose(loss, value)
    assert losses == pytest.approx(expected, abs=1e-6)
    assert float(loss) == pytest.approx(expected[0], abs=1e-6)
    assert round(float(loss), 3) == round(expected[0], 3)
    assert loss.round(decimals=3).item() == pytest.approx(round(expected[0], 3))
    with pytest.raises(TypeError):  # Python's round() takes no tensor: round float(loss)
        round(loss, 3)  # type: ignore[call-overload]


def test_the_losses_save_and_load_with_weights_only() -> None:
    losses, _ = _losses()
    buffer = io.BytesIO()
    torch.save({"losses": losses}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["losses"]
    assert [x.item() for x in loaded] == [x.item() for x in losses]
