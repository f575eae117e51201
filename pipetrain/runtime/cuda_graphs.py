"""CUDA graphs of a stage's forward and backward (``Pipeline(cuda_graphs=True)``).

A small model trained on a fast GPU is host-bound: the host launches kernels more slowly than
the GPU runs them. A CUDA graph records one micro-batch's kernels once and replays them with one
launch. Each stage captures, per micro-batch signature (the shapes, dtypes and gradient flags
of its inputs and target), one forward graph and one backward graph with
``torch.cuda.make_graphed_callables``, and replays them in later steps.

How it fits the pipeline:

- **Slots.** A captured pair keeps its activations in its own memory pool, so a pair serves one
  micro-batch at a time. A stage gets as many pairs (slots) as the schedule keeps micro-batches
  in flight on it (GPipe: all of them; 1F1B: at most stages - s); a micro-batch takes a free
  slot at its forward and gives it back after its backward. Slots share nothing, so they may
  replay in any order; the price is one pool per slot (each holds its micro-batch's
  activations, as eager training does, plus its graph's temporaries).
- **What each slot owns.** Its own copies of the sample inputs as the graph's static inputs:
  a replay copies its micro-batch into them and the backward graph reads them (a Linear's
  input, the loss's target), so shared ones would backpropagate a micro-batch with the inputs
  of the one replayed after it.
- **When.** The first step with a new signature runs eagerly and keeps one micro-batch as the
  sample; after that step, with no stage at work, every stage captures its pending signatures
  (capture is process-wide: no other thread may use CUDA meanwhile, and the garbage collector
  is held: freeing another pipeline's graph, which only the collector frees, invalidates a
  capture). A new shape is captured anew the same way, up to ``MAX_SIGNATURES`` per stage;
  beyond that ``True`` refuses and ``"auto"`` runs the new shapes eagerly.
- **Same numbers as eager.** The graphs read the live parameters and accumulate into their
  ``.grad`` in place (the stage keeps its gradients allocated), the outputs, the loss and the
  input gradients are copied out of the graph's buffers before the next replay can overwrite
  them, autocast runs without its weight-cast cache (which a replay cannot use), and dropout
  draws from the stage's own stream: the default CUDA generator is graph-safe, and each replay
  takes its seed and offset from the generator's state at that moment, which the stage's stream
  installs (pipetrain/runtime/rng.py). Capture runs on a copy of that state and puts buffers back
  (BatchNorm's running statistics), so warming up changes nothing.

``cuda_graphs=True`` refuses what cannot be captured, at construction, with the reason: CPU
stages, recomputation, asynchronous and split-backward schedules, memory tracking, deferred
BatchNorm, module hooks; and at capture, a model that synchronises with the host (``.item()``,
printing a tensor, data-dependent shapes). ``cuda_graphs="auto"`` runs those stages (or shapes)
eagerly instead and logs why; a failed capture takes the default CUDA generator back out of
capture mode, so dropout keeps working eagerly.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn
from torch.utils import _pytree

from pipetrain.errors import StageError
from pipetrain.observe.progress import logger
from pipetrain.runtime.rng import StageRng
from schedules import Kind, Schedule

MODES = (False, True, "auto")
MAX_SIGNATURES = 4  # captured micro-batch signatures per stage
WARMUP = 3  # eager iterations before a capture (lazy initialisation stays out of the graph)
Signature = tuple[str, tuple[tuple[tuple[int, ...], torch.dtype, bool], ...]]


def check_mode(mode: object) -> bool | str:
    """``mode`` if it is one of False, True, "auto"; else a clear error."""
    if not any(mode is m or (isinstance(m, str) and mode == m) for m in MODES):
        raise ValueError(f"cuda_graphs must be False, True or 'auto', got {mode!r}")
    return mode  # type: ignore[return-value]


def pipeline_refusal(
    schedule: Schedule, recompute: str | tuple[str, ...], track_memory: bool,
    deferred_batch_norm: bool,
) -> str | None:
    """Why no stage of this pipeline can replay graphs (None: nothing in the way)."""
    if schedule.asynchronous:
        return (
            f"schedule {schedule.name!r} is asynchronous: each micro-batch reads its own "
            "weight version, which a captured graph cannot switch"
        )
    if schedule.splits_backward:
        return (
            f"schedule {schedule.name!r} splits the backward into B and W passes, which "
            "make_graphed_callables captures as one"
        )
    if recompute != "never":  # one mode for every stage, or one per stage
        return (
            f"recompute={recompute!r} recomputes forwards inside the backward; capture needs "
            "recompute='never'"
        )
    if track_memory:
        return "track_memory counts the tensors autograd saves, and a replayed graph saves none"
    if deferred_batch_norm:
        return "deferred_batch_norm keeps its statistics in Python between micro-batches"
    return None


def stage_refusal(index: int, device: torch.device, module: nn.Module) -> str | None:
    """Why stage ``index`` cannot be captured (None: it can)."""
    if device.type != "cuda":
        return f"cuda_graphs=True needs CUDA devices; stage {index} is on {device}"
    hooked = [
        name or type(m).__name__ for name, m in module.named_modules()
        if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
    ]
    if hooked:
        return (
            f"stage {index}'s modules {hooked} have hooks, which would run only while "
            "capturing, not at each replay"
        )
    return None


def slots_needed(schedule: Schedule, stage: int) -> int:
    """The most micro-batches stage ``stage`` holds between forward and backward at once."""
    held = most = 0
    for action in schedule.actions[schedule.rank_of(stage)]:
        if action.stage == stage and action.kind is Kind.FORWARD:
            held += 1
            most = max(most, held)
        elif action.stage == stage and action.kind is Kind.BACKWARD:
            held -= 1
    return max(most, 1)


def signature(leaves: list[Any], spec: _pytree.TreeSpec) -> Signature:
    """What a captured graph is fixed to: the structure and each tensor's shape, dtype and
    gradient flag."""
    if not all(isinstance(t, torch.Tensor) for t in leaves):
        kinds = sorted({type(t).__name__ for t in leaves if not isinstance(t, torch.Tensor)})
        raise TypeError(f"a CUDA graph takes tensors only; this stage's input holds {kinds}")
    return str(spec), tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in leaves)


class _Capturable(nn.Module):
    """A stage's run with flat tensor arguments and a tuple result, as make_graphed_callables
    wants; ``body`` makes the stage's parameters its own (the graph's other inputs)."""

    def __init__(self, body: nn.Module, run: Callable[[object, object], object],
                 spec: _pytree.TreeSpec):
        super().__init__()
        self.body = body
        self._run, self._spec = run, spec
        self.returns_tuple = False
        self.differentiable: tuple[bool, ...] = ()  # per output: whether it carries a gradient

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        value, *target = _pytree.tree_unflatten(list(tensors), self._spec)
        out = self._run(value, target[0] if target else None)
        self.returns_tuple = isinstance(out, tuple)
        result = tuple(out) if isinstance(out, tuple) else (cast(torch.Tensor, out),)
        self.differentiable = tuple(t.requires_grad for t in result)
        return result


class StageGraphs:
    """The graphs of stage ``index``: per signature, ``slots`` captured forward/backward pairs
    of ``run(value, target)`` (the stage's slice and, on the last stage, its loss). ``strict``
    (``cuda_graphs=True``) raises where ``"auto"`` falls back to eager."""

    def __init__(self, index: int, device: torch.device, module: nn.Module,
                 run: Callable[[object, object], object], rng: StageRng, slots: int,
                 strict: bool):
        self.index, self.device, self.module = index, device, module
        self._run, self.rng, self.slots, self.strict = run, rng, slots, strict
        self._free: dict[Signature, list[_Capturable]] = {}
        self._pending: dict[Signature, tuple[list[torch.Tensor], _pytree.TreeSpec]] = {}
        self._taken: dict[int, tuple[Signature, _Capturable]] = {}
        self.eager_only = False  # "auto" after a failed capture
        self.replays = 0  # forwards replayed so far (tests and benchmarks read it)

    @property
    def captured(self) -> int:
        """How many signatures have graphs."""
        return len(self._free)

    def forward(self, microbatch: int, value: object, target: object) -> object:
        """The output of ``run(value, target)``: replayed when this signature is captured, else
        run eagerly (and its signature noted for capture after the step)."""
        # a stage without a target (all but the last) passes none into the graph
        leaves, spec = _pytree.tree_flatten((value,) if target is None else (value, target))
        key = signature(leaves, spec)
        free = self._free.get(key)
        if free is None:
            self._note(key, leaves, spec)
            return self._run(value, target)
        if not free:
            raise StageError(
                f"stage {self.index}: micro-batch {microbatch} found no free CUDA graph slot; "
                f"the schedule holds more than {self.slots} micro-batches here"
            )
        graphed = free.pop()
        self._taken[microbatch] = (key, graphed)
        # copies: the graph's buffers get reused; an output without a gradient eagerly stays
        # without one (the graph's autograd node would give every float output one)
        outputs = tuple(
            o.clone() if grad else o.detach().clone()
            for o, grad in zip(graphed(*leaves), graphed.differentiable, strict=True)
        )
        self.replays += 1
        return outputs if graphed.returns_tuple else outputs[0]

    def _note(self, key: Signature, leaves: list[torch.Tensor], spec: _pytree.TreeSpec) -> None:
        """Keep a sample of a new signature for capture after the step, if there is room."""
        if self.eager_only or key in self._pending:
            return
        if len(self._free) + len(self._pending) >= MAX_SIGNATURES:
            if self.strict:
                raise ValueError(
                    f"stage {self.index} has seen more than {MAX_SIGNATURES} micro-batch shapes "
                    "and captures each anew: pad the inputs to a few fixed shapes, or pass "
                    "cuda_graphs='auto' (eager for further shapes) or cuda_graphs=False"
                )
            return
        sample = [t.detach().clone().requires_grad_(t.requires_grad) for t in leaves]
        self._pending[key] = (sample, spec)

    def release(self, microbatch: int) -> bool:
        """After micro-batch ``microbatch``'s backward: free its slot. Whether it was replayed
        (its input gradients may then be the graph's own buffers: copy them before use)."""
        taken = self._taken.pop(microbatch, None)
        if taken is None:
            return False
        self._free[taken[0]].append(taken[1])
        return True

    def capture_pending(self) -> None:
        """Capture every signature noted in the last step; call it while no stage runs."""
        pending, self._pending = self._pending, {}
        for key, (sample, spec) in pending.items():
            try:
                with _quiet_collector(self.device):
                    self._free[key] = [self._capture(sample, spec) for _ in range(self.slots)]
                logger.info("stage %d: captured %d CUDA graph pairs for %s", self.index,
                            self.slots, key)
            except Exception as error:  # the capture's own error, and what ended it
                cause = error.__context__ or error.__cause__
                reason = f"{type(error).__name__}: {error}" + (
                    f" (after {type(cause).__name__}: {cause})" if cause is not None else ""
                )
                message = (
                    f"stage {self.index}: capturing its CUDA graph failed: {reason}. A graph "
                    "cannot hold host synchronisations (.item(), float(tensor), printing a "
                    "tensor, data-dependent shapes such as nonzero or boolean masks) or CPU "
                    "work; remove them from the model, or pass cuda_graphs='auto' (this stage "
                    "then runs eagerly) or cuda_graphs=False"
                )
                if self.strict:
                    raise StageError(message) from error
                logger.warning("%s; running eagerly", message)
                self.eager_only = True
                return

    def _capture(self, sample: list[torch.Tensor], spec: _pytree.TreeSpec) -> _Capturable:
        """One forward/backward pair in a pool of its own, captured on a copy of the stage's
        random stream and with the buffers put back afterwards. Its static inputs are its own
        copies of ``sample``: a replay copies its micro-batch into them and the backward graph
        reads them (a Linear's input, a loss's target), so slots sharing them would backpropagate
        one micro-batch with another's inputs."""
        capturable = _Capturable(self.module, self._run, spec)
        sample = [t.detach().clone().requires_grad_(t.requires_grad) for t in sample]
        buffers = [b.detach().clone() for b in self.module.buffers()]
        pool = torch.cuda.graph_pool_handle()  # this slot's own: its replays may interleave
        try:  # a failed capture puts the buffers back too (its warm-up ran eagerly)
            with torch.cuda.device(self.device), self.rng.replay(self.rng.state):
                graphed = torch.cuda.make_graphed_callables(
                    capturable, tuple(sample), num_warmup_iters=WARMUP,
                    allow_unused_input=True, pool=pool,
                )
        except Exception:
            _clean_up_failed_capture(self.device, pool)
            raise
        finally:
            with torch.no_grad():
                for buffer, saved in zip(self.module.buffers(), buffers, strict=True):
                    buffer.copy_(saved)
        return graphed  # type: ignore[return-value]


@contextmanager
def _quiet_collector(device: torch.device) -> Iterator[None]:
    """No garbage collection while capturing. make_graphed_callables leaves each graphed module
    in a reference cycle (its forward is a closure over it), so graphs of a dropped pipeline are
    freed by the cyclic collector, whenever it runs; freeing a graph during a capture is an
    operation the capture forbids, and it invalidates the capture. Collect first, then hold."""
    was_enabled = gc.isenabled()
    gc.collect()
    torch.cuda.synchronize(device)
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _clean_up_failed_capture(device: torch.device, pool: Any) -> None:
    """Undo what a capture that failed (its end raised) left half done, so that eager work and
    later captures in this process stay right:

    - the caching allocator may still route the capture stream's allocations to ``pool``
      (torch ends that after the check that raised): later captures on that stream, in other
      pools, would then share its memory with each other, and one slot's replay could overwrite
      another's saved activations;
    - the device's default CUDA generator stays in capture mode (a capture puts it in at its
      start and takes it out at its end): every random draw outside a capture (dropout in an
      eager forward) then raises "Offset increment outside graph capture". A capture that
      succeeds, with nothing in it, takes it out again."""
    with torch.cuda.device(device):
        try:
            torch._C._cuda_endAllocateToPool(
                torch.cuda.current_device(), pool
            )
        except RuntimeError:
            pass  # this torch ended it before the check that raised: nothing to undo
    try:
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                torch.zeros(1, device=device)
            del graph
    except Exception as error:  # dropout outside a capture then fails loudly, never silently
        logger.warning("could not take %s's CUDA generator out of capture mode after a failed "
                       "capture (%s: %s); random draws on it may fail", device,
                       type(error).__name__, error)
