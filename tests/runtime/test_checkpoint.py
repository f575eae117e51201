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
from pipetrain.checkpoints import checkpointing, restart
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


def _save_at(pipe: pipetrain.Pipeline, folder, *steps: int) -> None:
    for step in steps:
        pipe.step = step
        pipe.save(folder)


def _names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.is_dir())


def test_a_new_run_never_prunes_an_earlier_runs_checkpoints(tmp_path):
    """The README's 300-step run leaves steps 250 and 300; a new run saving into the same
    folder (its step 0 included, which the earlier run also saved) prunes only its own."""
    _save_at(pipeline(mlp(), [6, 6]), tmp_path, 0, 250, 300)  # KEEP=2: its step 0 goes
    assert _names(tmp_path) == ["step-00000250", "step-00000300"]
    _save_at(pipeline(mlp(), [6, 6]), tmp_path, 250, 0, 10, 20)
    assert _names(tmp_path) == [
        "step-00000010", "step-00000020", "step-00000250", "step-00000300",
    ]
    assert checkpointing.latest(tmp_path).name == "step-00000020"
    runs = {checkpointing.run_of(tmp_path / name) for name in _names(tmp_path)}
    assert len(runs) == 2 and None not in runs


def test_a_resumed_run_prunes_the_checkpoints_of_the_run_it_goes_on_with(tmp_path):
    _save_at(pipeline(mlp(), [6, 6]), tmp_path, 1, 2)
    again = pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path)
    assert again.step == 2
    _save_at(again, tmp_path, 3, 4)
    assert _names(tmp_path) == ["step-00000003", "step-00000004"]


def test_checkpoints_without_a_run_are_never_pruned(tmp_path):
    """An older pipetrain's checkpoints name no run: nobody can tell they are its own."""
    _save_at(pipeline(mlp(), [6, 6]), tmp_path, 7)
    manifest = tmp_path / "step-00000007" / "manifest.json"
    manifest.write_text(json.dumps({k: v for k, v in json.loads(manifest.read_text()).items()
                                    if k != "run"}))
    again = pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path)
    _save_at(again, tmp_path, 8, 9, 10)
    assert _names(tmp_path) == ["step-00000007", "step-00000009", "step-00000010"]


def test_a_new_run_into_a_folder_with_checkpoints_is_refused_unless_asked(tmp_path):
    _save_at(pipeline(mlp(), [6, 6]), tmp_path, 30, 40)
    refused = (rf"{tmp_path} holds checkpoints of an earlier run \(the newest: step-00000040\)"
               r".*--resume.*--fresh.*another --checkpoint-dir")
    with pytest.raises(pipetrain.CheckpointError, match=refused):
        pipetrain.start_or_resume(pipeline(mlp(), [6, 6]), tmp_path)
    assert _names(tmp_path) == ["step-00000030", "step-00000040"]
    assert pipetrain.start_or_resume(pipeline(mlp(), [6, 6]), tmp_path, resume=True) == 40
    assert pipetrain.start_or_resume(pipeline(mlp(), [6, 6]), tmp_path, fresh=True) is None
    assert _names(tmp_path) == ["step-00000000", "step-00000030", "step-00000040"]
    with pytest.raises(ValueError, match="resume and fresh exclude each other"):
        restart.check_start(tmp_path, resume=True, fresh=True)
    restart.check_start(tmp_path / "new")  # no folder yet: a new run


@pytest.mark.parametrize("resume", [False, True])
def test_the_run_start_or_resume_chose_saves_there_every_checkpoint_every_steps(tmp_path, resume):
    """The folder start_or_resume started (or resumed) the run in becomes the pipeline's
    checkpoint_dir: train_step's own periodic saves go there (what ``pipetrain train`` uses)."""
    if resume:
        _save_at(pipeline(mlp(), [6, 6]), tmp_path, 1)
    pipe = pipeline(mlp(), [6, 6], checkpoint_every=2)
    assert pipetrain.start_or_resume(pipe, tmp_path, resume=resume) == (1 if resume else None)
    for x, y in batches(4 - pipe.step):
        pipe.train_step(x, y)
    assert pipe.config.checkpoint_dir == tmp_path
    assert _names(tmp_path) == ["step-00000002", "step-00000004"]  # the run's own, pruned to 2


def _start(rank: int, world: int, folder: str, restarted_rank: int | None) -> int | None:
    """start_or_resume on 2 replicas of a one-stage pipeline; rank 1 comes late (it would see
    rank 0's fresh step 0 if it looked at the folder alone), ``restarted_rank`` alone is told
    that torchrun restarted it."""
    if rank == restarted_rank:
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1"
    pipe = pipetrain.Pipeline(mlp(), [12], loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                              timeout=60)
    if rank == 1:
        time.sleep(1.0)
    return pipetrain.start_or_resume(pipe, folder)


def test_every_rank_decides_to_start_or_resume_alike(tmp_path):
    """A new run's ranks start together however late one looks; a restart seen by one rank
    only (torchrun counts it on the failed agent's ranks) resumes every rank."""
    folder = str(tmp_path / "ckpt")
    assert values(run_ranks(_start, 2, folder, None)) == [None, None]
    assert _names(tmp_path / "ckpt") == ["step-00000000"]
    assert values(run_ranks(_start, 2, folder, 1)) == [0, 0]
    refused = run_ranks(_start, 2, folder, None)
    assert [status for status, _ in refused] == ["error", "error"], refused
    assert all("holds checkpoints of an earlier run" in message for _, (_, message, _) in refused)


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
