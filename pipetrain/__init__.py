"""pipetrain: pipeline-parallel training of nn.Sequential models."""

from pipetrain.checkpointing import consolidate
from pipetrain.compensation import DelayCompensation
from pipetrain.distributed import init_distributed
from pipetrain.errors import CommunicationTimeout, PeerError, PipelineError, StageError
from pipetrain.pipeline import Pipeline
from pipetrain.profiler import profile

__all__ = [
    "CommunicationTimeout",
    "DelayCompensation",
    "PeerError",
    "Pipeline",
    "PipelineError",
    "StageError",
    "consolidate",
    "init_distributed",
    "profile",
]
