"""Model shapes users write that once trained wrong or failed (issue 38), each trained by the
pipeline and in one process on the same mini-batch and compared (fp32, tolerance 1e-5 on every
parameter and 1e-6 on every loss, as test_distributed.py explains: reordered sums move results
by ~1e-7, a dropped layer or a wrong path by 1e-3 or more):

- a layer used more than once in one stage (the same module at several positions), and in two;
- an in-place op on a view of a weighted layer's output (the split backward's cuts);
- a stage whose input gets no gradient (it must send none: AdamW's weight decay then skips the
  previous stages' weights, as plain training does);
- a stage that begins with an in-place op, and an in-place first layer over micro-batches that
  are views of one tensor;
- frozen weights and a weighted layer returning its own input.

Each runs under every synchronous schedule (interleaved with two stages per rank) in threads,
with the schedule's own recomputation and with every micro-batch recomputed; ``-m slow`` adds
"except_last" and 4 micro-batches, and a sample runs in two gloo processes.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import pipetrain
from partitioner.planner import plan as make_plan
from pipetrain.runtime.planning import layer_signature, load_plan
from pipetrain.tools.profiler import profile
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import reference, sgd
from tests.runtime.test_schedule_registry import NAME as LIFO
from tests.runtime.test_schedule_registry import registered

TOLERANCE = 1e-5
SCHEDULES = ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"]


class Detach(nn.Module):
    """Cuts the gradient: what comes before it gets none from what comes after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.detach()


class Reshape(nn.Module):
    """A view of its input: flatten, view, slice or transpose (no copy, no weights)."""

    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "flatten":
            return x.flatten(1)
        if self.how == "view":
            return x.view(x.shape[0], -1)
        if self.how == "slice":
            return x[..., :3]
        return x.transpose(1, 2)


