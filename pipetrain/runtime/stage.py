"""One stage of the pipeline: its slice of the model and what it keeps between F and B.

The stage knows nothing of schedules or links: the executor hands it a micro-batch's inputs for
a forward and the output gradients for a backward, and the stage returns what must cross the
next boundary. Between the two it stashes, per micro-batch, the inputs (whose gradients flow
back) and the outputs (or, on the last stage, the loss).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import cast

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint as recompute

from pipetrain.errors import StageError
from pipetrain.observe.memory import ActivationLedger
from pipetrain.runtime.cuda_graphs import StageGraphs
from pipetrain.runtime.data_parallel import Sync
from pipetrain.runtime.rng import StageRng, State, draw_seeds
from pipetrain.runtime.stage_module import Cuts, LayerRun, StageModule, alias
from pipetrain.training.batchnorm import gathering_statistics
from pipetrain.training.precision import autocast, to_boundary
from pipetrain.training.weights import WeightVersions

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
# an asynchronous stage's weight versions, from its trained weights and optimizer
VersionsFactory = Callable[[list[nn.Parameter], torch.optim.Optimizer | None], WeightVersions]


def build_optimizer(
    params: list[nn.Parameter], optimizer: OptimizerFactory | None,
    lr_scheduler: SchedulerFactory | None,
) -> tuple[torch.optim.Optimizer | None, torch.optim.lr_scheduler.LRScheduler | None]:
    """A stage's optimizer of ``params`` (None without a factory or weights) and its
    learning-rate schedule, one stepped per update."""
    built = optimizer(params) if optimizer is not None and params else None
    scheduler = lr_scheduler(built) if lr_scheduler and built is not None else None
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise ValueError(
            "ReduceLROnPlateau steps on a validation metric, not once per update: call its "
            "step(metric) yourself on pipe.stages[i].optimizer, or pass a per-update "
            "schedule (LambdaLR, CosineAnnealingLR, ...) as lr_scheduler"
        )
    return built, scheduler


# W's work for one micro-batch: (tensors, their gradients, the weights to reach from them)
_WeightWork = tuple[list[torch.Tensor], list[torch.Tensor], list[nn.Parameter]]


@dataclass
class _Stashed:
    inputs: tuple[torch.Tensor, ...]  # leaves whose .grad goes back to the previous stage
    outputs: tuple[torch.Tensor, ...]  # what backward starts from (the scaled loss on the last)
    # split backward: the layers' cuts (pipetrain/runtime/stage_module.py); B finds the gradients of
    # their aliases and W backpropagates each layer from them to its weights alone. None: W
    # backpropagates the stage's outputs (a recomputed micro-batch, or weights used twice)
    cuts: Cuts | None = None


def _tensors(value: object) -> list[torch.Tensor]:
    """The tensors of a stage's input: a tensor, or a tuple or list of them."""
    members = value if isinstance(value, tuple | list) else (value,)
    return [t for t in members if isinstance(t, torch.Tensor)]


