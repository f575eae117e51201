"""One stage of the pipeline: its slice of the model and what it keeps between F and B.

The stage knows nothing of schedules or links: the executor hands it a micro-batch's inputs for
a forward and the output gradients for a backward, and the stage returns what must cross the
next boundary. Between the two it stashes, per micro-batch, the inputs (whose gradients flow
back) and the outputs (or, on the last stage, the loss).

A stage composes parts with one job each: its slice of the model (stage_slice.py), a forward
policy (plain, recomputed or CUDA graphs: forward_policy.py), a weight source (live weights or
an asynchronous schedule's versions: weight_source.py), the B/W split of its backward
(split_backward.py) and what it updates (stage_optimizer.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipetrain.errors import StageError
from pipetrain.layer_tree import LayerTree
from pipetrain.observe.memory import ActivationLedger
from pipetrain.runtime.compiled import compiled_calls
from pipetrain.runtime.cuda_graphs import StageGraphs
from pipetrain.runtime.data_parallel import Sync
from pipetrain.runtime.forward_policy import ForwardPolicy, Recompute, Replay
from pipetrain.runtime.rng import StageRng, State, draw_seeds
from pipetrain.runtime.split_backward import Leaves, SplitBackward
from pipetrain.runtime.stage_module import Cuts, StageModule
from pipetrain.runtime.stage_optimizer import OptimizerFactory, SchedulerFactory, StageOptimizer
from pipetrain.runtime.stage_slice import LossFn, StageSlice
from pipetrain.runtime.weight_source import LiveWeights, VersionedWeights
from pipetrain.training.batchnorm import gathering_statistics
from pipetrain.training.weights import WeightVersions

__all__ = ["LossFn", "OptimizerFactory", "SchedulerFactory", "Stage", "StageOptions",
           "VersionsFactory"]

# an asynchronous stage's weight versions, from its trained weights and optimizer
VersionsFactory = Callable[[list[nn.Parameter], torch.optim.Optimizer | None], WeightVersions]


@dataclass(frozen=True, kw_only=True)
class StageOptions:
    """How a stage runs beyond its slice, optimizer factory and loss; each defaults to off.

    Training micro-batches numbered below ``recompute_below`` keep only their inputs and
    recompute their forward in the backward (pipetrain/runtime/config.py derives it from the
    recomputation mode); with ``recompute_period`` (the micro-batches of a mini-batch) the
    number compared is a micro-batch's place in its mini-batch, for asynchronous stages, which
    number micro-batches on across mini-batches; ``split_backward``: the schedule has W passes.
    On the last stage the backward starts from the loss scale over ``loss_divisor`` (the
    micro-batches of one update). ``autocast_dtype`` is the stage's mixed precision (None:
    fp32). ``seed`` starts the stage's random stream (pipetrain/runtime/rng.py); by default one
    drawn from the global generator. ``lr_scheduler`` makes each optimizer's learning-rate
    schedule; ``syncs`` all-reduce gradients before each optimizer step (their parameters must
    already be on the stage's device); ``owned_elsewhere`` are the ids of weights another stage
    of this process steps. ``weight_versions`` makes the stage asynchronous
    (pipetrain/training/weights.py).
    ``track_memory`` counts the bytes the stage saves for backward (``stage.ledger``).
    ``weight_leaves`` gives what W differentiates for the stage's weights (ZeRO 2 and 3: the
    gathered parameters FSDP2 swapped in, sharding.py); None: the weights themselves.
    ``after_weights`` runs after each W (ZeRO 2 and 3 reduced per micro-batch: the
    reduce-scatter of its gradients).
    ``compile`` runs each layer through torch.compile (compiled.py), and then no backward is
    split: B makes the weight gradients too.
    """

    recompute_below: int = 0
    recompute_period: int = 0  # 0: the numbers are a mini-batch's own
    split_backward: bool = False
    loss_divisor: int = 1
    autocast_dtype: torch.dtype | None = None
    seed: int | None = None
    lr_scheduler: SchedulerFactory | None = None
    syncs: Sequence[Sync] = ()
    owned_elsewhere: frozenset[int] = frozenset()
    weight_versions: VersionsFactory | None = None
    track_memory: bool = False
    weight_leaves: Leaves | None = None
    after_weights: Callable[[], None] | None = None
    compile: bool = False


@dataclass
class _Stashed:
    inputs: tuple[torch.Tensor, ...]  # leaves whose .grad goes back to the previous stage
    outputs: tuple[torch.Tensor, ...]  # what backward starts from (the scaled loss on the last)
    # split backward: the layers' cuts (pipetrain/runtime/stage_module.py); B finds the gradients of
    # their aliases and W backpropagates each layer from them to its weights alone. None: W
    # backpropagates the stage's outputs (a recomputed micro-batch, or weights used twice)
    cuts: Cuts | None = None


class Stage:
    """Stage ``index`` of ``count``: a module slice on ``device`` with its optimizer; its
    public attributes are its parts' (see the module docstring)."""

    def __init__(
        self,
        module: nn.Sequential | LayerTree,
        index: int,
        count: int,
        offset: int,
        device: torch.device,
        optimizer: OptimizerFactory | None,
        loss_fn: LossFn | None,
        *,
        options: StageOptions = StageOptions(),
    ):
        """The layers of ``module`` (the model's from ``offset`` on) on ``device``, each
        stage's optimizer built by ``optimizer`` from its weights, the last stage's loss
        ``loss_fn``; the rest is ``options``."""
        o = options
        self._slice = StageSlice(
            module, index, count, offset, device, loss_fn, o.autocast_dtype, o.loss_divisor
        )
        if o.compile:
            self.module.calls = compiled_calls(self.module)
        self.rng = StageRng(draw_seeds(1)[0] if o.seed is None else o.seed, device)
        owned = [p for p in self.module.parameters()
                 if p.requires_grad and id(p) not in o.owned_elsewhere]
        self._update = StageOptimizer(owned, optimizer, o.lr_scheduler)
        self.syncs = list(o.syncs)  # gradient all-reduces before each optimizer step
        self._after_weights = o.after_weights
        self.ledger = ActivationLedger.for_parameters(owned) if o.track_memory else None
        self._stash: dict[int, _Stashed] = {}
        self.losses: dict[int, torch.Tensor] = {}
        weights = [p for p in self.module.parameters() if p.requires_grad]
        # Weights sharded by FSDP2 (ZeRO 2, 3: sharding.py): the last backward is not cut for
        # an early W (split_backward.py), and autocast keeps no cast of them across
        # micro-batches (with a kept cast, bf16 gradients came out wrong:
        # tests/runtime/test_zero.py).
        sharded = any(isinstance(p, DTensor) for p in weights)
        self._slice.autocast_cache = not sharded
        self._split = SplitBackward(
            self.module, weights, o.split_backward, sharded, o.weight_leaves or list,
            whole=o.compile,
        )
        self._policy: ForwardPolicy = (
            Recompute(o.recompute_below, self.rng, o.recompute_period) if o.recompute_below
            else ForwardPolicy()
        )
        self._source: LiveWeights | VersionedWeights = LiveWeights(self._slice)
        if o.weight_versions is not None:  # asynchronous: which weights each micro-batch reads
            versions = o.weight_versions(weights, self.optimizer)
            self._source = VersionedWeights(self._slice, weights, versions, self.rng)

    # the slice's
    @property
    def module(self) -> StageModule:
        return self._slice.module

    @property
    def index(self) -> int:
        return self._slice.index

    @property
    def count(self) -> int:
        return self._slice.count

    @property
    def offset(self) -> int:
        return self._slice.offset

    @property
    def device(self) -> torch.device:
        return self._slice.device

    @property
    def is_first(self) -> bool:
        return self._slice.is_first

    @property
    def is_last(self) -> bool:
        return self._slice.is_last

    @property
    def loss_fn(self) -> LossFn | None:
        return self._slice.loss_fn

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self._slice.autocast_dtype

    @property
    def loss_divisor(self) -> int:
        return self._slice.loss_divisor

    @property
    def num_items(self) -> torch.Tensor | None:
        """The loss's ``num_items_in_batch`` this step (loss_items.py); None: not taken."""
        return self._slice.num_items

    @num_items.setter
    def num_items(self, value: torch.Tensor | None) -> None:
        self._slice.num_items = value

    # the other parts'
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._update.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler | None:
        return self._update.scheduler

    @property
    def recompute_below(self) -> int:
        return self._policy.recompute_below

    @property
    def graphs(self) -> StageGraphs | None:
        """The CUDA graphs the stage replays (pipetrain/runtime/cuda_graphs.py), if any."""
        return self._policy.graphs

    @property
    def split_backward(self) -> bool:
        return self._split.scheduled

    @property
    def versions(self) -> WeightVersions | None:
        """An asynchronous stage's weight versions (pipetrain/training/weights.py)."""
        return self._source.versions

    def use_graphs(self, slots: int, strict: bool) -> None:
        """Replay CUDA graphs of the training forward and backward
        (pipetrain/runtime/cuda_graphs.py), ``slots`` micro-batches at a time. Gradients then stay
        allocated (a replay adds into them in place) and autocast keeps no weight-cast cache (a
        replay cannot use one)."""
        if self.recompute_below:
            raise ValueError(
                f"stage {self.index}: CUDA graphs cannot replay a recomputed forward; build the "
                "stage with recompute_below=0 (recompute='never')"
            )
        self._slice.autocast_cache = False
        self._policy = Replay(StageGraphs(
            self.index, self.device, self.module, self._slice.run_and_score, self.rng,
            slots, strict,
        ))

    def forward(
        self,
        microbatch: int,
        inputs: tuple[torch.Tensor, ...],
        value: object,
        target: object = None,
        training: bool = True,
        cut: bool = False,
    ) -> object:
        """Run the slice on ``value`` (built from ``inputs``); return its output. In training,
        on the stage's random stream, stash what backward needs and on the last stage compute
        the loss against ``target``. ``cut``: where the weight gradients would cost no more
        split off than in one backward (each layer holds its weights itself), cut the graph
        after each layer (as a split backward does), so that this micro-batch's backward
        returns its input gradients before computing its weight gradients (see
        :meth:`backward`)."""
        slice_ = self._slice
        slice_.at.position = 0
        if not training:  # eval mode draws nothing: no stream, no turn to wait for (rng.py)
            with slice_.reporting(slice_.forward_step, microbatch), torch.no_grad():
                return slice_.run_and_score(value, None, score=False)
        cut = cut and self._split.weights_at_top
        with slice_.reporting(slice_.forward_step, microbatch), self.rng.forward() as start:
            output, cuts = self._train_forward(microbatch, inputs, value, target, start, cut)
        if self.is_last:
            loss = cast(torch.Tensor, output)
            self.losses[microbatch] = loss.detach()
            saved: tuple[torch.Tensor, ...] = (loss,)
        else:
            saved = output if isinstance(output, tuple) else (output,)
        if self._source.recomputes:
            saved = tuple(t.detach() if isinstance(t, torch.Tensor) else t for t in saved)
        self._stash[microbatch] = _Stashed(inputs, saved, cuts)
        return output

    def _train_forward(
        self,
        microbatch: int,
        inputs: tuple[torch.Tensor, ...],
        value: object,
        target: object,
        start: State,
        cut: bool,
    ) -> tuple[object, Cuts | None]:
        """A training forward's output and, for a split backward (or ``cut``), its layers'
        cuts. ``start`` is the random stream's state at its start, which a recomputation
        replays. On the last stage the loss is part of the (possibly recomputed) work, so a
        checkpointed micro-batch keeps nothing but its inputs."""
        policy, source = self._policy, self._source
        cuts = self._split.cuts(cut) if policy.may_cut(microbatch) else None
        run = source.run(microbatch, target, cuts)
        # a forward that runs again (recomputed) must find its input as it was
        work = self._slice.entering(run, policy.recomputes(microbatch) or source.recomputes)
        ledger = self.ledger.recording(microbatch, inputs) if self.ledger else nullcontext()
        with self._slice.watching(value), ledger, gathering_statistics(
            self.index, self.module
        ):
            if isinstance(source, VersionedWeights) and source.recomputes:
                output = work(value)  # its graph is dropped: the backward recomputes
                source.keep(microbatch, value, target, start)  # on the live weights
            else:
                output = policy.run(microbatch, work, value, target, start)
        return output, cuts

    def backward(
        self, microbatch: int, grads: Sequence[torch.Tensor | None],
        loss_scale: float | torch.Tensor = 1.0,
    ) -> list[torch.Tensor | None]:
        """Backpropagate micro-batch ``microbatch`` from its output gradients (on the last
        stage, from ``loss_scale``: fp16's); return the gradients of the inputs that the
        previous stage asked for, None for one that got none (as plain training leaves
        ``.grad`` None where no path leads: the stages before then get none either, and an
        optimizer skips their weights). An output whose gradient is None is no root of the
        backward. Under ``split_backward``, and for a micro-batch whose forward was cut whole,
        only the input gradients: its weight gradients wait for ``backward_weights``
        (:meth:`weights_pending` says so)."""
        stashed = self._stash.pop(microbatch)
        wanted = [x for x in stashed.inputs if x.requires_grad]
        if isinstance(self._source, VersionedWeights):
            found = self._source.backward(microbatch, stashed.outputs, wanted, grads, loss_scale)
            if self.ledger:
                self.ledger.release(microbatch)
            return found
        roots = [t for t in stashed.outputs if t.requires_grad]
        received = self._slice.output_grads(roots, grads, microbatch, loss_scale)
        outputs = [t for t, g in zip(roots, received, strict=True) if g is not None]
        given = [g for g in received if g is not None]
        split = self._split.splits(stashed.cuts)
        with self._slice.reporting("backward", microbatch):
            if not split:
                if outputs:
                    torch.autograd.backward(outputs, given)
                found = [x.grad for x in wanted]
                if self._policy.release(microbatch):
                    # a replayed backward's input gradients may be the graph's own buffers
                    found = [g.clone() if g is not None else None for g in found]
            else:
                found = self._split.input_gradients(
                    microbatch, stashed.cuts, outputs, given, wanted
                )
        if self.ledger and not split:
            self.ledger.release(microbatch)
        return found

    def backward_weights(self, microbatch: int) -> None:
        """W of a split backward: accumulate micro-batch ``microbatch``'s weight gradients
        (pipetrain/runtime/split_backward.py)."""
        self._split.backward_weights(
            microbatch, self._slice.reporting("weight gradients", microbatch)
        )
        if self.ledger:
            self.ledger.release(microbatch)  # the graph goes with W's work
        if self._after_weights is not None:
            self._after_weights()

    def weights_pending(self, microbatch: int) -> bool:
        """Whether micro-batch ``microbatch``'s weight gradients wait for
        :meth:`backward_weights` (its backward was split)."""
        return self._split.pending(microbatch)

    def zero_grad(self) -> None:
        self.losses.clear()
        # synchronised gradients are views into all-reduce buckets; a replayed CUDA graph
        # adds into .grad in place (a .grad set to None would become the graph's buffer);
        # never a weight that another stage of this process steps (and may synchronise)
        for sync in self.syncs:  # a gradient no rank made was dropped for the step
            sync.rebind()
        self._update.zero_grad(keep=bool(self.syncs) or self.graphs is not None)

    def check_backpropagated(self) -> None:
        """Refuse an optimizer step of a synchronous stage while micro-batches still wait for
        their backward (or W): the schedule is incomplete."""
        waiting = self._split.waiting()
        if self._stash or waiting:
            pending = sorted({*self._stash, *waiting})
            raise StageError(
                f"stage {self.index}: optimizer step with micro-batches {pending} "
                "not yet backpropagated; the schedule is incomplete"
            )

    def step(self) -> None:
        """The optimizer step (through the delay compensation, if any), then the learning-rate
        schedule's; always steps. Its list's STEP action calls it: on a synchronous stage
        after the rank's AGREE decided the step is taken (pipetrain/runtime/update.py: skipped
        steps never get here, or the optimizer skips them on the device); on an asynchronous
        one it then clears the gradients and starts its next weight version (micro-batches
        stay in flight)."""
        versions = self.versions
        if versions is None:
            self.check_backpropagated()
            self._update.step()
            return
        self._update.step(versions.compensator)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        versions.stepped()
