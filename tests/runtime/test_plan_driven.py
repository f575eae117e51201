"""A plan file drives the runtime: profile a real model, plan it, and train it from the plan in
one process (a thread per stage), across two gloo processes, and as a search's plan of 2 copies
of the pipeline at zero 2 across four; the parameters must equal single-process training (max
abs diff 1e-5, as in test_distributed.py and test_zero.py: micro-batches and replicas only
change the order in which a mini-batch's gradients are summed). A plan made for another model
is refused, naming the difference, and so are options that contradict the plan."""

from __future__ import annotations

import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import pipetrain
from examples.models import resnet_like
from partitioner import PlanMismatchError
from partitioner import plan as make_plan
from pipetrain.runtime.config import PipelineConfig
from tests.runtime.harness import run_ranks, values

TOLERANCE = 1e-5
WIDTH, BATCH, SIDE, CHUNKS, STEPS = 8, 8, 8, 4, 3


pytestmark = pytest.mark.usefixtures("one_thread")


def model() -> nn.Sequential:
    return resnet_like(width=WIDTH)  # GroupNorm: micro-batches train like the whole batch


def data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randn(BATCH, 3, SIDE, SIDE, generator=g),
            torch.randint(0, 10, (BATCH,), generator=g),
        )
        for _ in range(steps)
    ]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@pytest.fixture(scope="module")
def measured():
    sample = torch.randn(BATCH // CHUNKS, 3, SIDE, SIDE)
    return pipetrain.profile(model(), sample, warmup=0, repeats=1)  # the documented entry


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory, measured):
    plan = make_plan(measured, stages=2, microbatches=CHUNKS, schedule="1f1b")
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(path)
    return path


def reference(steps: int = STEPS) -> tuple[dict, list[float]]:
    net, losses = model(), []
    opt = sgd(net.parameters())
    for x, y in data(steps):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return net.state_dict(), losses


def assert_same_state(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert (state[key] - value).abs().max().item() <= TOLERANCE, key


def test_plan_drives_an_in_process_pipeline(plan_path):
    pipe = pipetrain.Pipeline(
        model(),
        plan=plan_path,
        devices=["cpu", "cpu"],
        loss_fn=nn.functional.cross_entropy,
        optimizer=sgd,
    )
    plan = pipetrain.runtime.planning.load_plan(plan_path, model())
    assert pipe.balance == plan.balance and pipe.chunks == CHUNKS
    assert pipe.schedule.name == "1f1b"
    losses = [pipe.train_step(x, y) for x, y in data()]
    expected_state, expected_losses = reference()
    assert_same_state(pipe.module.state_dict(), expected_state)
    assert losses == pytest.approx(expected_losses, abs=1e-6)


@pytest.mark.parametrize(("schedule", "stages"), [("zb-h1", 2), ("interleaved", 4)])
def test_a_plan_for_a_split_backward_or_interleaved_schedule_trains(
    tmp_path, measured, schedule, stages
):
    """zb-h1 runs each backward as B and W; interleaved runs the plan's 4 stages on 2 devices."""
    path = tmp_path / "plan.json"
    make_plan(measured, stages=stages, microbatches=CHUNKS, schedule=schedule).save(path)
    pipe = pipetrain.Pipeline(
        model(), plan=path, devices=["cpu", "cpu"], loss_fn=nn.functional.cross_entropy,
        optimizer=sgd,
    )
    assert pipe.schedule.name == schedule and len(pipe.balance) == stages
    assert pipe.schedule.ranks == 2
    losses = [pipe.train_step(x, y) for x, y in data()]
    expected_state, expected_losses = reference()
    assert_same_state(pipe.module.state_dict(), expected_state)
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    if schedule == "interleaved":
        with pytest.raises(ValueError, match="on 2 ranks but this pipeline has 4; pass 2 devices"):
            pipetrain.Pipeline(model(), plan=path, devices=["cpu"] * 4)


def _train_from_plan(rank: int, world: int, path: str) -> dict:
    pipe = pipetrain.Pipeline(
        model(), plan=path, loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60
    )
    losses = [pipe.train_step(x, y) for x, y in data()]
    return {
        "state": pipe.module.state_dict(), "losses": losses, "balance": pipe.balance,
        "checkpoint": pipe.stages[0].recompute_below,
    }


@pytest.fixture(scope="module")
def mixed_plan_path(tmp_path_factory, measured):
    """A GPipe plan whose first stage keeps its activations and whose second recomputes them,
    as the planner chooses under a cap that only the second stage's activations break."""
    planned = make_plan(measured, stages=2, microbatches=CHUNKS, schedule="gpipe")
    stages = [planned.per_stage[0], replace(planned.per_stage[1], checkpoint="always")]
    path = tmp_path_factory.mktemp("mixed") / "plan.json"
    replace(planned, per_stage=stages).save(path)
    return path


def test_a_plan_recomputing_on_one_stage_trains_exactly(mixed_plan_path):
    """Each stage runs the plan's own mode (stage 1's ledger keeps fewer bytes than without
    recomputation, stage 0's the same), and training equals one process (1e-5: fp32, only the
    summation order of micro-batch gradients differs)."""
    x, y = data(1)[0]

    def pipeline(**options) -> pipetrain.Pipeline:
        return pipetrain.Pipeline(
            model(), plan=mixed_plan_path, devices=["cpu", "cpu"], track_memory=True,
            loss_fn=nn.functional.cross_entropy, optimizer=sgd, **options,
        )

    pipe = pipeline()
    assert pipe.recompute == ("never", "always")
    assert [s.recompute_below for s in pipe.stages] == [0, CHUNKS]  # "never", "always"
    losses = [pipe.train_step(x, y) for x, y in data()]
    expected_state, expected_losses = reference()
    assert_same_state(pipe.module.state_dict(), expected_state)
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    keeping = pipeline(recompute="never")
    keeping.train_step(x, y)
    fresh = pipeline(recompute=["never", "always"])
    fresh.train_step(x, y)
    kept = [[s.ledger.peak_bytes for s in p.stages] for p in (fresh, keeping)]
    assert kept[0][0] == kept[1][0] and kept[0][1] < kept[1][1]
    with pytest.raises(ValueError, match="recompute lists 3 modes for 2 stages"):
        pipeline(recompute=["always", "never", "never"])


def test_a_plan_recomputing_on_one_stage_trains_exactly_in_processes(mixed_plan_path):
    per_rank = values(run_ranks(_train_from_plan, 2, str(mixed_plan_path), deadline=90))
    assert [r["checkpoint"] for r in per_rank] == [0, CHUNKS]  # "never", "always"
    state = {**per_rank[0]["state"], **per_rank[1]["state"]}
    expected_state, expected_losses = reference()
    assert_same_state({k: state[k] for k in expected_state}, expected_state)
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected_losses, abs=1e-6)


