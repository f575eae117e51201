"""The loss train_step returns: a device tensor that number-minded code takes as a number."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

from pipetrain.runtime.readback import StepLoss, step_loss


def _loss(value: float) -> StepLoss:
    return step_loss(torch.tensor(value, dtype=torch.float64))


def test_a_step_loss_reads_as_a_number() -> None:
    loss = _loss(1.5)
    assert f"{loss:.2f}" == "1.50"
    assert float(loss) == 1.5 and math.isclose(loss, 1.5)
    assert [loss, _loss(2.0)] == pytest.approx([1.5000001, 2.0], abs=1e-6)
    assert 1.5000001 == pytest.approx(loss, abs=1e-6)
    assert not [loss] == pytest.approx([1.6], abs=1e-6)


def test_a_step_loss_rounds_as_a_float() -> None:
    loss = _loss(2.34567)
    assert round(loss, 3) == 2.346 and type(round(loss, 3)) is float
    assert round(loss) == 2 and type(round(loss)) is int
    assert math.trunc(_loss(-2.7)) == -2 and math.floor(loss) == 2 and math.ceil(loss) == 3


def test_a_step_loss_saves_as_a_plain_tensor_and_copies_as_itself() -> None:
    buffer = io.BytesIO()
    torch.save({"losses": [_loss(1.5)]}, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)["losses"][0]
    assert type(loaded) is torch.Tensor and loaded.item() == 1.5
    copied = copy.deepcopy(_loss(2.5))
    assert isinstance(copied, StepLoss) and copied.item() == 2.5
