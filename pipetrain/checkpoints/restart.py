"""Starting a run fresh or resuming it: the rule that torchrun's restarts need.

torchrun's ``--max-restarts`` starts every process of the job again after one fails, with the
same command line; only ``TORCHELASTIC_RESTART_COUNT`` tells the attempts apart. A restarted
attempt must resume from the newest checkpoint; a first attempt starts fresh even when the
folder holds an older run's checkpoints, and saves its step 0 there at once, so that a restart
before its first periodic save resumes this run, not the older one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipetrain.runtime.pipeline import Pipeline


def restarted() -> bool:
    """Whether torchrun restarted this job's processes after a failure (``--max-restarts``)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def start_or_resume(
    pipe: Pipeline, folder: str | os.PathLike[str], resume: bool = False
) -> int | None:
    """Resume ``pipe`` from the newest checkpoint in ``folder`` when ``resume`` is set or
    torchrun restarted the job, and return its step (None when the folder holds none yet);
    otherwise start fresh at step 0 and save that step in ``folder``. Every rank calls it."""
    if resume or restarted():
        return pipe.load(folder)
    Path(folder).mkdir(parents=True, exist_ok=True)
    pipe.save(folder)
    return None
