"""How a stage's training forward runs, and so what its backward finds: plain (the forward
keeps its autograd graph), recomputed (activation checkpointing: only the inputs are kept and
the backward runs the forward again) or replayed from CUDA graphs
(pipetrain/runtime/cuda_graphs.py). A stage holds one policy; the weights it runs on are the
weight source's business (weight_source.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from torch.utils.checkpoint import checkpoint

from pipetrain.runtime.cuda_graphs import StageGraphs
from pipetrain.runtime.rng import StageRng, State
from pipetrain.runtime.stage_slice import entered

Work = Callable[[object], object]  # the slice run on a value (through the weight source)


class ForwardPolicy:
    """Plain: the forward runs once and keeps its autograd graph for the backward."""

    recompute_below = 0  # micro-batches numbered below it are recomputed
    graphs: StageGraphs | None = None

    def recomputes(self, microbatch: int) -> bool:
        """Whether micro-batch ``microbatch``'s forward runs again in its backward."""
        return microbatch < self.recompute_below

    def may_cut(self, microbatch: int) -> bool:
        """Whether the forward may cut its graph after each layer (a split backward's cuts,
        pipetrain/runtime/stage_module.py)."""
        return not self.recomputes(microbatch)

    def run(
        self, microbatch: int, work: Work, value: object, target: object, start: State
    ) -> object:
        """The forward's output: ``work(value)`` (``target`` is the last stage's, and
        ``start`` the random stream's state at the start)."""
        return work(value)

    def release(self, microbatch: int) -> bool:
        """Free what micro-batch ``microbatch``'s backward held; True when its input
        gradients are buffers the policy reuses (the caller copies them)."""
        return False


class Recompute(ForwardPolicy):
    """Micro-batches numbered below ``below`` (their number modulo ``period``, the
    micro-batches of a mini-batch, where one is given: an asynchronous stage numbers them on
    across mini-batches) keep only their inputs and run their forward again in the backward,
    replaying its random draws from ``rng`` (pipetrain/runtime/config.py derives ``below`` from
    the recomputation mode). Under an asynchronous schedule the forward runs on the weight
    version it read (weight_source.py), and so does its recomputation: ``work`` holds that
    version's tensors, which stay unchanged until the micro-batch is released."""

    def __init__(self, below: int, rng: StageRng, period: int = 0):
        self.recompute_below, self.period = below, period
        self._rng = rng

    def recomputes(self, microbatch: int) -> bool:
        return (microbatch % self.period if self.period else microbatch) < self.recompute_below

    def run(
        self, microbatch: int, work: Work, value: object, target: object, start: State
    ) -> object:
        if not self.recomputes(microbatch):
            return work(value)
        # its input under a version counter of its own: checkpoint checks it, and another
        # micro-batch may modify its own in place
        return checkpoint(
            work, entered(value, False, True), use_reentrant=False, preserve_rng_state=False,
            context_fn=partial(self._rng.checkpoint_contexts, start),
        )


class Replay(ForwardPolicy):
    """CUDA graphs: the forward and its backward replay captured graphs where a signature
    was captured (pipetrain/runtime/cuda_graphs.py). A replay cuts nothing."""

    def __init__(self, graphs: StageGraphs):
        self.graphs = self._graphs = graphs

    def may_cut(self, microbatch: int) -> bool:
        return False

    def run(
        self, microbatch: int, work: Work, value: object, target: object, start: State
    ) -> object:
        return self._graphs.forward(microbatch, value, target)

    def release(self, microbatch: int) -> bool:
        return self._graphs.release(microbatch)
