"""A model that reads a value on the host inside its forward cannot be captured as a CUDA
graph: ``cuda_graphs=True`` says so with the reason, ``"auto"`` trains that stage eagerly to the
eager parameters (1e-6, fp32, TF32 off: the same eager kernels on both sides).

In a file of its own that runs after the other GPU tests: a failed capture is the one place
where the CUDA state could be left in disorder (pipetrain takes the default CUDA generator back
out of capture mode after one), and nothing else should depend on it.
Without a GPU every test is skipped with its reason; run ``python -m pytest tests/gpu -q -rs``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.errors import StageError
from tests.gpu.test_cuda_graphs import TOLERANCE, _largest_difference, _sgd
from tests.runtime.models import batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class _HostSync(nn.Module):
    """Reads a value on the host mid-forward, which a CUDA graph cannot hold."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (1.0 if x.abs().max().item() > 0 else 0.0)


def _host_sync_model() -> nn.Sequential:
    """With dropout: after the failed capture its eager forwards still draw random numbers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(12, 12), _HostSync(), nn.ReLU(), nn.Dropout(0.1), nn.Linear(12, 5)
    )


def test_host_sync_in_the_model_is_refused_with_the_reason():
    pipe = pipetrain.Pipeline(
        _host_sync_model(), [5], chunks=2, loss_fn=nn.functional.cross_entropy,
        optimizer=_sgd, devices=["cuda:0"], cuda_graphs=True,
    )
    x, y = batches(1)[0]
    with pytest.raises(StageError, match="host synchronisations"):
        pipe.train_step(x.cuda(), y.cuda())


def test_auto_runs_a_stage_with_a_host_sync_eagerly():
    """Also checks that the failed capture left the CUDA generator usable: a capture that fails
    used to leave it in capture mode, so the next dropout outside a capture raised "Offset
    increment outside graph capture" (and so did every later test in the process)."""
    results, pipes = [], []
    for graphs in ("auto", False):
        pipe = pipetrain.Pipeline(
            _host_sync_model(), [5], chunks=2, loss_fn=nn.functional.cross_entropy,
            optimizer=_sgd, devices=["cuda:0"], cuda_graphs=graphs,
        )
        for x, y in batches(3):
            pipe.train_step(x.cuda(), y.cuda())
        results.append({k: v.float().cpu() for k, v in pipe.module.state_dict().items()})
        pipes.append(pipe)
    graphs = pipes[0].stages[0].graphs
    assert graphs is not None and graphs.eager_only and graphs.replays == 0
    assert _largest_difference(*results) <= TOLERANCE["fp32"]