def test_plan_drives_two_gloo_processes(plan_path):
    per_rank = values(run_ranks(_train_from_plan, 2, str(plan_path), deadline=90))
    state = {**per_rank[0]["state"], **per_rank[1]["state"]}
    expected_state, expected_losses = reference()
    assert_same_state({k: state[k] for k in expected_state}, expected_state)
    assert len(state) == len(expected_state)
    for result in per_rank:
        assert result["losses"] == pytest.approx(expected_losses, abs=1e-6)
    assert len(per_rank[0]["state"]) > 0 and len(per_rank[1]["state"]) > 0


def _swap_layer(net: nn.Sequential) -> nn.Sequential:
    net[2] = nn.GELU()  # was ReLU
    return net


@pytest.mark.parametrize(
    ("other", "message"),
    [
        (lambda: _swap_layer(model()), r"layer 2 is named '2:GELU' in the model but '2:ReLU'"),
        (
            lambda: resnet_like(width=WIDTH, classes=7),
            r"layer 15 \('15:Linear'\) has 119 parameters in the model but 170 in the plan",
        ),
        (
            lambda: nn.Sequential(*list(model())[:-1]),
            r"the model has 15 layers but the plan was made for 16 layers",
        ),
    ],
    ids=["changed-layer", "param-count", "layer-count"],
)
def test_a_plan_for_another_model_is_refused(plan_path, other, message):
    with pytest.raises(PlanMismatchError, match=message):
        pipetrain.Pipeline(
            other(),
            plan=plan_path,
            devices=["cpu", "cpu"],
            loss_fn=nn.functional.cross_entropy,
            optimizer=sgd,
        )


