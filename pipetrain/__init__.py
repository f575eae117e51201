"""pipetrain: pipeline-parallel training of nn.Sequential models."""

from importlib.metadata import PackageNotFoundError, version

from pipetrain import optim
from pipetrain.checkpoints.checkpointing import consolidate
from pipetrain.checkpoints.restart import restarted, start_or_resume
from pipetrain.errors import (
    CheckpointError,
    CommunicationTimeout,
    NonFiniteError,
    PeerError,
    PipelineError,
    StageError,
)
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

__all__ = [
    "CheckpointError",
    "CommunicationTimeout",
    "DelayCompensation",
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
