"""The single-process multi-device mode: every stage a thread of this process, same schedules.

Same tolerance and reasoning as test_distributed.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.runtime.config import recompute_below
from tests.runtime.models import batches, mlp, reference, sgd
from tests.runtime.test_distributed import BALANCES, CHECKPOINTS, CHUNKS, SCHEDULES, TOLERANCE


def pipeline(model: nn.Sequential, balance, **options) -> pipetrain.Pipeline:
    options.setdefault("loss_fn", nn.functional.cross_entropy)
    options.setdefault("optimizer", sgd)
    return pipetrain.Pipeline(model, balance, devices=["cpu"] * len(balance), **options)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
def test_parameters_match_single_process_training(stages, schedule, checkpoint):
    data = batches(3)
    pipe = pipeline(
        mlp(), BALANCES[stages], chunks=CHUNKS[stages], schedule=schedule, recompute=checkpoint
    )
    losses = [pipe.train_step(x, y) for x, y in data]
    expected_state, expected_losses = reference(mlp(), data)
    state = pipe.module.state_dict()
    assert list(state) == list(expected_state), "keys are the full model's, in order"
    for key, value in state.items():
        assert (value - expected_state[key]).abs().max().item() <= TOLERANCE, key
    assert losses == pytest.approx(expected_losses, abs=1e-6)


def test_module_slices_keep_the_model_keys():
    model = mlp()
    pipe = pipeline(copy.deepcopy(model), [5, 7])
    assert list(pipe.stages[1].module.state_dict()) == [
        k for k in model.state_dict() if int(k.split(".")[0]) >= 5
    ]


def test_eval_step_restores_training_mode_and_matches_the_model():
    model = mlp()
    pipe = pipeline(copy.deepcopy(model), [6, 6], chunks=4)
    x = batches(1)[0][0]
    with torch.no_grad():
        expected = model.eval()(x)
    assert (pipe.eval_step(x) - expected).abs().max().item() <= TOLERANCE
    assert all(stage.module.training for stage in pipe.stages)


def test_adam_and_tuple_inputs_on_the_first_stage():
    class Add(nn.Module):
        def forward(self, pair):
            return pair[0] + pair[1]

    torch.manual_seed(0)
    model = nn.Sequential(Add(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3))
    ref = copy.deepcopy(model)

    def adam(params):
        return torch.optim.Adam(params, lr=0.01)

    pipe = pipeline(model, [2, 2], chunks=2, optimizer=adam)
    opt = adam(ref.parameters())
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        a, b = torch.randn(6, 4, generator=g), torch.randn(6, 4, generator=g)
        y = torch.randint(0, 3, (6,), generator=g)
        pipe.train_step((a, b), y)
        opt.zero_grad()
        nn.functional.cross_entropy(ref((a, b)), y).backward()
        opt.step()
    for key, value in ref.state_dict().items():
        assert (pipe.module.state_dict()[key] - value).abs().max().item() <= TOLERANCE


def test_checkpoint_default_follows_the_schedule():
    """GPipe recomputes all but the last micro-batch unless told otherwise; 1F1B, interleaved,
    zero-bubble and asynchronous schedules keep their activations. Precedence: the argument,
    then the plan's choice, then the schedule's default. The bytes each stage keeps for
    backward show the mode at work, not only its name."""
    from partitioner import plan as make_plan

    x, y = batches(1)[0]

    def kept(schedule: str, balance=(6, 6), devices=2, **options) -> tuple[str, list[int]]:
        pipe = pipetrain.Pipeline(
            mlp(), list(balance), chunks=4, schedule=schedule, devices=["cpu"] * devices,
            loss_fn=nn.functional.cross_entropy, optimizer=sgd, track_memory=True, **options,
        )
        pipe.train_step(x, y)
        assert {s.recompute_below for s in pipe.stages} == {recompute_below(pipe.recompute, 4)}
        return pipe.recompute, [s.ledger.peak_bytes for s in pipe.stages]

    gpipe = kept("gpipe")
    assert gpipe == kept("gpipe", recompute="except_last") and gpipe[0] == "except_last"
    never = kept("gpipe", recompute="never")[1]
    assert all(a < b for a, b in zip(gpipe[1], never, strict=True))
    for schedule, balance in [("1f1b", (6, 6)), ("interleaved", (3, 3, 3, 3)),
                              ("zb-h1", (6, 6)), ("pipedream", (6, 6))]:
        mode, peaks = kept(schedule, balance)
        assert mode == "never", schedule
        always = kept(schedule, balance, recompute="always")[1]
        assert all(a > b for a, b in zip(peaks, always, strict=True)), schedule
    measured = pipetrain.profile(mlp(), x[:6], warmup=0, repeats=1)
    plan = make_plan(measured, stages=2, microbatches=4, schedule="gpipe", checkpoint="always")
    assert kept("gpipe", plan.balance, plan=plan)[0] == "always"
    assert kept("gpipe", plan.balance, plan=plan, recompute="never")[0] == "never"


def test_hooks_on_a_stage_module_run_and_pipe_module_refuses_them():
    """Forward (pre-)hooks on ``pipe.stages[i].module`` run once per micro-batch, in training
    and in evaluation, and an output a hook returns is what the stage goes on with, as on any
    module. ``pipe.module`` is one object for the pipeline's life; it refuses hooks, which
    would never run there."""
    model = mlp()
    pipe = pipeline(copy.deepcopy(model), [6, 6], chunks=4)
    seen: list[tuple[str, int]] = []
    pipe.stages[1].module.register_forward_pre_hook(
        lambda module, args: seen.append(("stage 1 in", len(args[0])))
    )

    def double(module, args, output):
        seen.append(("stage 0 out", len(output)))
        return 2 * output

    pipe.stages[0].module.register_forward_hook(double)
    x, y = batches(1)[0]
    pipe.train_step(x, y)
    assert sorted(seen) == sorted([("stage 0 out", 6), ("stage 1 in", 6)] * 4)
    seen.clear()
    trained = copy.deepcopy(pipe.module).eval()
    with torch.no_grad():
        expected = trained[6:](2 * trained[:6](x))
    assert (pipe.eval_step(x) - expected).abs().max().item() <= TOLERANCE
    assert sorted(seen) == sorted([("stage 0 out", 6), ("stage 1 in", 6)] * 4)
    assert pipe.module is pipe.module
    with pytest.raises(RuntimeError, match=r"never run.*register it on pipe.stages\[i\].module"):
        pipe.module.register_forward_hook(double)
    with pytest.raises(RuntimeError, match="never run"):
        pipe.module.register_full_backward_hook(lambda *args: None)
