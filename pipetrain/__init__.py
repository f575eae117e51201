"""pipetrain: pipeline-parallel training of nn.Sequential models.

The names that need torch load on first use (PEP 562), so that ``import pipetrain``, and the
planning commands (``pipetrain plan``, ``simulate``, ``schedule``), work where torch is not
installed; the errors and ``__version__`` need nothing and load at once.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

from pipetrain.errors import (
    CheckpointError,
    CommunicationTimeout,
    NonFiniteError,
    PeerError,
    PipelineError,
    StageError,
)

if TYPE_CHECKING:  # what _LAZY loads, for type checkers
    from pipetrain import optim
    from pipetrain.checkpoints.checkpointing import consolidate
    from pipetrain.checkpoints.restart import restarted, start_or_resume
    from pipetrain.layer_tree import LayerTree
    from pipetrain.observe.progress import Progress
    from pipetrain.runtime.distributed import init_distributed, shutdown
    from pipetrain.runtime.pipeline import Pipeline
    from pipetrain.runtime.train_task import TrainTask
    from pipetrain.tools.meta_profile import profile
    from pipetrain.training.compensation import DelayCompensation
    from pipetrain.training.lazy import init_layers
    from pipetrain.training.weights import PredictionError

try:
    __version__ = version("pipetrain")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

_LAZY = {  # public name -> the module that defines it (or is it, for optim); they need torch
    "optim": "pipetrain.optim",
    "consolidate": "pipetrain.checkpoints.checkpointing",
    "restarted": "pipetrain.checkpoints.restart",
    "start_or_resume": "pipetrain.checkpoints.restart",
    "LayerTree": "pipetrain.layer_tree",
    "Progress": "pipetrain.observe.progress",
    "init_distributed": "pipetrain.runtime.distributed",
    "shutdown": "pipetrain.runtime.distributed",
    "Pipeline": "pipetrain.runtime.pipeline",
    "TrainTask": "pipetrain.runtime.train_task",
    "profile": "pipetrain.tools.meta_profile",
    "DelayCompensation": "pipetrain.training.compensation",
    "init_layers": "pipetrain.training.lazy",
    "PredictionError": "pipetrain.training.weights",
}


def _load(name: str) -> Any:
    """``pipetrain.NAME`` for a name of _LAZY, imported now and kept; without torch, an
    ImportError saying that this name needs it."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(where)
    except ModuleNotFoundError as error:
        if error.name is None or error.name.split(".")[0] != "torch":
            raise
        raise ModuleNotFoundError(
            f"pipetrain.{name} needs torch (pip install torch); without it only planning "
            "runs: partitioner, schedules and `pipetrain plan`, `simulate`, `schedule`",
            name="torch",
        ) from error
    value = module if where == f"{__name__}.{name}" else getattr(module, name)
    globals()[name] = value
    return value


if not TYPE_CHECKING:  # type checkers read the imports above, and flag a misspelt name
    __getattr__ = _load


def __dir__() -> list[str]:
    """The module's names, the lazy ones included before they load."""
    return sorted({*globals(), *__all__})


__all__ = [
    "CheckpointError",
    "CommunicationTimeout",
    "DelayCompensation",
    "LayerTree",
    "NonFiniteError",
    "PeerError",
    "Pipeline",
    "PipelineError",
    "PredictionError",
    "Progress",
    "StageError",
    "TrainTask",
    "__version__",
    "consolidate",
    "init_distributed",
    "optim",
    "init_layers",
    "shutdown",
    "profile",
    "restarted",
    "start_or_resume",
]
