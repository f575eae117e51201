"""Damaged checkpoint folders: resume falls back to the newest complete checkpoint, never
silently starts over, never prunes later work, and refuses a bad file naming it (issue 22)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.checkpoints import checkpointing
from pipetrain.errors import CheckpointError
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_local import pipeline

DATA = batches(8)


def _saved_at(folder, steps) -> None:
    """Checkpoints of ``steps`` in ``folder``, saved in that order; ``latest`` names the last."""
    pipe = pipeline(mlp(), [6, 6])
    for step in steps:
        pipe.step = step
        pipe.save(folder)


def _resume_and_train(rank: int, world: int, folder: str, steps: int):
    pipe = pipetrain.Pipeline(mlp(), [6, 6], loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                              checkpoint_dir=folder, checkpoint_every=1, timeout=30)
    start = pipe.step
    for x, y in DATA[pipe.step:steps]:
        pipe.train_step(x, y)
    return start


def test_deleting_a_bad_latest_resumes_from_the_newest_checkpoint_in_processes(tmp_path):
    """Today: `latest` deleted → training starts at step 0 and pruning deletes steps 4 and 6."""
    _saved_at(tmp_path, [4, 6])
    (tmp_path / "latest").unlink()
    assert values(run_ranks(_resume_and_train, 2, str(tmp_path), 7, deadline=90)) == [6, 6]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000006", "step-00000007"]


def test_latest_naming_a_missing_step_falls_back_with_a_warning(tmp_path):
    _saved_at(tmp_path, [4, 6])
    (tmp_path / "latest").write_text("step-00000008")
    with pytest.warns(UserWarning, match="names 'step-00000008'.*using step-00000006"):
        assert pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path).step == 6


def test_step_folders_without_a_complete_checkpoint_are_refused(tmp_path):
    _saved_at(tmp_path, [4])
    (tmp_path / "step-00000004" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match=f"{tmp_path} holds step folders but no complete"):
        pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path)
    assert issubclass(CheckpointError, RuntimeError)


def test_an_empty_folder_starts_fresh(tmp_path):
    assert pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path).step == 0


def test_pruning_keeps_checkpoints_saved_after_the_resumed_one(tmp_path):
    """A crash between publishing step 6 and updating `latest` leaves `latest` at step 4."""
    _saved_at(tmp_path, [4, 6])
    (tmp_path / "latest").write_text("step-00000004")
    kept = torch.load(tmp_path / "step-00000006" / "stage-0.pt", weights_only=True)["module"]
    pipe = pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path, checkpoint_every=1)
    assert pipe.step == 4
    for x, y in DATA[4:7]:
        pipe.train_step(x, y)
    again = torch.load(tmp_path / "step-00000006" / "stage-0.pt", weights_only=True)["module"]
    assert all(torch.equal(kept[k], again[k]) for k in kept)  # the earlier run's step 6, whole


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_a_damaged_stage_file_is_named_with_the_newest_intact_step(tmp_path, damage):
    _saved_at(tmp_path, [4, 6])
    bad = tmp_path / "step-00000006" / "stage-1.pt"
    if damage == "truncate":
        os.truncate(bad, bad.stat().st_size // 2)
    else:
        bad.unlink()
    message = rf"{bad} is (damaged|missing).*newest intact checkpoint is step-00000004"
    with pytest.raises(CheckpointError, match=message):
        pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path)
    with pytest.raises(CheckpointError, match=message):
        pipetrain.consolidate(tmp_path)


class Payload:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-pipetrain-test",))


def test_a_hostile_pickle_is_refused_without_suggesting_unsafe_loading(tmp_path):
    _saved_at(tmp_path, [4])
    bad = tmp_path / "step-00000004" / "stage-0.pt"
    torch.save({"format": checkpointing.FORMAT, "module": Payload()}, bad)
    with pytest.raises(CheckpointError) as refused:
        pipeline(mlp(), [6, 6], checkpoint_dir=tmp_path)
    message = str(refused.value)
    assert f"{bad} is not a pipetrain checkpoint" in message
    assert "weights_only" not in message and "no other intact checkpoint" in message
