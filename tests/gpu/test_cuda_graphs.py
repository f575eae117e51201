"""CUDA graphs (pipetrain/runtime/cuda_graphs.py) on a GPU: the graphed pipeline trains to the eager
pipeline's parameters.

Tolerance: 1e-6 absolute in fp32 (TF32 off, tests/gpu/conftest.py), 1e-4 under bf16 autocast.
A replay runs the kernels the eager forward and backward launched, on the same inputs, with the
same dropout masks (each replay's philox seed and offset are the stage stream's, as eagerly), so
the results are expected to be bitwise equal; the tolerance leaves room only for cuBLAS picking
another algorithm while capturing (its workspace there is the capture stream's), which moves
fp32 results by a few units in the last place and bf16 ones by a few bf16 ulps of the
gradients, times the learning rate. Each test prints the largest difference it saw, so a run
shows whether it was bitwise.

Without a GPU every test is skipped with its reason; run ``python -m pytest tests/gpu -q -rs``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from examples.models import lm_loss
from tests.runtime.models import batches, mlp, text_batches, tiny_gpt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
STEPS = 4
TOLERANCE = {"fp32": 1e-6, "bf16": 1e-4}
LAYOUTS = {  # balance per model, one stage and two stages (both on cuda:0)
    "mlp": ([13], [4, 9]),
    "gpt": ([5], [2, 3]),
}


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _setup(model_name: str):
    """A fresh model (dropout on), its loss and the data on cuda:0."""
    if model_name == "mlp":
        base = mlp()  # its tuple boundary holds a tensor without gradient and an integer one
        model = nn.Sequential(*base[:-1], nn.Dropout(0.1), base[-1])
        data, loss = batches(STEPS), nn.functional.cross_entropy
    else:
        model, data, loss = tiny_gpt(dropout=0.1), text_batches(STEPS), lm_loss
    return model, loss, [(x.cuda(), y.cuda()) for x, y in data]


def _train(model_name: str, balance, schedule: str, graphs, precision: str = "fp32",
           data=None):
    model, loss, default = _setup(model_name)
    torch.manual_seed(7)  # the stages' random streams
    pipe = pipetrain.Pipeline(
        model, balance, chunks=4, schedule=schedule, recompute="never", loss_fn=loss,
        optimizer=_sgd, devices=["cuda:0"] * len(balance), cuda_graphs=graphs,
        precision=precision, clip_grad_norm=1.0 if precision == "bf16" else None,
    )
    # train_step returns the loss as a 0-d device tensor: read it as a float for approx
    losses = [float(pipe.train_step(x, y)) for x, y in (data or default)]
    state = {k: v.detach().float().cpu() for k, v in pipe.module.state_dict().items()}
    return pipe, state, losses


def _largest_difference(got: dict, want: dict) -> float:
    assert got.keys() == want.keys()
    return max((got[k] - want[k]).abs().max().item() for k in want)


def _check_same(model_name, balance, schedule, precision="fp32", data=None):
    pipe, graphed, losses = _train(model_name, balance, schedule, True, precision, data)
    _, eager, eager_losses = _train(model_name, balance, schedule, False, precision, data)
    diff = _largest_difference(graphed, eager)
    print(f"\n{model_name} {balance} {schedule} {precision}: largest parameter difference "
          f"graphed vs eager {diff:.3g}, losses {losses} vs {eager_losses}")
    assert diff <= TOLERANCE[precision]
    assert losses == pytest.approx(eager_losses, abs=TOLERANCE[precision] * 10)
    return pipe


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
def test_graphed_pipeline_trains_as_eager(model_name, stages, schedule):
    balance = LAYOUTS[model_name][stages - 1]
    pipe = _check_same(model_name, balance, schedule)
    for stage in pipe.stages:  # the first step ran eagerly, every later forward replayed
        assert stage.graphs is not None and stage.graphs.captured == 1
        assert stage.graphs.replays == (STEPS - 1) * pipe.chunks


def test_graphed_gpt_in_bf16_with_clipping_trains_as_eager():
    _check_same("gpt", [2, 3], "1f1b", precision="bf16")


def test_a_new_shape_is_captured_anew():
    """Sequences of another length: that step runs eagerly and its shape is captured too."""
    data = text_batches(2) + text_batches(2, length=6, seed=5) + text_batches(1, seed=6)
    pipe = _check_same("gpt", [2, 3], "1f1b", data=[(x.cuda(), y.cuda()) for x, y in data])
    assert [stage.graphs.captured for stage in pipe.stages] == [2, 2]