class Passing(nn.Module):
    """A layer with weights that returns its input itself (its weights get no gradient)."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def adamw(params):
    """Weight decay moves every weight that has a gradient, zeros included: a gradient sent
    where plain training has none shows."""
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


@dataclass
class Case:
    """A model (built fresh from a seed), its balance over 2 and over 4 stages, its input
    shape and optimizer."""

    build: Callable[[], nn.Sequential]
    balances: dict[int, list[int]]
    shape: tuple[int, ...]
    optimizer: Callable = sgd
    classes: int = 5

    def model(self) -> nn.Sequential:
        torch.manual_seed(0)
        return self.build()

    def data(self, steps: int = 2, batch: int = 8) -> list:
        g = torch.Generator().manual_seed(1)
        return [
            (torch.randn(batch, *self.shape, generator=g),
             torch.randint(0, self.classes, (batch,), generator=g))
            for _ in range(steps)
        ]


def _linear_twice() -> nn.Sequential:
    lin = nn.Linear(8, 8)
    return nn.Sequential(lin, nn.ReLU(), lin, nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))


def _block_four_times() -> nn.Sequential:
    block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    return nn.Sequential(nn.Linear(8, 8), *[block] * 4, nn.Linear(8, 5))


def _conv_twice() -> nn.Sequential:
    conv = nn.Conv2d(2, 2, 3, padding=1)
    return nn.Sequential(
        conv, nn.ReLU(), conv, nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 5)
    )


def _inplace_on_view(how: str) -> Callable[[], nn.Sequential]:
    def build() -> nn.Sequential:
        width = 4 * 3 if how == "slice" else 4 * 5
        return nn.Sequential(
            nn.Linear(5, 5), nn.Linear(5, 5), Reshape(how), nn.ReLU(inplace=True),
            nn.Flatten(), nn.Linear(width, 8), nn.Linear(8, 5),
        )
    return build


def _inplace_after_passing() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 5), Passing(5), Reshape("flatten"), nn.ReLU(inplace=True),
        nn.Linear(20, 8), nn.Linear(8, 8), nn.Linear(8, 5),
    )


def _detached() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 6), nn.Linear(6, 5), Detach(), nn.Linear(5, 5), nn.Linear(5, 5),
    )


def _inplace_start() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6), nn.ReLU(inplace=True),
        nn.Linear(6, 5),
    )


def _cnn_cut_before_relu() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(3, 3, 3, padding=1),
        nn.ReLU(inplace=True), nn.Flatten(), nn.Linear(3 * 4 * 4, 5),
    )


def _inplace_first_layer() -> nn.Sequential:
    return nn.Sequential(
        nn.ReLU(inplace=True), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Linear(6, 5),
    )


def _frozen() -> nn.Sequential:
    model = nn.Sequential(
        nn.Linear(6, 6), nn.ReLU(inplace=True), nn.Linear(6, 6), nn.Linear(6, 6),
        nn.Linear(6, 5),
    )
    for p in [model[0].weight, model[3].bias]:
        p.requires_grad_(False)
    return model


CASES = {
    # the same module at several positions of one stage (and, for the block, of two)
    "linear_twice": Case(_linear_twice, {2: [3, 3], 4: [3, 1, 1, 1]}, (8,)),
    "block_four_times": Case(_block_four_times, {2: [4, 2], 4: [3, 1, 1, 1]}, (8,)),
    "conv_twice": Case(_conv_twice, {2: [4, 2], 4: [3, 1, 1, 1]}, (2, 4, 4)),
    # an in-place op on a view of a weighted layer's output, inside a stage
    **{
        f"inplace_on_{how}": Case(_inplace_on_view(how), {2: [1, 6], 4: [1, 3, 2, 1]}, (4, 5))
        for how in ["flatten", "view", "slice", "transpose"]
    },
    "inplace_after_passing": Case(
        _inplace_after_passing, {2: [4, 3], 4: [4, 1, 1, 1]}, (4, 5), optimizer=adamw
    ),
    # stages 1 (of 2) and 2 (of 4) begin with Detach: earlier weights get no gradient at all
    "detached_stage_input": Case(_detached, {2: [2, 3], 4: [1, 1, 2, 1]}, (6,), adamw),
    # ... and end with it: nothing that crosses the boundary needs a gradient
    "detached_stage_output": Case(_detached, {2: [3, 2], 4: [1, 2, 1, 1]}, (6,), adamw),
    # stages that begin with an in-place op
    "inplace_stage_start": Case(_inplace_start, {2: [1, 4], 4: [1, 2, 1, 1]}, (6,)),
    "cnn_cut_before_relu": Case(_cnn_cut_before_relu, {2: [1, 5], 4: [1, 2, 1, 2]}, (2, 4, 4)),
    "inplace_first_layer": Case(_inplace_first_layer, {2: [3, 2], 4: [2, 1, 1, 1]}, (6,)),
    "frozen_weights": Case(_frozen, {2: [1, 4], 4: [1, 1, 2, 1]}, (6,), adamw),
}


def _train(case: Case, schedule: str, checkpoint: str | None, chunks: int,
           devices: bool = True) -> dict:
    """A fresh pipeline on 2 ranks (threads, or this process's group) trained 2 steps."""
    balance = case.balances[4 if schedule == "interleaved" else 2]
    pipe = pipetrain.Pipeline(
        case.model(), balance, chunks=chunks, schedule=schedule, recompute=checkpoint,
        loss_fn=nn.functional.cross_entropy, optimizer=case.optimizer, timeout=60,
        devices=["cpu", "cpu"] if devices else None,
    )
    losses = [pipe.train_step(x, y) for x, y in case.data()]
    return {"state": pipe.module.state_dict(), "losses": losses}


def assert_like_one_process(case: Case, per_rank: list[dict]) -> None:
    expected, losses = reference(copy.deepcopy(case.model()), case.data(), case.optimizer)
    seen = set()
    for result in per_rank:
        for key, value in result["state"].items():
            seen.add(key)
            diff = (value - expected[key]).abs().max().item()
            assert diff <= TOLERANCE, f"{key} differs by {diff}"
        assert result["losses"] == pytest.approx(losses, abs=1e-6)
    assert seen == set(expected), "the stages together must hold every key of the model"


@pytest.mark.parametrize("checkpoint", [None, "always"])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_one_process(name, schedule, checkpoint):
    case = CASES[name]
    assert_like_one_process(case, [_train(case, schedule, checkpoint, chunks=2)])


# interleaved needs a multiple of its 2 ranks of micro-batches
MORE_SETTINGS = [(schedule, checkpoint, chunks) for schedule in SCHEDULES
                 for checkpoint in ["never", "except_last"] for chunks in [1, 4]
                 if not (schedule == "interleaved" and chunks == 1)]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "checkpoint", "chunks"), MORE_SETTINGS)
@pytest.mark.parametrize("name", list(CASES))
def test_trains_like_one_process_more_settings(name, schedule, checkpoint, chunks):
    case = CASES[name]
    assert_like_one_process(case, [_train(case, schedule, checkpoint, chunks)])


