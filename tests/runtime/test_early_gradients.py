"""The last backward of each stage but the first sends its input gradients before it computes
its weight gradients (pipetrain/runtime/update.py's Update.call_list: the runtime's
list has a W after that B's SEND_GRAD, schedules/early.py), so that the previous stage's last
backward, which the pipeline's drain waits for, starts a weight pass earlier.

What is checked: the order on the sending stage (the gradient is posted before any weight
gradient of that micro-batch is computed), that only the last backward of each such stage is
split, that layers holding weights inside them (transformer blocks), recomputed micro-batches
and the zero-bubble schedules (which place W themselves) keep their backward as it was, and
that the split changes no result: fp32 parameters equal plain single-process training within
test_distributed.py's 1e-5 (the split computes the same products; only the order in which a
layer's input and weight gradients are formed changes). The time it saves is measured in
benchmarks/core_throughput.py, not here.
"""

from __future__ import annotations

import threading

import pytest
from torch import nn

import pipetrain
from examples.models import lm_loss
from pipetrain.observe.trace import load_folder
from pipetrain.runtime.executor import Executor
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.update import Update
from schedules import Action, Kind, with_early_weights
from tests.runtime.models import batches, mlp, sgd, text_batches, tiny_gpt
from tests.runtime.test_distributed import assert_trains_like_one_process

CHUNKS, STEPS = 4, 3


class Log:
    """Which thread posted which message and ran which weight pass, in the order it did."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.events: list[tuple[int, str, int]] = []
        self._lock = threading.Lock()
        post, weights = Executor._post, Stage.backward_weights

        def logged_post(executor, action, tensors, header=False):
            if action.kind is Kind.SEND_GRAD and not header:
                self._add(action.stage, "send", action.microbatch)
            post(executor, action, tensors, header)

        def logged_weights(stage, microbatch):
            self._add(stage.index, "W", microbatch)
            weights(stage, microbatch)

        monkeypatch.setattr(Executor, "_post", logged_post)
        monkeypatch.setattr(Stage, "backward_weights", logged_weights)

    def _add(self, stage: int, what: str, microbatch: int) -> None:
        with self._lock:
            self.events.append((stage, what, microbatch))

    def of(self, stage: int) -> list[tuple[str, int]]:
        return [(what, mb) for s, what, mb in self.events if s == stage]


def _train(model: nn.Sequential, balance: list[int], data, loss_fn=nn.functional.cross_entropy,
           **options) -> dict:
    pipe = pipetrain.Pipeline(
        model, balance, chunks=CHUNKS, devices=["cpu"] * len(balance), loss_fn=loss_fn,
        optimizer=sgd, timeout=60, **options,
    )
    losses = [float(pipe.train_step(x, y)) for x, y in data]
    return {"state": pipe.module.state_dict(), "losses": losses, "schedule": pipe.schedule}


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_the_last_backward_sends_before_its_weight_gradients(monkeypatch, schedule):
    log = Log(monkeypatch)
    result = _train(mlp(), [4, 4, 4], batches(STEPS), schedule=schedule)
    assert_trains_like_one_process([result], mlp(), batches(STEPS))
    lists = result["schedule"].actions
    for stage in (1, 2):
        last = [a for a in lists[stage] if a.kind is Kind.BACKWARD][-1].microbatch
        events = log.of(stage)
        assert events.count(("W", last)) == STEPS  # once per step, for the last backward only
        assert {mb for what, mb in events if what == "W"} == {last}
        for step in range(STEPS):  # the gradient leaves first, then the weight pass runs
            span = events[step * (CHUNKS + 1):(step + 1) * (CHUNKS + 1)]
            assert span[-2:] == [("send", last), ("W", last)], span
    assert log.of(0) == [], "the first stage sends nothing and keeps its backward whole"


def test_the_trace_shows_the_early_weight_pass_and_the_step(tmp_path):
    """The trace lists the schedule's actions with the early W of stage 1 after its last
    SEND_GRAD, and the step's REDUCE, AGREE and STEP; the previous stage's last backward
    starts only after this one's B span has ended, and the W runs after it."""
    pipe = pipetrain.Pipeline(
        mlp(), [6, 6], chunks=CHUNKS, devices=["cpu", "cpu"], loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, trace=tmp_path,
    )
    x, y = batches(1)[0]
    pipe.train_step(x, y)
    pipe.save_trace()
    traces = load_folder(tmp_path)
    assert len(traces) == 2
    last = CHUNKS - 1
    listed = with_early_weights(pipe.schedule, [1])
    for trace in traces:
        ran = [s.action for s in trace.steps[-1]]
        assert ran == list(listed.actions[trace.stage])
        s = trace.stage
        assert ran[-3:] == [Action(Kind.REDUCE, s), Action(Kind.AGREE, s), Action(Kind.STEP, s)]
    assert traces[0].schedule == listed  # the loaded trace knows the early W
    ops = list(listed.actions[1])
    assert ops[ops.index(Action(Kind.SEND_GRAD, 1, last)) + 1] == Action(Kind.WEIGHT, 1, last)
    span = {s.action: s for t in traces for s in t.steps[-1]}
    sent = span[Action(Kind.BACKWARD, 1, last)].end
    assert span[Action(Kind.BACKWARD, 0, last)].start >= sent  # the gradient came from B
    assert span[Action(Kind.WEIGHT, 1, last)].start >= sent  # the weight pass ran after it


@pytest.mark.parametrize(
    "model, balance, data, loss_fn, options",
    [
        (tiny_gpt, [2, 3], text_batches, lm_loss, {}),  # weights inside each block
        (mlp, [6, 6], batches, nn.functional.cross_entropy, {"recompute": "always"}),
        (mlp, [6, 6], batches, nn.functional.cross_entropy, {"schedule": "zb-h1"}),
    ],
    ids=["transformer-blocks", "recomputed", "zero-bubble"],
)
def test_backwards_that_would_cost_more_split_stay_whole(
    monkeypatch, model, balance, data, loss_fn, options
):
    log = Log(monkeypatch)
    result = _train(model(), balance, data(STEPS), loss_fn=loss_fn, **options)
    scheduled = [a for ops in result["schedule"].actions.values() for a in ops
                 if a.kind is Kind.WEIGHT]
    weights = [(stage, mb) for stage, what, mb in log.events if what == "W"]
    assert len(weights) == STEPS * len(scheduled)  # the schedule's own W actions, no more


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_and_clipping_give_what_the_whole_backward_gives(monkeypatch, precision):
    """Under autocast, a loss scale and a clip the split computes the same products as the
    whole backward: the parameters agree to 1e-6 (fp32 master weights; measured: equal) with
    the same pipeline whose split is off, itself checked against one process elsewhere
    (test_training_options.py: bf16 to its rounding, fp16 with a clip within 1e-5)."""
    options = dict(precision=precision, clip_grad_norm=0.5)
    with monkeypatch.context() as off:
        off.setattr(Update, "call_list", lambda self, schedule: schedule)
        whole = _train(mlp(), [6, 6], batches(STEPS), **options)
    log = Log(monkeypatch)
    split = _train(mlp(), [6, 6], batches(STEPS), **options)
    assert [what for _, what, _ in log.events].count("W") == STEPS  # the split did run
    for key, value in whole["state"].items():
        assert (split["state"][key] - value).abs().max().item() <= 1e-6, key
    assert split["losses"] == pytest.approx(whole["losses"], abs=1e-6)
