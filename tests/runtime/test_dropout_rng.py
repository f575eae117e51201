"""Dropout under activation recomputation: the backward sees the masks the forward drew.

Each stage draws from its own random stream (pipetrain/runtime/rng.py), seeded from the global
generator when the pipeline is built, and a recomputed micro-batch replays its forward's stream.
So, with the same ``torch.manual_seed`` before building, every checkpoint mode, every synchronous
schedule and both modes (stages as threads of one process, or one process per stage) draw the same
masks and train to the same parameters; "never" keeps the forward's masks in autograd's graph, so
its gradients are right by construction and the others must equal them. Tolerance 1e-6 (fp32): the
same float operations run in the same order, so the runs agree to the last bit or nearly; one
wrong mask moves a parameter by about 1e-2.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, sgd
from tests.runtime.test_local import pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-6
SEED = 7


def dropout_model(width: int = 12, classes: int = 5) -> nn.Sequential:
    """8 layers with dropout in every half, so that every stage draws random numbers."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Dropout(0.5), nn.Linear(width, width),
        nn.Dropout(0.3), nn.Linear(width, width), nn.Dropout(0.5), nn.Linear(width, classes),
    )


# balance per schedule: interleaved runs 4 stages on 2 ranks (stage c*2+r on rank r)
LAYOUTS = {
    "1f1b": ([3, 2, 2, 1], 4),
    "gpipe": ([3, 2, 2, 1], 4),
    "zb-h1": ([3, 2, 2, 1], 4),
    "interleaved": ([3, 2, 2, 1], 2),
}


def train(
    schedule: str, checkpoint: str, devices: list[str] | None = None, steps: int = 2
) -> dict[str, torch.Tensor]:
    """The parameters after ``steps`` steps (on the CPU), with ``devices`` (default: one CPU
    per rank of the schedule's layout)."""
    balance, ranks = LAYOUTS[schedule]
    model = dropout_model()
    torch.manual_seed(SEED)  # the stages' streams are drawn from it
    pipe = pipetrain.Pipeline(
        model, balance, chunks=4, schedule=schedule, recompute=checkpoint,
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, devices=devices or ["cpu"] * ranks,
    )
    for x, y in batches(steps):
        pipe.train_step(x, y)
    return {k: v.detach().cpu().clone() for k, v in pipe.module.state_dict().items()}


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=TOLERANCE, msg=key)


@pytest.fixture(scope="module")
def without_recomputation() -> dict[str, torch.Tensor]:
    return train("1f1b", "never")


@pytest.mark.parametrize("schedule", list(LAYOUTS))
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_stages_in_threads_train_as_without_recomputation(
    schedule, checkpoint, without_recomputation
):
    assert_same(train(schedule, checkpoint), without_recomputation)


class RecordingDropout(nn.Module):
    """Dropout that notes, per input it sees, every mask it drew for it: a recomputation sees
    the same input as its forward and must draw the same mask."""

    def __init__(self, p: float):
        super().__init__()
        self.p = p
        self.masks: dict[bytes, list[torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.rand_like(x) >= self.p).to(x.dtype)
        self.masks.setdefault(x.detach().numpy().tobytes(), []).append(mask)
        return x * mask / (1 - self.p)


@pytest.mark.parametrize("checkpoint", ["except_last", "always"])
def test_a_recomputation_draws_the_mask_its_forward_drew(checkpoint):
    torch.manual_seed(0)
    drops = [RecordingDropout(0.5) for _ in range(3)]
    layers = [nn.Linear(12, 12), drops[0], nn.Linear(12, 12), drops[1], nn.Linear(12, 12),
              drops[2], nn.Linear(12, 5)]
    pipe = pipeline(nn.Sequential(*layers), [2, 2, 3], chunks=4, recompute=checkpoint)
    for x, y in batches(2):
        pipe.train_step(x, y)
    recomputed = 0
    for stage, drop in enumerate(drops):
        for masks in drop.masks.values():
            recomputed += len(masks) - 1
            for again in masks[1:]:
                assert torch.equal(again, masks[0]), f"stage {stage} recomputed another mask"
    assert recomputed == 3 * 2 * (4 if checkpoint == "always" else 3)  # stages x steps x chunks


def test_resume_from_a_checkpoint_continues_the_streams(tmp_path):
    data = batches(2)
    torch.manual_seed(SEED)
    pipe = pipeline(dropout_model(), [3, 2, 2, 1], chunks=4, recompute="always")
    pipe.train_step(*data[0])
    pipe.save(tmp_path)
    pipe.train_step(*data[1])
    torch.manual_seed(SEED + 1)  # other streams: only the checkpoint's can give the same step
    resumed = pipeline(dropout_model(), [3, 2, 2, 1], chunks=4, recompute="always",
                       checkpoint_dir=tmp_path)
    resumed.train_step(*data[1])
    assert_same(resumed.module.state_dict(), pipe.module.state_dict())


def _one_process_per_stage(rank: int, world: int, checkpoint: str) -> dict[str, torch.Tensor]:
    model = dropout_model()
    torch.manual_seed(SEED)  # every process draws every stage's seed, as the threads do
    pipe = pipetrain.Pipeline(
        model, [5, 3], chunks=4, recompute=checkpoint, loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, timeout=60,
    )
    for x, y in batches(2):
        pipe.train_step(x, y)
    return pipe.module.state_dict()


def test_one_process_per_stage_trains_as_stages_in_threads():
    """gloo processes with recomputation of every micro-batch reach the parameters of the
    threads without recomputation (same seed, hence the same streams)."""
    torch.manual_seed(SEED)
    model = dropout_model()
    torch.manual_seed(SEED)
    threads = pipeline(model, [5, 3], chunks=4, recompute="never")
    for x, y in batches(2):
        threads.train_step(x, y)
    parts = values(run_ranks(_one_process_per_stage, 2, "always"))
    assert_same({k: v for part in parts for k, v in part.items()}, threads.module.state_dict())