@pytest.mark.parametrize(
    "name", ["linear_twice", "inplace_on_flatten", "detached_stage_input", "inplace_stage_start"]
)
def test_one_rank_holding_every_stage(name):
    """Interleaved, 4 stages on one rank: every boundary is a hand-over in memory (a gradient
    that is not sent is known there, without a header)."""
    case = CASES[name]
    pipe = pipetrain.Pipeline(
        case.model(), case.balances[4], chunks=2, schedule="interleaved",
        loss_fn=nn.functional.cross_entropy, optimizer=case.optimizer, devices=["cpu"],
    )
    losses = [pipe.train_step(x, y) for x, y in case.data()]
    assert_like_one_process(case, [{"state": pipe.module.state_dict(), "losses": losses}])


@pytest.mark.parametrize("name", ["detached_stage_input", "inplace_on_flatten"])
def test_a_schedule_that_backpropagates_the_last_micro_batch_first(name):
    """The header of which gradients are there comes with the sending stage's first
    backward, whichever micro-batch that is (here the last: gpipe-lifo)."""
    with registered():
        result = _train(CASES[name], LIFO, None, chunks=4)
    assert_like_one_process(CASES[name], [result])


class DetachEveryOther(nn.Module):
    """Detaches at every second call: micro-batches differ in what they backpropagate to."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.detach() if self.calls % 2 == 0 else x


def test_micro_batches_that_differ_in_their_gradients_are_refused():
    """The header of which gradients a message holds comes with micro-batch 0's: a later
    micro-batch with other ones is a clear error, not a silent zero or a hang."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), DetachEveryOther(), nn.Linear(6, 5))
    pipe = pipetrain.Pipeline(
        model, [1, 2], chunks=2, schedule="1f1b", loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, devices=["cpu", "cpu"], timeout=20,
    )
    x, y = CASES["detached_stage_input"].data()[0]
    with pytest.raises(pipetrain.StageError, match="must backpropagate to the same stage"):
        pipe.train_step(x, y)


PROCESS_SAMPLE = [("linear_twice", "zb-h1"), ("inplace_on_flatten", "1f1b"),
                  ("detached_stage_input", "1f1b"), ("detached_stage_input", "zb-h2"),
                  ("detached_stage_output", "gpipe"),
                  ("inplace_stage_start", "gpipe"), ("block_four_times", "interleaved")]


def _sample(rank: int, world: int) -> dict:
    return {
        (name, schedule): _train(CASES[name], schedule, None, chunks=2, devices=False)
        for name, schedule in PROCESS_SAMPLE
    }


def test_processes_train_like_one_process():
    """Two gloo processes: a gradient that is not sent crosses a real link."""
    results = values(run_ranks(_sample, 2, deadline=300))
    for name, schedule in PROCESS_SAMPLE:
        assert_like_one_process(CASES[name], [r[name, schedule] for r in results])


def test_zero_bubble_one_stage_inplace_on_flatten():
    """The issue's smallest case: one stage, one micro-batch, input (B, 4, 5)."""
    def build() -> nn.Sequential:
        return nn.Sequential(nn.Linear(5, 5), nn.Flatten(), nn.ReLU(inplace=True),
                             nn.Linear(20, 5))

    case = Case(build, {}, (4, 5))
    pipe = pipetrain.Pipeline(
        case.model(), [4], chunks=1, schedule="zb-h1", loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, devices=["cpu"],
    )
    losses = [pipe.train_step(x, y) for x, y in case.data()]
    assert_like_one_process(case, [{"state": pipe.module.state_dict(), "losses": losses}])


@pytest.mark.parametrize("name", ["linear_twice", "block_four_times", "conv_twice"])
def test_eval_runs_a_repeated_layer_every_time(name):
    case = CASES[name]
    x = case.data()[0][0]
    with torch.no_grad():
        expected = case.model().eval()(x)
    pipe = pipetrain.Pipeline(case.model(), case.balances[2], chunks=2, devices=["cpu", "cpu"])
    assert (pipe.eval_step(x) - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("name", ["linear_twice", "block_four_times", "conv_twice"])
def test_profile_and_plan_count_a_repeated_layer_at_each_position(name):
    """One entry per position, as the model runs it: names, parameter counts, times."""
    case = CASES[name]
    model = case.model()
    names, counts = layer_signature(model)
    assert len(names) == len(counts) == len(model)
    assert names[0].startswith("0:") and names[-1].startswith(f"{len(model) - 1}:")
    measured = profile(model, case.data()[0][0], warmup=0, repeats=1)
    assert measured.names == names
    assert [layer.param_count for layer in measured.layers] == counts
    planned = make_plan(measured, stages=2, microbatches=2)
    assert sum(load_plan(planned, model).balance) == len(model)
