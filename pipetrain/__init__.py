"""pipetrain: pipeline-parallel training of nn.Sequential models."""

from importlib.metadata import PackageNotFoundError, version

from pipetrain import optim
from pipetrain.checkpointing import consolidate
from pipetrain.compensation import DelayCompensation
from pipetrain.distributed import init_distributed, shutdown
from pipetrain.errors import (
    CheckpointError,
    CommunicationTimeout,
    NonFiniteError,
    PeerError,
    PipelineError,
    StageError,
)
from pipetrain.lazy import init_layers
from pipetrain.meta_profile import profile
from pipetrain.pipeline import Pipeline
from pipetrain.progress import Progress
from pipetrain.restart import restarted, start_or_resume
from pipetrain.task import TrainTask
from pipetrain.weights import PredictionError

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
