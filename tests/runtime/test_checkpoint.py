"""Checkpoints: re-sliceable across balances, bit-exact resume, never corrupted by a crash."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.checkpoints import checkpointing
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_local import pipeline

DATA = batches(5)


def uninterrupted() -> dict[str, torch.Tensor]:
    pipe = pipeline(mlp(), [4, 8], chunks=4)
    for x, y in DATA:
        pipe.train_step(x, y)
    return pipe.module.state_dict()


def assert_bit_equal(state: dict, expected: dict) -> None:
    assert state.keys() == expected.keys()
    for key in expected:
        assert torch.equal(state[key], expected[key]), key


@pytest.mark.parametrize("balance", [[6, 6], [12], [2, 3, 4, 3]])
def test_resume_under_another_balance_is_bit_exact(tmp_path, balance):
    first = pipeline(mlp(), [4, 8], chunks=4)
    for x, y in DATA[:3]:
        first.train_step(x, y)
    first.save(tmp_path)
    again = pipeline(mlp(seed=99), balance, chunks=4, checkpoint_dir=tmp_path)
    assert again.step == 3
    for x, y in DATA[again.step:]:
        again.train_step(x, y)
    assert_bit_equal(again.module.state_dict(), uninterrupted())


def test_consolidate_gives_the_plain_model(tmp_path):
    pipe = pipeline(mlp(), [5, 7], chunks=2)
    pipe.train_step(*DATA[0])
    pipe.save(tmp_path)
    model = mlp(seed=7)
    model.load_state_dict(pipetrain.consolidate(tmp_path), strict=True)
    assert_bit_equal(model.state_dict(), pipe.module.state_dict())
    assert list(pipetrain.consolidate(tmp_path)) == list(model.state_dict())


def test_checkpoint_of_another_model_names_the_keys(tmp_path):
    pipeline(mlp(), [6, 6]).save(tmp_path)
    other = nn.Sequential(*mlp(), nn.Linear(5, 5))
    needs = r"another model: stage 1 needs \['12.bias', '12.weight'\]"
    with pytest.raises(ValueError, match=needs):
        pipeline(other, [6, 7], checkpoint_dir=tmp_path)


def test_only_complete_checkpoints_are_kept_and_named(tmp_path):
    pipe = pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path, checkpoint_every=1)
    assert pipe.step == 0 and checkpointing.latest(tmp_path) is None
    for x, y in DATA[:4]:
        pipe.train_step(x, y)
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert kept == ["latest", "step-00000003", "step-00000004"]
    manifest = json.loads((tmp_path / "step-00000004" / "manifest.json").read_text())
    assert manifest["step"] == 4 and manifest["stages"] == 2


def test_a_run_restarted_from_scratch_keeps_its_newest_checkpoint(tmp_path):
    old = pipeline(mlp(), [6, 6])
    for step in (5, 6, 1):  # a fresh run saves step 1 after an old run's 5 and 6
        old.step = step
        old.save(tmp_path)
        assert checkpointing.latest(tmp_path).name == f"step-{step:08d}"
    assert pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path).step == 1


def test_saving_a_step_again_returns_its_checkpoint(tmp_path):
    """A final save right after a periodic one of the same step writes nothing new (no
    step-N.0001) and loses nothing."""
    pipe = pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path, checkpoint_every=2)
    for x, y in DATA[:2]:
        pipe.train_step(x, y)  # step 2 saved by checkpoint_every
    first = checkpointing.latest(tmp_path)
    for _ in range(2):
        assert pipe.save(tmp_path) == first
        assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    again = pipeline(mlp(seed=5), [6, 6], checkpoint_dir=tmp_path)
    assert again.step == 2 and again.save(tmp_path) == first  # as loaded: nothing to write
    assert_bit_equal(again.module.state_dict(), pipe.module.state_dict())


def test_a_step_saved_again_after_its_checkpoint_was_removed_is_written(tmp_path):
    pipe = pipeline(mlp(), [6, 6])
    pipe.train_step(*DATA[0])
    first = pipe.save(tmp_path)
    for old in tmp_path.iterdir():
        if old.is_dir():
            for file in old.iterdir():
                file.unlink()
            old.rmdir()
    assert pipe.save(tmp_path) == first and (first / "manifest.json").is_file()
    elsewhere = pipe.save(tmp_path / "other")  # another folder: a checkpoint of its own
    assert elsewhere.parent == tmp_path / "other" and (elsewhere / "manifest.json").is_file()


def _train_in_processes(rank: int, world: int, folder: str | None, steps: int):
    """Train (resuming from ``folder`` if it holds a checkpoint) up to ``steps`` steps."""
    balance = [4, 8] if world == 2 else [3, 3, 3, 3]
    pipe = pipetrain.Pipeline(mlp(), balance, chunks=4, loss_fn=nn.functional.cross_entropy,
                              optimizer=sgd, checkpoint_dir=folder, timeout=60)
    for x, y in DATA[pipe.step:steps]:
        pipe.train_step(x, y)
    if folder:
        pipe.save(folder)
    return pipe.step, pipe.module.state_dict()


def test_two_processes_save_four_processes_resume(tmp_path):
    """Same threads per process on both sides, so the comparison can be bit for bit."""
    values(run_ranks(_train_in_processes, 2, str(tmp_path), 3))
    resumed = values(run_ranks(_train_in_processes, 4, str(tmp_path), 5))
    straight = values(run_ranks(_train_in_processes, 4, None, 5))
    assert {step for step, _ in resumed + straight} == {5}
    merge = lambda states: {k: v for _, state in states for k, v in state.items()}  # noqa: E731
    assert_bit_equal(merge(resumed), merge(straight))


SAVER = """
import sys, torch
from torch import nn
import pipetrain
model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(24)])
pipe = pipetrain.Pipeline(model, [12, 12], devices=["cpu", "cpu"],
                          optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
for k in range(1, 10_000):
    with torch.no_grad():
        for p in pipe.module.parameters():
            p.fill_(k)
    pipe.step = k
    pipe.save(sys.argv[1])
    print(k, flush=True)
"""


def test_a_save_killed_halfway_leaves_the_previous_checkpoint_whole(tmp_path):
    rng = random.Random(0)
    script = tmp_path / "saver.py"
    script.write_text(SAVER)
    folder = tmp_path / "ckpt"
    for trial in range(3):
        child = subprocess.Popen([sys.executable, str(script), str(folder)],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        child.stdout.readline()  # one complete checkpoint exists
        time.sleep(rng.uniform(0.0, 0.3))  # then kill it somewhere inside a later save
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        state = pipetrain.consolidate(folder)
        step = json.loads((checkpointing.latest(folder) / "manifest.json").read_text())["step"]
        assert step >= 1
        for key, value in state.items():
            assert torch.all(value == step), f"trial {trial}: {key} is not all {step}"