def test_training_other_micro_batches_than_the_plan_warns_once(plan_path):
    """The plan was profiled on micro-batches of BATCH // CHUNKS samples; a mini-batch of
    another size makes other micro-batches than its predictions are for."""
    pipe = pipetrain.Pipeline(model(), plan=plan_path, devices=["cpu", "cpu"],
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    x, y = data(1)[0]
    with pytest.warns(UserWarning, match=rf"micro-batches of {BATCH // CHUNKS} samples but "
                      rf"this step's are {2 * BATCH // CHUNKS} .*mini-batches of {BATCH}"):
        pipe.train_step(torch.cat([x, x]), torch.cat([y, y]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.train_step(x, y)  # checked once, at the first step


def test_training_the_planned_micro_batches_is_silent(plan_path):
    pipe = pipetrain.Pipeline(model(), plan=plan_path, devices=["cpu", "cpu"],
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.train_step(*data(1)[0])


@pytest.fixture(scope="module")
def copies_path(tmp_path_factory, measured):
    """A plan as the search makes one: 2 stages in 2 copies of the pipeline at zero 2,
    reduce-scattering per micro-batch; each copy trains 2 micro-batches of BATCH // CHUNKS
    samples, half of every mini-batch."""
    planned = make_plan(measured, stages=2, microbatches=2, schedule="1f1b", zero=2,
                        reduce_scatter="microbatch", data_parallel=2)
    path = tmp_path_factory.mktemp("copies") / "plan.json"
    planned.save(path)
    return path


def _train_a_copy(rank: int, world: int, path: str) -> dict:
    """One step of this rank's copy on its half of the mini-batch: the whole parameters after
    it, what the pipeline resolved, and its stage's parameter elements here and in all."""
    pipe = pipetrain.Pipeline(
        model(), plan=path, loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60
    )
    x, y = data(1)[0]
    share = BATCH // pipe.placement.replicas
    rows = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
    loss = pipe.train_step(x[rows], y[rows])
    params = list(pipe.stages[0].module.parameters())
    return {
        "state": {k: v.full_tensor() if isinstance(v, DTensor) else v
                  for k, v in pipe.module.state_dict().items()},
        "loss": float(loss),
        "resolved": (pipe.config.zero, pipe.config.reduce_scatter, pipe.placement.replicas),
        "local": sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in params),
        "whole": sum(p.numel() for p in params),
    }


def test_a_plan_of_copies_at_zero_2_trains_as_one_process(copies_path):
    """4 gloo processes from the plan alone: it runs 2 replicas at zero 2, reduce-scattering
    per micro-batch, each rank holding a shard of its stage's weights, and its step gives the
    parameters and loss of one process training the whole mini-batch."""
    per_rank = values(run_ranks(_train_a_copy, 4, str(copies_path), deadline=240))
    expected_state, (expected_loss,) = reference(steps=1)
    for result in per_rank:
        assert result["resolved"] == (2, "microbatch", 2)
        assert result["local"] < result["whole"]  # sharded over the 2 replicas
        assert result["loss"] == pytest.approx(expected_loss, abs=1e-6)
    state = {**per_rank[0]["state"], **per_rank[1]["state"]}  # replica 0's two stages
    assert_same_state({k: state[k] for k in expected_state}, expected_state)
    for replica in per_rank[2:]:
        for key, value in replica["state"].items():
            assert (value - state[key]).abs().max().item() <= TOLERANCE, key


def _join_too_few(rank: int, world: int, path: str) -> None:
    pipetrain.Pipeline(model(), plan=path, timeout=60)


def test_a_world_of_other_than_the_plans_processes_is_refused(copies_path):
    for status, (kind, message, _) in run_ranks(_join_too_few, 2, str(copies_path), deadline=90):
        assert status == "error" and kind == "ValueError"
        assert "world size 2 does not match the 2 stages of balance x 2 replicas" in message
        assert "launch 4 processes" in message


@pytest.mark.parametrize(("options", "message"), [
    ({"zero": 0}, r"zero=0 contradicts the plan's zero 2, .*leave zero= out to run the plan's, "
     r"or plan for zero=0 \(`pipetrain plan PROFILE --devices N --batch-size B --zero 0`\)"),
    ({"zero": 2, "reduce_scatter": "step"}, r"reduce_scatter='step' contradicts the plan's "
     r"reduce_scatter 'microbatch'.*--reduce-scatter step"),
    ({"replicas": 4}, r"replicas=4 contradicts the plan's data_parallel 2, .*"
     r"`pipetrain plan PROFILE --devices 8 --batch-size B --stages 2`"),
    ({"devices": ["cpu", "cpu"]}, r"the plan runs 2 copies of its pipeline, a process per "
     r"rank, but devices= runs one copy in this process: start its 4 processes"),
])
def test_options_contradicting_the_plans_copies_and_zero_are_refused(copies_path, options,
                                                                     message):
    with pytest.raises(ValueError, match=message):
        PipelineConfig.resolve(model(), plan=copies_path, **options)


def test_options_agreeing_with_the_plan_are_taken_and_left_out_are_the_plans(copies_path):
    agreed = PipelineConfig.resolve(model(), plan=copies_path, zero=2, replicas=2,
                                    reduce_scatter="microbatch")
    assert agreed == PipelineConfig.resolve(model(), plan=copies_path)
    assert (agreed.zero, agreed.reduce_scatter, agreed.planned_replicas) == (2, "microbatch", 2)
