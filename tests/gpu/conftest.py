"""Shared by the GPU tests: matrix products in true fp32 (TF32 off), so that a pipeline on the
GPU and its single-process reference agree to the fp32 tolerance."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def true_fp32() -> Iterator[None]:
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
