"""Starting a run fresh or resuming it: the rule that torchrun's restarts need, and the one that
keeps an earlier run's checkpoints.

torchrun's ``--max-restarts`` starts every process of the job again after one fails, with the
same command line; only ``TORCHELASTIC_RESTART_COUNT`` tells the attempts apart (and only on
the agents whose workers failed: the ranks pool what they see, so all resume if any was
restarted). A restarted attempt must resume from the newest checkpoint. A first attempt resumes
when asked to; else it starts a new run at step 0 and saves that step at once, so that a
restart before its first periodic save resumes this run, not an older one. A new run into a
folder that already holds checkpoints is refused unless asked for (``fresh``): it would train
from step 0 beside them, and the user more likely meant to resume them or to use another
folder. Asked for, the new run keeps them (pruning removes only a run's own checkpoints,
pipetrain/checkpoints/checkpointing.py).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipetrain.checkpoints.checkpointing import latest
from pipetrain.errors import CheckpointError

if TYPE_CHECKING:
    from pipetrain.runtime.pipeline import Pipeline


def restarted() -> bool:
    """Whether torchrun restarted this job's processes after a failure (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _refusal(folder: str | os.PathLike[str]) -> str | None:
    """Why a new run may not start in ``folder`` (it holds checkpoints), or None."""
    try:
        with warnings.catch_warnings():  # a missing ``latest`` pointer: resuming warns of it
            warnings.simplefilter("ignore")
            newest = latest(folder) if Path(folder).is_dir() else None
    except CheckpointError as error:  # step folders, none complete
        return str(error)
    if newest is None:
        return None
    return (
        f"{folder} holds checkpoints of an earlier run (the newest: {newest.name}); a new run "
        "would train from step 0 beside them. Resume that run (--resume, or resume=True), "
        "start a new one that keeps them (--fresh, or fresh=True; each run prunes only its own "
        "checkpoints), or pass another --checkpoint-dir"
    )


def _exclusive(resume: bool, fresh: bool) -> None:
    if resume and fresh:
        raise ValueError("resume and fresh exclude each other: resume the run in the folder, or "
                         "start a new one beside it")


def check_start(folder: str | os.PathLike[str], resume: bool = False, fresh: bool = False) -> None:
    """Refuse a new run (neither ``resume`` nor ``fresh``, nor a torchrun restart) into a
    ``folder`` that holds checkpoints: a CheckpointError naming the folder, its newest
    checkpoint and the three ways on. For one process before any rank starts (a launcher);
    the ranks themselves decide together in :func:`start_or_resume`."""
    _exclusive(resume, fresh)
    refusal = None if resume or fresh or restarted() else _refusal(folder)
    if refusal is not None:
        raise CheckpointError(refusal)


def start_or_resume(
    pipe: Pipeline, folder: str | os.PathLike[str], resume: bool = False, fresh: bool = False
) -> int | None:
    """Resume ``pipe`` from the newest checkpoint in ``folder`` when ``resume`` is set or
    torchrun restarted the job, and return its step (None when the folder holds none yet);
    otherwise start a new run at step 0 and save that step in ``folder``, refused (a
    CheckpointError, :func:`check_start`'s) where the folder holds checkpoints, unless ``fresh``.
    Either way ``folder`` becomes the pipeline's ``checkpoint_dir``: its ``checkpoint_every``
    saves go there.

    Every rank calls it, and every rank of every replica decides alike: each reports whether
    torchrun restarted it and the first rank what the folder holds, before any rank saves.
    (A rank that looked at the folder on its own could see the step 0 another had just saved;
    and torchrun counts a restart only on the agents whose workers failed, so one agent's
    ranks may resume while another's would start afresh.)"""
    _exclusive(resume, fresh)
    refusal = None if resume or fresh else _refusal(folder)
    views = pipe.world.gather_objects((restarted(), refusal), "the check of a restart",
                                      every_replica=True)
    if resume or any(again for again, _ in views):
        resumed = pipe.load(folder)
    elif views[0][1] is not None:
        raise CheckpointError(views[0][1])
    else:
        Path(folder).mkdir(parents=True, exist_ok=True)
        pipe.save(folder)
        resumed = None
    pipe.config = replace(pipe.config, checkpoint_dir=folder)  # the run's saves: train_step's
    return resumed
