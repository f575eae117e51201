"""The errors pipetrain raises: each names what went wrong, where, and the fix."""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Base class for failures of a running pipeline."""


class StageError(PipelineError):
    """A layer failed on this stage; the original exception is chained as ``__cause__``."""


class PeerError(PipelineError):
    """Another stage failed, died or fell silent, so this one cannot go on."""


class CommunicationTimeout(PeerError):
    """A blocking wait on a peer outlasted the pipeline's timeout."""


class CheckpointError(RuntimeError):
    """A checkpoint folder or file cannot be used as it is; the message names it and the way out."""


class NonFiniteError(PipelineError):
    """A step's loss or gradients were not finite (raised with ``Pipeline(nonfinite="raise")``;
    the step was skipped on every rank first)."""
