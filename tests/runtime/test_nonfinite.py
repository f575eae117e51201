"""A step with a non-finite loss or gradient is skipped on every rank (issue 31, item 13).

One NaN in one input of one mini-batch (fp32, 1F1B, SGD with momentum): every parameter and
every momentum buffer stays bitwise what it was before that step, the learning-rate schedule
does not advance, ``metrics["skipped_step"]`` says so and a warning names the step and the
stages; the next clean step trains as if the bad mini-batch had never come. The run is
compared with single-process training on the clean mini-batches only, within 1e-5 max abs
(as test_distributed.py: micro-batches reorder the gradient's sums, ~1e-7 here; a NaN that
reached a weight, or a step that went ahead, is NaN or off by a whole update).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import pipetrain
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_distributed import TOLERANCE

BAD, STEPS, MAX_NORM = 1, 3, 0.5


def fused_sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)


def decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def poisoned() -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = batches(STEPS)
    data[BAD][0][3, 5] = float("nan")
    return data


def reference(clip: float | None) -> dict:
    """Single-process training on the clean mini-batches alone."""
    model = mlp()
    optimizer = sgd(model.parameters())
    schedule = decay(optimizer)
    for step, (x, y) in enumerate(batches(STEPS)):
        if step == BAD:
            continue
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if clip is not None:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        schedule.step()
    return model.state_dict()


def _state(pipe: pipetrain.Pipeline) -> dict:
    """Parameters and optimizer state (momentum buffers, learning rates) of this process."""
    state = {k: v.clone() for k, v in pipe.module.state_dict().items()}
    for stage in pipe.stages:
        assert stage.optimizer is not None
        for group in stage.optimizer.param_groups:
            state[f"lr{stage.index}"] = group["lr"]
            for p in group["params"]:
                buffer = stage.optimizer.state.get(p, {}).get("momentum_buffer")
                state[f"momentum{stage.index}/{id(p)}"] = (
                    None if buffer is None else buffer.clone()
                )
    return state


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if isinstance(v, torch.Tensor) else v == b[k] for k, v in a.items()
    )


def train(pipe: pipetrain.Pipeline) -> dict:
    """Train on the poisoned data; what the bad step did, the warnings, the final state."""
    record: dict = {"warnings": []}
    for step, (x, y) in enumerate(poisoned()):
        before = _state(pipe)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = pipe.train_step(x, y)
            metrics = pipe.metrics  # reading them reports a skip found on the device
        record["warnings"] += [(step, str(w.message)) for w in caught]
        if step == BAD:
            after = _state(pipe)
            record["unchanged"] = _same(before, after)
            record["finite"] = all(
                bool(v.isfinite().all()) for v in pipe.module.state_dict().values()
            )
            record["loss"], record["skipped"] = float(loss), metrics["skipped_step"]
        elif metrics["skipped_step"]:
            record["clean_skipped"] = True
    record["state"] = pipe.module.state_dict()
    return record


def check(record: dict, clip: float | None) -> None:
    assert record["unchanged"] and record["finite"]
    assert record["skipped"] is True and record["loss"] != record["loss"]  # NaN, reported
    assert "clean_skipped" not in record
    [(step, message)] = record["warnings"]
    assert step == BAD
    assert f"step {BAD + 1}: non-finite" in message and "stage" in message
    assert "skipped on every rank" in message and "nonfinite='raise'" in message
    expected = reference(clip)
    for key, value in expected.items():
        assert (record["state"][key] - value).abs().max().item() <= TOLERANCE, key


def _threads(optimizer, clip: float | None) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(
        mlp(), [4, 8], chunks=2, schedule="1f1b", devices=["cpu", "cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=optimizer, lr_scheduler=decay,
        clip_grad_norm=clip,
    )


@pytest.mark.parametrize("clip", [None, MAX_NORM])
def test_a_nan_input_skips_the_step_in_threads(clip):
    check(train(_threads(sgd, clip)), clip)


def test_a_fused_optimizer_skips_on_the_device_and_warns_when_read():
    """No host sync decides: the fused optimizer skips on its found_inf; the warning comes
    when the flags are read (here: the metrics right after the step)."""
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=2, devices=["cpu", "cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=fused_sgd,
    )
    assert pipe._update is not None and not pipe._update.host_decides
    record = train(pipe)
    assert record["unchanged"] and record["finite"] and record["skipped"] is True
    assert [step for step, _ in record["warnings"]] == [BAD]


def test_raise_mode_raises_and_leaves_the_weights_alone():
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=2, devices=["cpu", "cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, nonfinite="raise",
    )
    data = poisoned()
    pipe.train_step(*data[0])
    before = _state(pipe)
    with pytest.raises(pipetrain.NonFiniteError, match=r"step 2: non-finite gradients on "
                       r"stages 0, 1 and the loss \(stage 1\).*nonfinite='skip'"):
        pipe.train_step(*data[BAD])
    assert _same(before, _state(pipe))
    pipe.train_step(*data[2])  # the pipeline goes on after the error
    assert not _same(before, _state(pipe))


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="nonfinite must be 'skip'.*or 'raise'"):
        pipetrain.Pipeline(
            mlp(), [4, 8], loss_fn=nn.functional.cross_entropy, optimizer=sgd,
            nonfinite="ignore",
        )


def _processes(rank: int, world: int, clip: float | None) -> dict:
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=2, schedule="1f1b", loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, lr_scheduler=decay, clip_grad_norm=clip, timeout=60,
    )
    return train(pipe)


@pytest.mark.parametrize("clip", [None, MAX_NORM])
def test_a_nan_input_skips_the_step_on_every_process(clip):
    records = values(run_ranks(_processes, 2, clip, deadline=120))
    merged = {k: v for r in records for k, v in r["state"].items()}
    for record in records:  # every rank skipped, warned and then trained on
        check(dict(record, state=merged), clip)