def _own_version(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory under a version counter of its own (no copy). Micro-batches are
    views of one mini-batch, which share its counter: once a stage modifies its input in
    place, each micro-batch needs its own, or autograd takes the next micro-batch's change
    for one of the data a backward needs."""
    return tensor.new_empty(0).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride()
    )


def _entered(value: object, copy: bool, own_versions: bool) -> object:
    """A stage's input (a tensor or a tuple or list of them) as its first layer reads it, so
    that the layer may modify it in place as a model's own layers may: through :func:`alias`
    where it needs a gradient (the stashed inputs, leaves, only collect gradients), under a
    version counter of its own where asked; copied when the forward will run again on the
    same input (recomputation), which an in-place op must not have changed."""

    def enter(t: object) -> object:
        if not isinstance(t, torch.Tensor):
            return t
        if copy:
            return t.clone()
        if t.requires_grad:
            return alias(t)
        return _own_version(t) if own_versions else t

    if type(value) is tuple:
        return tuple(enter(t) for t in value)
    if type(value) is list:
        return [enter(t) for t in value]
    return enter(value)


class _Runner(nn.Module):
    """Wraps a stage's slice so that ``torch.func.functional_call`` swaps its weights while the
    stage runs it layer by layer (its errors still name the layer)."""

    def __init__(self, body: nn.Module, run: Callable[..., object]):
        super().__init__()
        self.body = body
        self._run = run

    def forward(self, value: object, target: object = None) -> object:
        return self._run(value, target=target)


class Stage:
    """Stage ``index`` of ``count``: a module slice on ``device`` with its optimizer."""

    def __init__(
        self,
        module: nn.Sequential,
        index: int,
        count: int,
        offset: int,
        device: torch.device,
        optimizer: OptimizerFactory | None,
        loss_fn: LossFn | None,
        *,
        recompute_below: int = 0,
        track_memory: bool = False,
        owned_elsewhere: frozenset[int] = frozenset(),
        split_backward: bool = False,
        lr_scheduler: SchedulerFactory | None = None,
        autocast_dtype: torch.dtype | None = None,
        seed: int | None = None,
        syncs: Sequence[Sync] = (),
        weight_versions: VersionsFactory | None = None,
        loss_divisor: int = 1,
    ):
        """Training micro-batches numbered below ``recompute_below`` keep only their inputs
        and recompute their forward in the backward (pipetrain/runtime/config.py derives it from the
        checkpoint mode). On the last stage the backward starts from the loss scale over
        ``loss_divisor`` (the micro-batches of one update), so the gradients are those of the
        mean loss. ``autocast_dtype`` is the stage's mixed precision (None: fp32). ``seed``
        starts the stage's random stream (pipetrain/runtime/rng.py); by default one drawn from the
        global generator. ``syncs`` all-reduce gradients before each optimizer step (their
        parameters must already be on ``device``). ``weight_versions`` makes the stage
        asynchronous (pipetrain/training/weights.py)."""
        self.module = StageModule.of(module).to(device)  # hooks on it run (stage_module.py)
        self._at = LayerRun()  # the layer at work, named if it fails
        self.rng = StageRng(draw_seeds(1)[0] if seed is None else seed, device)
        self.index, self.count, self.offset = index, count, offset
        self.device = device
        self.loss_fn = loss_fn
        self.recompute_below = recompute_below
        # A weight tied to a layer of another stage in this process is stepped by that stage.
        params = [
            p for p in self.module.parameters() if p.requires_grad and id(p) not in owned_elsewhere
        ]
        self._owned = params  # what this stage steps and zeroes
        self.optimizer, self.scheduler = build_optimizer(params, optimizer, lr_scheduler)
        self.autocast_dtype = autocast_dtype  # mixed precision (pipetrain/training/precision.py)
        self.syncs = list(syncs)  # gradient all-reduces before each optimizer step
        self.ledger = ActivationLedger.for_parameters(params) if track_memory else None
        self._stash: dict[int, _Stashed] = {}
        # "stale" recomputation: the inputs, target and random state of the forward
        self._targets: dict[int, tuple[object, object, State]] = {}
        self.losses: dict[int, torch.Tensor] = {}
        # Split backward (schedules with W): B computes input gradients, W weight gradients.
        self.split_backward = split_backward
        self._weights = [p for p in self.module.parameters() if p.requires_grad]
        per_layer = [[p for p in layer.parameters() if p.requires_grad] for layer in self.module]
        distinct = len({id(p) for p in self._weights}) == sum(len(ps) for ps in per_layer)
        # W per layer from its outputs' gradients needs each weight in one layer only; else
        # (and for recomputed micro-batches) W backpropagates the stage's outputs again.
        self._layer_weights = per_layer if distinct else None
        # A layer with weights inside it (a transformer block) would have its insides
        # backpropagated again by W; layers that hold their weights themselves (Linear, Conv,
        # norms) need only their weight gradients there. Weights sharded by FSDP2 (ZeRO 2, 3:
        # sharding.py) are reduce-scattered as the armed last backward's B ends, before this
        # cut's W (split-backward schedules reduce after their last W instead); and autocast
        # keeps no cast of them across micro-batches (with a kept cast, bf16 gradients came
        # out wrong: tests/runtime/test_zero.py).
        sharded = any(isinstance(p, DTensor) for p in self._weights)
        self._weights_at_top = distinct and not sharded and not any(
            p.requires_grad for layer in self.module for child in layer.children()
            for p in child.parameters()
        )
        self._weight_work: dict[int, list[_WeightWork]] = {}
        # what W computes gradients of, for given weights (sharding.py: FSDP2's gathered ones)
        self.weight_leaves: Callable[[Sequence[nn.Parameter]], list[torch.Tensor]] = list
        # Asynchronous schedules: which weights each micro-batch reads
        # (pipetrain/training/weights.py).
        self.versions = (
            weight_versions(self._weights, self.optimizer) if weight_versions is not None else None
        )
        self.loss_divisor = loss_divisor
        self._names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        self.graphs: StageGraphs | None = None  # CUDA graphs (pipetrain/runtime/cuda_graphs.py)
        self._autocast_cache = not sharded
        self._own_versions = False  # a forward modified an input in place (see _own_version)

    def use_graphs(self, slots: int, strict: bool) -> None:
        """Replay CUDA graphs of the training forward and backward
        (pipetrain/runtime/cuda_graphs.py), ``slots`` micro-batches at a time. Gradients then stay
        allocated (a replay adds into them in place) and autocast keeps no weight-cast cache (a
        replay cannot use one)."""
        self._autocast_cache = False
        self.graphs = StageGraphs(
            self.index, self.device, self.module, self._run_and_score, self.rng,
            slots, strict,
        )

    def _functional(
        self, weights: list[torch.Tensor] | None, target: object
    ) -> Callable[[object], object]:
        """``_run_and_score`` against ``target`` on ``weights`` in place of the parameters
        (None: the parameters themselves)."""
        if weights is None:
            return partial(self._run_and_score, target=target)
        runner = _Runner(self.module, self._run_and_score)
        mapping = {"body." + n: w for n, w in zip(self._names, weights, strict=True)}
        return lambda value: torch.func.functional_call(
            runner, mapping, (value,), {"target": target}
        )

    @contextmanager
    def _reporting(self, step: str | Callable[[], str], microbatch: int) -> Iterator[None]:
        """Raise what fails inside as a StageError naming this stage, ``step`` (a callable:
        named once it failed) and the micro-batch; a StageError passes as it is."""
        try:
            yield
        except StageError:
            raise
        except Exception as error:
            name = step() if callable(step) else step
            raise StageError(
                f"stage {self.index}, {name} of micro-batch {microbatch} failed: "
                f"{type(error).__name__}: {error}"
            ) from error

    def _forward_step(self) -> str:
        """The failed part of a forward: the layer it was in, or the loss."""
        position = self._at.position
        if position < len(self.module):
            layer = self.module[position]
            return f"layer {self.offset + position} ({type(layer).__name__}), forward"
        return "loss_fn, forward"

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

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
        self._at.position = 0
        if not training:  # eval mode draws nothing: no stream, no turn to wait for (rng.py)
            with self._reporting(self._forward_step, microbatch), torch.no_grad():
                return self._run_and_score(value, None, score=False)
        cut = cut and self._weights_at_top
        with self._reporting(self._forward_step, microbatch), self.rng.forward() as start:
            output, cuts = self._train_forward(microbatch, inputs, value, target, start, cut)
        if self.is_last:
            loss = cast(torch.Tensor, output)
            self.losses[microbatch] = loss.detach()
            saved: tuple[torch.Tensor, ...] = (loss,)
        else:
            saved = output if isinstance(output, tuple) else (output,)
        if self.versions is not None and self.versions.recomputes:
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
        cut: bool = False,
    ) -> tuple[object, Cuts | None]:
        """A training forward's output and, for a split backward (or ``cut``), its layers'
        cuts. ``start`` is the random stream's state at its start, which a recomputation
        replays."""
        # On the last stage the loss is part of the (possibly recomputed) work, so a
        # checkpointed micro-batch keeps nothing but its inputs.
        recomputed = microbatch < self.recompute_below
        cuts = None
        layers = self._layer_weights if self.graphs is None else None  # a replay cuts nothing
        if (self.split_backward or cut) and not recomputed and layers is not None:
            cuts = Cuts(layers)
        run: Callable[[object], object] = partial(self._run_and_score, target=target, cuts=cuts)
        versions = self.versions
        if versions is not None:  # asynchronous: the weights this micro-batch reads
            run = self._functional(versions.forward_weights(microbatch), target)
        # a forward that runs again (recomputed) must find its input as it was
        again = recomputed or (versions is not None and versions.recomputes)

        def work(value: object) -> object:
            return run(_entered(value, again, self._own_versions))

        plain = [(t, t._version) for t in _tensors(value) if not t.requires_grad]

        ledger = self.ledger.recording(microbatch, inputs) if self.ledger else nullcontext()
        with ledger, gathering_statistics():
            if versions is not None and versions.recomputes:
                output = work(value)  # its graph is dropped: the backward recomputes
                self._targets[microbatch] = (value, target, start)  # on the live weights
            elif recomputed:  # its input under a version counter of its own: checkpoint
                # checks it, and another micro-batch may modify its own in place
                output = recompute(
                    work, _entered(value, False, True), use_reentrant=False,
                    preserve_rng_state=False,
                    context_fn=partial(self.rng.checkpoint_contexts, start),
                )
            elif self.graphs is not None:
                output = self.graphs.forward(microbatch, value, target)
            else:
                output = work(value)
        if any(t._version != seen for t, seen in plain):  # modified in place: see _own_version
            self._own_versions = True
        return output, cuts

    def _run_and_score(
        self, value: object, target: object, cuts: Cuts | None = None, score: bool = True
    ) -> object:
        """The slice's output (in the autocast dtype, for the next stage), or on the last stage
        its loss against ``target`` (``score=False``: its output). ``cuts`` collects a split
        backward's cuts."""
        with autocast(self.device, self.autocast_dtype, cache=self._autocast_cache):
            self._at.cuts = cuts
            try:
                output = self.module(value, run=self._at)
            finally:
                self._at.cuts = None
            if self.is_last:
                return self._loss(output, target) if score else output
        return to_boundary(output, self.autocast_dtype)

    def _loss(self, output: object, target: object) -> torch.Tensor:
        if self.loss_fn is None:
            raise ValueError("training needs loss_fn: pass Pipeline(..., loss_fn=...)")
        self._at.position = len(self.module)  # past the last layer: the loss is to blame
        loss = self.loss_fn(output, target)  # type: ignore[arg-type]
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(
                "loss_fn must return a scalar tensor (use reduction='mean'), "
                f"got {type(loss).__name__} of shape {getattr(loss, 'shape', None)}"
            )
        return loss

    def _output_grads(
        self, outputs: list[torch.Tensor], grads: Sequence[torch.Tensor | None],
        microbatch: int, loss_scale: float | torch.Tensor,
    ) -> Sequence[torch.Tensor | None]:
        """The gradients to start the backward of ``outputs`` from: on the last stage the loss
        scale over the loss divisor (the mean over micro-batches, without a division in each
        micro-batch's graph), else the received ones, one per output that needs a gradient
        (None: the next stage's input got none, as a detached one)."""
        if self.is_last:
            if not outputs:
                return []
            if isinstance(loss_scale, torch.Tensor):  # fp16's, on the device (precision.py)
                scaled = loss_scale / self.loss_divisor
                return [scaled.to(outputs[0].dtype).expand_as(outputs[0])]
            return [torch.full_like(outputs[0], loss_scale / self.loss_divisor)]
        if len(grads) != len(outputs):
            raise StageError(
                f"stage {self.index}: received {len(grads)} gradients for micro-batch "
                f"{microbatch} but {len(outputs)} outputs need one"
            )
        return grads

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
        if self.versions is not None:
            return self._versioned_backward(microbatch, stashed, grads, loss_scale)
        roots = [t for t in stashed.outputs if t.requires_grad]
        received = self._output_grads(roots, grads, microbatch, loss_scale)
        outputs = [t for t, g in zip(roots, received, strict=True) if g is not None]
        given = [g for g in received if g is not None]
        wanted = [x for x in stashed.inputs if x.requires_grad]
        # outside a split-backward schedule, only a whole cut splits: W then costs no more
        # than its share of one backward (an uncut W would backpropagate everything again)
        split = self.split_backward or (stashed.cuts is not None and stashed.cuts.whole)
        with self._reporting("backward", microbatch):
            if not split:
                if outputs:
                    torch.autograd.backward(outputs, given)
                found = [x.grad for x in wanted]
                if self.graphs is not None and self.graphs.release(microbatch):
                    # a replayed backward's input gradients may be the graph's own buffers
                    found = [g.clone() if g is not None else None for g in found]
            else:
                found = self._input_gradients(microbatch, stashed, outputs, given, wanted)
        if self.ledger and not split:
            self.ledger.release(microbatch)
        return found

    def _versioned_backward(
        self, microbatch: int, stashed: _Stashed, grads: Sequence[torch.Tensor | None],
        loss_scale: float | torch.Tensor,
    ) -> list[torch.Tensor | None]:
        """Backward of an asynchronous stage: through the weights the forward read (or, with
        "stale" versions, a recomputed forward on the live weights); the weight gradients are
        added to the live parameters' ``.grad``. Its input gradients are never None (zeros
        where none flows): asynchronous schedules send every gradient."""
        versions = self.versions
        assert versions is not None
        weights = versions.backward_weights(microbatch)
        outputs_all = stashed.outputs
        wanted = [x for x in stashed.inputs if x.requires_grad]
        with self._reporting("backward", microbatch):
            if versions.recomputes:  # on the live weights, or PipeMare's corrected ones
                value, target, start = self._targets.pop(microbatch)
                assert not self.is_last, "the last stage has lag 0: nothing to recompute"
                live = all(w is p for w, p in zip(weights, self._weights, strict=True))
                with torch.enable_grad(), self.rng.replay(start):
                    out = self._functional(None if live else weights, target)(
                        _entered(value, False, self._own_versions)
                    )
                outputs_all = out if isinstance(out, tuple) else (out,)
            outputs = [t for t in outputs_all if t.requires_grad]
            received = self._output_grads(outputs, grads, microbatch, loss_scale)
            grads = [g if g is not None else torch.zeros_like(t)
                     for g, t in zip(received, outputs, strict=True)]
            # backward() accumulates into .grad in place: into the live parameters' when the
            # forward read them; else into the copies', which share the live .grad tensors
            # (allocated by the first backward after an update, then moved over below)
            for p, w in zip(self._weights, weights, strict=True):
                if w is not p:
                    w.grad = p.grad
            if outputs and wanted + weights:
                torch.autograd.backward(outputs, list(grads), inputs=wanted + weights)
        for p, w in zip(self._weights, weights, strict=True):
            if w is not p:
                p.grad, w.grad = w.grad, None
        versions.release(microbatch)
        if self.ledger:
            self.ledger.release(microbatch)
        return [x.grad if x.grad is not None else torch.zeros_like(x) for x in wanted]

    def _input_gradients(
        self,
        microbatch: int,
        stashed: _Stashed,
        outputs: list[torch.Tensor],
        grads: list[torch.Tensor],
        wanted: list[torch.Tensor],
    ) -> list[torch.Tensor | None]:
        """B of a split backward: the inputs' gradients and, in the same pass, those of the
        aliases of each cut (no weight gradient is computed); W's work is kept."""
        cuts = stashed.cuts if stashed.cuts is not None and stashed.cuts.whole else None
        aliases = [a for cut in cuts.layers for a in cut.aliases] if cuts else []
        found: list[torch.Tensor | None] = [None] * (len(wanted) + len(aliases))
        if outputs and (wanted or aliases):
            found = list(torch.autograd.grad(
                # tensors and gradient edges mix (torch's annotation has one or the other)
                outputs, cast(list[torch.Tensor], [*wanted, *aliases]), grads,
                retain_graph=True, allow_unused=True,
            ))
        work: list[_WeightWork] = []
        if cuts is not None:
            at = len(wanted)
            for cut in cuts.layers:
                got = found[at : at + len(cut.aliases)]
                at += len(cut.aliases)
                pairs = [(t, g) for t, g in zip(cut.outputs, got, strict=True) if g is not None]
                if pairs:
                    work.append(([t for t, _ in pairs], [g for _, g in pairs], cut.weights))
        elif outputs and self._weights:
            work.append((outputs, grads, self._weights))
        self._weight_work[microbatch] = work
        return found[: len(wanted)]

    def backward_weights(self, microbatch: int) -> None:
        """W of a split backward: accumulate micro-batch ``microbatch``'s weight gradients
        (layer by layer, last first, each from its output gradient found by B). A recomputed
        (checkpointed) micro-batch backpropagates its outputs a second time, which recomputes
        its forward once more (non-reentrant checkpointing recomputes once per backward)."""
        work = self._weight_work.pop(microbatch)
        with self._reporting("weight gradients", microbatch):
            for tensors, grads, weights in reversed(work):
                torch.autograd.backward(
                    tensors, grads, inputs=self.weight_leaves(weights), retain_graph=True
                )
        if self.ledger:
            self.ledger.release(microbatch)  # the graph goes with ``work``

    def weights_pending(self, microbatch: int) -> bool:
        """Whether micro-batch ``microbatch``'s weight gradients wait for
        :meth:`backward_weights` (its backward was split)."""
        return microbatch in self._weight_work

    def zero_grad(self) -> None:
        self.losses.clear()
        # synchronised gradients are views into all-reduce buckets; a replayed CUDA graph
        # adds into .grad in place (a .grad set to None would become the graph's buffer)
        keep = bool(self.syncs) or self.graphs is not None
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=not keep)
            return
        # never a weight that another stage of this process steps (and may synchronise)
        for p in self._owned:
            if p.grad is not None and keep:
                p.grad.zero_()
            else:
                p.grad = None

    def check_backpropagated(self) -> None:
        """Refuse an optimizer step of a synchronous stage while micro-batches still wait for
        their backward (or W): the schedule is incomplete."""
        if self._stash or self._weight_work:
            pending = sorted({*self._stash, *self._weight_work})
            raise StageError(
                f"stage {self.index}: optimizer step with micro-batches {pending} "
                "not yet backpropagated; the schedule is incomplete"
            )

    def step(self) -> None:
        """The optimizer step (through the delay compensation, if any), then the learning-rate
        schedule's; always steps. A synchronous stage is stepped after its whole list, by
        pipetrain/runtime/update.py (which decides whether the step is skipped); an asynchronous one
        by its list's step action, which then clears the gradients and starts its next weight
        version (micro-batches stay in flight)."""
        if self.versions is None:
            self.check_backpropagated()
        if self.optimizer is not None:
            compensator = self.versions.compensator if self.versions is not None else None
            (compensator or self.optimizer).step()
            if self.scheduler is not None:
                self.scheduler.step()
        if self.versions is not None:
            if self.optimizer is not None:
                self.optimizer.zero_grad(set_to_none=True)
            self.versions.stepped()

