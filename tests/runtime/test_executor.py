"""The executor's hook for the loss report: it fires once, as the last stage's last forward
ends, so that the other ranks (which wait for the loss) need not wait for the backwards."""

from __future__ import annotations

import torch
from torch import nn

from pipetrain.observe.trace import Recorder
from pipetrain.runtime import microbatch
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.transport import LocalHub
from schedules import Kind, build
from tests.runtime.models import mlp, sgd


def test_losses_done_fires_once_right_after_the_last_forward():
    cpu = torch.device("cpu")
    stage = Stage(mlp(), 0, 1, 0, cpu, sgd, nn.functional.cross_entropy)
    schedule = build("gpipe", 1, 4)  # F0..F3, then B0..B3: four backwards behind the report
    recorder = Recorder(0, 0, schedule)
    seen: list[tuple[int, list]] = []
    executor = Executor(
        [stage], LocalHub([cpu]).endpoint(0), schedule, 0, timeout=10, recorder=recorder,
        losses_done=lambda: seen.append(
            (len(stage.losses), [s.action for s in recorder.steps[-1]])
        ),
    )
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    executor.run(microbatch.scatter(x, 4, "x"), microbatch.scatter(y, 4, "y"))
    assert len(seen) == 1
    losses, done = seen[0]
    assert losses == 4, "every micro-batch's loss is known when the report starts"
    ops = list(schedule.actions[0])
    assert done == ops[: ops.index(max((a for a in ops if a.kind is Kind.FORWARD),
                                       key=lambda a: a.microbatch)) + 1]
    assert [a.kind for a in ops[len(done):]].count(Kind.BACKWARD) == 4


def test_every_action_kind_has_its_executor_method():
    from pipetrain.runtime.executor import HANDLERS

    assert set(HANDLERS) == set(Kind)
    assert all(getattr(Executor, h.__name__) is h for h in HANDLERS.values())


def test_stage_step_steps_whatever_the_options():
    """Stage.step() is the optimizer step even in a pipeline that clips (or runs fp16): the
    STEP action calls it through the Update as AGREE decided, it is never switched off by a
    flag on the stage."""
    import pipetrain

    pipe = pipetrain.Pipeline(
        mlp(), [6, len(mlp()) - 6], chunks=2, devices=["cpu", "cpu"], optimizer=sgd,
        loss_fn=nn.functional.cross_entropy, clip_grad_norm=1.0,
    )
    stage = pipe.stages[0]
    params = [p for p in stage.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.ones_like(p)
    before = [p.detach().clone() for p in params]
    stage.step()
    assert all(not torch.equal(b, p) for b, p in zip(before, params, strict=True))


def test_without_a_call_the_list_trains_its_stage_alone_and_ends_with_the_step():
    """Executor(...) with no Call steps its one stage as a pipeline of one rank would, and its
    trace ends with the step's actions."""
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    stage = Stage(mlp(), 0, 1, 0, cpu, sgd, nn.functional.cross_entropy)
    schedule = build("gpipe", 1, 2)
    recorder = Recorder(0, 0, schedule)
    before = [p.detach().clone() for p in stage.module.parameters()]
    executor = Executor([stage], LocalHub([cpu]).endpoint(0), schedule, 0, timeout=10,
                        recorder=recorder)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    executor.run(microbatch.scatter(x, 2, "x"), microbatch.scatter(y, 2, "y"))
    kinds = [s.action.kind for s in recorder.steps[-1]]
    assert kinds[-3:] == [Kind.REDUCE, Kind.AGREE, Kind.STEP]
    after = list(stage.module.parameters())
    assert all(not torch.equal(b, a) for b, a in zip(before, after, strict=True))


def test_the_executor_never_asks_which_kind_of_schedule_it_runs():
    """The step handler holds what differs (pipetrain/runtime/handler.py), and the executor
    takes at most 8 arguments."""
    import inspect

    from pipetrain.runtime import executor

    assert "schedule.asynchronous" not in inspect.getsource(executor)
    assert len(inspect.signature(Executor.__init__).parameters) - 1 <= 8
