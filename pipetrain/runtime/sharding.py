"""ZeRO: a stage's training state sharded over its data-parallel replicas, by torch's engines.

Each stage of a ``stages x replicas`` job has ``replicas`` copies, one per replica, joined by
the replica group of placement.py. ``zero`` says what those copies stop repeating:

* 0: nothing (every copy holds every weight, gradient and optimizer state; gradients are
  all-reduced by data_parallel.py).
* 1: the optimizer state. Gradients are still all-reduced whole; torch's
  ``ZeroRedundancyOptimizer`` gives each replica whole parameters to step (about 1/replicas
  of them, by size) and broadcasts the updated ones.
* 2: and the gradients. FSDP2 (``fully_shard`` per layer with weights, frozen ones too, on a
  one-dimensional mesh of the replica group) keeps each parameter as a dim-0 shard and
  reduce-scatters the gradients; the weights are gathered at the mini-batch's first forward
  and kept whole until its last backward (``reshard_after_forward=False``).
* 3: and the weights: gathered for each forward and again for each backward, freed after.

Under micro-batching ``reduce_scatter`` says when the gradients are reduced. "step" (the
default): once per mini-batch, at the stage's last backward (``set_requires_gradient_sync``):
until then each replica accumulates the whole gradients of its micro-batches, so at zero 2 and
3 a step holds the stage's whole gradients from its first backward to its last.
"microbatch" (FSDP2's own default): every backward (under a split backward every W)
reduce-scatters its gradients at once, each added into the shards' (FSDP2 accumulates
them), so a rank holds a layer's whole gradients only while its backward makes them, at the
price of a reduce-scatter per micro-batch instead of one per step; the sums are the same in
another order. The sharded gradients are what stays between steps (benchmarks/zero_memory.py
measures both modes). The gradients held after the reduce-scatter are
DTensors: update.py reads their local shards for the global norm (each shard counted once),
clips them in place, and the optimizer steps the shards. Checkpoints hold whole tensors
(:class:`Checkpointing`).

A weight tied across stages (an embedding and the head reading it) stays out of the shards at
zero 2 and 3: each copy is whole on every replica, as at zero 0, and its gradient is
all-reduced over the tie's ranks in every replica (data_parallel.GradientSync, summed over the
tied stages, averaged over the replicas), so the copies stay identical. Only the tied weights
are held whole; the rest of the stage is sharded as above. A weight two layers of one stage
share (an embedding and its tied head on the same stage) is sharded once: FSDP2 wants the
modules holding a weight in one unit, so those layers are one ``fully_shard`` call (:func:`units`).

A weight no backward of the step reached, on any replica, has no gradient in one process, and
the optimizer skips it (no weight decay, no moment update). At zero 2 and 3 FSDP2 reduces every
weight, with zeros where a replica made no gradient (``set_reduce_scatter_unused_params``:
otherwise a weight only some replicas' batches reached would make their reduce-scatters differ
in size, a collective mismatch); each replica records which weights it made gradients for (at
the last backward, from the gathered weights' gradients accumulated so far; in it, by their
post-accumulate hooks), one small all-reduce per step sums that presence over the replicas, and
a replica that missed some reads the sums back (in such steps only) and drops the sharded
gradients no replica made. (At zero 0 and 1 the presence rides in the gradients' own
all-reduce: data_parallel.py.) FSDP2 reduce-scatters a layer as the backward leaves it where
the layer's inputs require gradients, else at the backward's end: a data-dependent weight that
is the first one a stage's gradient reaches would have the next layer's inputs require
gradients on some replicas only, and the replicas reduce-scatter in different orders. So each
sharded layer's inputs are made to require gradients (:func:`_inputs_requiring_gradients`;
under a split backward ``finish`` reduces every layer in one order instead). Still not covered
without a split backward: a layer that, in some replicas' last micro-batch only, cuts the
gradient off from two or more sharded layers before it (returns a fresh tensor instead of one
computed from its input): those replicas reduce-scatter those layers at the backward's end, the
others as the backward leaves them, so in another order (gloo aborts on the mismatch, NCCL may
wait out its timeout). Such a model trains at zero=1, or at zero 2 and 3 under zb-h1 or zb-h2.

Timeouts. torch runs the collectives of ZeroRedundancyOptimizer (zero 1: its broadcasts in
``step``) and of FSDP2 (zero 2 and 3: its all-gathers and reduce-scatters, in the forward, the
backward and :meth:`ShardedGradients._reduce`) itself, and waits for them with no timeout of
the call's: each is bounded only by its process group's, so they run in the replica group of
placement.py, created with the pipeline's timeout (not the caller's, init_distributed's 600 s
by default). A replica that stops or dies makes them raise torch's own error within that
timeout, naming no one; each method of torch's that runs them (``step``; FSDP2's parameter
groups' all-gathers and reduce-scatters, fsdp_parts.COLLECTIVES) is wrapped so that its
failure is raised as the presence all-reduce of ``finish`` and the gradient all-reduce of
zero 0 and 1 raise theirs (collectives.Collectives.bounded): a CommunicationTimeout or
PeerError naming the replica's stage and rank, after stopping every peer. So do the gathers of
a checkpoint (:class:`Checkpointing`), before anything is written.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils import _pytree

from pipetrain.checkpoints.checkpointing import WholeState
from pipetrain.runtime import readback
from pipetrain.runtime.fsdp_parts import (
    all_states,
    name_collective_failures,
    param_groups,
    private,
    reduce_unused_weights,
    state,
)
from pipetrain.runtime.stage import OptimizerFactory, Stage
from pipetrain.runtime.stage_module import StageModule, alias
from schedules import Schedule

if TYPE_CHECKING:
    from pipetrain.runtime.collectives import Collectives

LEVELS = (0, 1, 2, 3)
REDUCE_SCATTER = ("step", "microbatch")  # when zero 2 and 3 reduce-scatter (module docstring)


def check_level(zero: object) -> int:
    """``zero`` as a level, refused unless it is one of 0, 1, 2, 3."""
    if isinstance(zero, bool) or zero not in LEVELS:
        raise ValueError(
            f"zero must be 0 (replicas hold everything), 1 (shard the optimizer state), 2 (and "
            f"the gradients) or 3 (and the weights), got {zero!r}"
        )
    return int(zero)


def check_reduce_scatter(mode: object) -> str:
    """``mode`` as one of REDUCE_SCATTER, else refused."""
    if mode not in REDUCE_SCATTER:
        raise ValueError(
            f"reduce_scatter must be 'step' (zero 2 and 3 reduce-scatter the gradients once "
            f"per mini-batch) or 'microbatch' (after every micro-batch's backward, holding only "
            f"the shards), got {mode!r}"
        )
    return str(mode)


def refusal(zero: int, schedule: Schedule, cuda_graphs: bool) -> str | None:
    """Why this pipeline cannot shard at level ``zero`` yet (None: it can)."""
    if zero == 0:
        return None
    if schedule.asynchronous:
        return (
            f"zero={zero} with schedule {schedule.name!r} is not supported: the asynchronous "
            "schedules run without data-parallel replicas; use a synchronous schedule"
        )
    if zero >= 2 and cuda_graphs:
        return (
            f"zero={zero} with cuda_graphs is not supported: a captured graph cannot gather "
            "sharded weights; pass cuda_graphs=False or zero=1"
        )
    return None


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This replica's shard of ``tensor`` (a DTensor), or ``tensor`` itself: in place ops on
    it change the DTensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def sharded(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one replica's shard of a DTensor (each shard to count once)."""
    return isinstance(tensor, DTensor)


def zero_redundancy(
    factory: OptimizerFactory, group: dist.ProcessGroup, collectives: Collectives
) -> OptimizerFactory:
    """The optimizer of ``factory`` with its state sharded over ``group`` (zero=1): torch's
    ZeroRedundancyOptimizer of the same class, parameter groups and settings, its step's
    broadcasts failing as ``collectives`` name a lost replica (module docstring)."""

    def build(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        plain = factory(params)
        accepted = inspect.signature(type(plain).__init__).parameters
        defaults = {k: v for k, v in plain.defaults.items() if k in accepted}
        groups = [dict(g) for g in plain.param_groups]
        return _NamedZeroRedundancy(
            groups, optimizer_class=type(plain), process_group=group,
            collectives=collectives, **defaults,
        )

    return build


class _NamedZeroRedundancy(ZeroRedundancyOptimizer):
    """torch's ZeroRedundancyOptimizer, a failure of its step's broadcasts raised naming the
    lost replica (``collectives``, module docstring). A subclass, not a wrapped ``step``: an
    LR scheduler wraps the step it finds, a bound method."""

    def __init__(self, *args: Any, collectives: Collectives, **options: Any):
        self._collectives = collectives
        super().__init__(*args, **options)

    def step(self, closure: Any = None, **options: Any) -> Any:  # torch's overloads: any
        """torch's step, its failure named."""
        step = super().step
        return self._collectives.call(
            "ZeroRedundancyOptimizer's broadcast of the updated weights (zero=1)",
            [self.process_group], lambda: step(closure, **options),
        )


@dataclass(frozen=True)
class Reduction:
    """When a sharded stage reduce-scatters: ``split_backward`` (zb-h1, zb-h2: after W, not
    B), ``per_microbatch`` (``reduce_scatter="microbatch"``: every backward or W, else once
    per step)."""

    split_backward: bool = False
    per_microbatch: bool = False


class ShardedGradients:
    """FSDP2 on one stage's layers (zero 2 or 3), with data_parallel.GradientSync's two calls:
    ``arm`` before the stage's last gradient-making action of the mini-batch, ``finish`` at
    its step. ``whole``: weights tied across stages, left out of the shards (module
    docstring). ``bring_up(i)`` gives a meta model's layer i its values just before it is
    sharded, so a rank holds one whole layer at a time besides its shards.

    Without a split backward, the last backward reduce-scatters as it ends (armed; at zero 2
    it also frees the gathered weights then). Under a split backward (zb-h1, zb-h2) B ends
    each layer's backward pass before W has made its weight gradients, so FSDP2's own
    post-backward would reduce too early: every layer stays gathered from the mini-batch's
    first forward to its last W (W adds into the gathered weights' gradients, which
    :meth:`leaves` names), and ``finish`` runs each layer's post-backward itself, as
    torch.distributed.pipelining does for FSDP2 (its ``perform_reduce_grad``).

    Per micro-batch (``reduction.per_microbatch``): every backward reduce-scatters as
    it ends (FSDP2's hooks), under a split backward every W (:meth:`weights_made`); at zero 2
    and under a split backward the weights stay gathered until the last one all the same."""

    def __init__(
        self, module: StageModule, group: dist.ProcessGroup, zero: int, device: torch.device,
        bring_up: Callable[[int], object] | None = None,
        whole: Collection[nn.Parameter] = (),
        *,
        collectives: Collectives,
        reduction: Reduction = Reduction(),
    ):
        mesh = DeviceMesh.from_group(group, device_type=device.type)
        split_backward, per_microbatch = reduction.split_backward, reduction.per_microbatch
        self.split_backward, self.per_microbatch = split_backward, per_microbatch
        self.keep_gathered = zero == 2 or split_backward
        # a forward between a B and its W would free the weights W adds into
        reshard = zero == 3 and not split_backward
        kept = set(whole)  # weights tied across stages: whole on every replica (tied_syncs)
        shards: list[nn.Module] = []
        layers = list(dict.fromkeys(module))  # each layer once, in order
        grouped = units(layers, kept)
        for index in range(len(layers)):
            if bring_up is not None:
                bring_up(index)
            unit = [layers[i] for i in grouped.get(index, [])]
            if any(p not in kept for m in unit for p in m.parameters()):
                fully_shard(unit[0] if len(unit) == 1 else unit, mesh=mesh,
                            reshard_after_forward=reshard, ignored_params=kept or None)
                for member in unit:
                    if not split_backward:  # there finish reduces every layer, in one order
                        member.register_forward_pre_hook(_inputs_requiring_gradients,
                                                         prepend=True)
                    if reshard:  # after FSDP2's own post-forward
                        member.register_forward_hook(_aliased_outputs)
                    if per_microbatch:  # every backward reduces: note from the first on
                        member.register_forward_hook(self._hook_gradients)
                shards += unit
        fully_shard(module, mesh=mesh, reshard_after_forward=reshard,
                    ignored_params=kept or None)
        self.module: FSDPModule = module  # type: ignore[assignment]
        self._layers = module  # the same, as an nn.Module
        # each sharded weight's owner and attribute: FSDP2 puts the gathered parameter there
        self._owners = {id(p): (owner, leaf) for _, owner in module.named_modules()
                        for leaf, p in owner._parameters.items() if p is not None and sharded(p)}
        self.group, self.device, self.collectives = group, device, collectives
        reduce_unused_weights(module)  # the same reduce-scatters on every replica
        name_collective_failures(module, lambda what, method: collectives.bounded(
            f"{what} over the replicas (zero={zero})", [group], method))
        self._weights: list[Any] = list({  # FSDP2's FSDPParam of each sharded weight, once
            id(weight): weight for part in module.modules() if isinstance(part, FSDPModule)
            for param_group in param_groups(state(part))
            for weight in private(param_group, "fsdp_params")
        }.values())
        for weight in self._weights:  # what _note_gradients reads, there on this torch
            private(weight, "unsharded_accumulated_grad")
            private(type(weight), "unsharded_param")
        self._seen: set[int] = set()  # the weights this replica made gradients for this step
        # per weight, how many replicas made its gradient this step (summed at finish)
        self._presence = torch.ones(len(self._weights), device=device)
        self._hooked: set[int] = set()
        self._unhooked = len(self._weights)  # weights not yet looked at by _note_gradients
        if split_backward:  # what _reduce reads, there before the first step
            for part in [module, *shards]:
                for group in param_groups(state(part)):
                    private(group, "post_backward")
            all_states(module)
            private(state(module), "_root_post_backward_final_callback")
        self._accumulate()

    def _accumulate(self) -> None:
        """Until armed, backwards add to each replica's whole gradients, not reduced (per
        micro-batch, without a split backward: each reduces as it ends)."""
        self.module.set_requires_gradient_sync(self.per_microbatch and not self.split_backward)
        if self.keep_gathered:
            self.module.set_reshard_after_backward(False)
        if self.split_backward:  # no backward pass is the mini-batch's last: finish is
            self.module.set_is_last_backward(False)

    def arm(self) -> None:
        if self.split_backward:  # the reduce-scatter waits for the last W: finish
            return
        if not self.per_microbatch:  # (per micro-batch the hooks are on, and it reduces)
            self._note_gradients()
            self.module.set_requires_gradient_sync(True)
        if self.keep_gathered:
            self.module.set_reshard_after_backward(True)

    def weights_made(self) -> None:
        """After a W, reduced per micro-batch under a split backward: reduce-scatter its
        gradients into the shards', the weights kept gathered for the Ws still to come."""
        if not (self.split_backward and self.per_microbatch):
            return
        self.module.set_requires_gradient_sync(True)  # is_last_backward stays False: no wait
        self._post_backward()
        self.module.set_requires_gradient_sync(False)  # B's own hooks do not reduce

    def finish(self) -> None:
        """FSDP2 waited for its reduce-scatters when the last backward ended (under a split
        backward, they run here, after the last W); back to accumulating for the next
        mini-batch."""
        if self.split_backward:
            if not self.per_microbatch:
                self._note_gradients()
            self._reduce(sync=not self.per_microbatch)  # per W: reduced, only reshard
        self._accumulate()
        self._drop_absent()

    def _note_gradients(self) -> None:
        """Before the reduce-scatter: the weights whose gathered gradients the backwards so far
        made (kept unreduced until now), and a hook noting those the last backward makes."""
        for i, weight in enumerate(self._weights):
            try:
                gathered = weight.unsharded_param  # FSDP2 keeps it across steps
            except AttributeError:  # never gathered yet: no gradient
                continue
            if gathered.grad is not None or weight.unsharded_accumulated_grad is not None:
                self._seen.add(i)
            if i not in self._hooked:
                self._unhooked -= 1
                self._hooked.add(i)
                if gathered.requires_grad:  # a frozen one gets none
                    gathered.register_post_accumulate_grad_hook(
                        lambda _, i=i: self._seen.add(i)
                    )

    def _hook_gradients(self, *_: object) -> None:
        """A sharded layer's forward hook, reduced per micro-batch: hook the gathered weights
        (there from their first forward on) before any backward reduces their gradients."""
        if self._unhooked:
            self._note_gradients()

    def rebind(self) -> None:
        """None seen yet this step (FSDP2 makes a dropped sharded gradient anew at its next
        reduce-scatter: nothing to give back)."""
        self._seen = set()

    def _drop_absent(self) -> None:
        """Sum the replicas' presence (one small all-reduce); where this replica missed a
        weight, read the sums back and drop the sharded gradients no replica made."""
        missed = [i for i in range(len(self._weights)) if i not in self._seen]
        presence = self._presence.fill_(1)
        for i in missed:
            presence[i].zero_()
        work = dist.all_reduce(presence, group=self.group, async_op=True)
        self.collectives.wait(work, "the replicas' all-reduce of which weights have "
                              "gradients", self.group)
        if not missed:
            return
        counts = readback.wait_for(presence[missed])
        for i, count in zip(missed, counts, strict=True):
            if count == 0:
                self._weights[i].sharded_param.grad = None

    def leaves(self, weights: Sequence[nn.Parameter]) -> list[torch.Tensor]:
        """What W computes the gradients of, for ``weights`` (the stage's parameters): for a
        sharded one, the gathered parameter that FSDP2 put in its place and the forward
        read (its gradient is reduce-scattered into the shard's at :meth:`finish`)."""
        found: list[torch.Tensor] = []
        for weight in weights:
            owner = self._owners.get(id(weight))
            if owner is None:  # whole: not sharded (tied across stages)
                found.append(weight)
                continue
            current = getattr(owner[0], owner[1])
            if sharded(current):
                raise RuntimeError(
                    f"weight {owner[1]!r} of {type(owner[0]).__name__} was resharded before "
                    "its weight gradients (W) were computed; under a split backward each "
                    "layer stays gathered until the step (sharding.ShardedGradients)"
                )
            found.append(current)
        return found

    def _reduce(self, sync: bool) -> None:
        """Each layer's FSDP2 post-backward, now that every W has run: reduce-scatter the
        whole gradients into the shards' (``sync``; else each W did) and free the gathered
        weights; then the root's end of backward (it waits for the reductions and resets
        FSDP2's state for the next mini-batch)."""
        self.module.set_is_last_backward(True)
        self.module.set_reshard_after_backward(True)
        self.module.set_requires_gradient_sync(sync)
        self._post_backward()

    def _post_backward(self) -> None:
        """Every FSDP2 parameter group's post-backward, then the root's end of backward."""
        for own in all_states(self._layers):
            for group in param_groups(own):
                group.post_backward()
        private(state(self._layers), "_root_post_backward_final_callback")()


def units(layers: Sequence[nn.Module], whole: Collection[nn.Parameter]) -> dict[int, list[int]]:
    """The layers sharded as one FSDP2 unit, keyed by the position of the unit's last layer:
    each layer alone, but layers sharing a sharded weight (an embedding and its tied head on
    one stage) together, as FSDP2 requires of a weight two modules hold."""
    owners: dict[int, int] = {}  # weight id -> the unit (its first layer's position)
    unit = list(range(len(layers)))
    for index, layer in enumerate(layers):
        for p in layer.parameters():
            if p in whole:
                continue
            first = owners.setdefault(id(p), unit[index])
            if first != unit[index]:  # join this layer's unit into the earlier one
                unit = [first if u == unit[index] else u for u in unit]
    members: dict[int, list[int]] = {}
    for index, first in enumerate(unit):
        members.setdefault(first, []).append(index)
    return {group[-1]: group for group in members.values()}


def _aliased_outputs(layer: nn.Module, inputs: object, output: object) -> object:
    """A sharded layer's output tensors as later layers read them: identities of their own in
    the graph (stage_module.alias, no copy). At zero 3 FSDP2 gathers a layer's weights again
    for its backward from a hook on its outputs; an in-place op of a later layer on an output
    (``Linear`` then ``ReLU(inplace=True)``) rewrote the output's history, the hook did not
    fire, and the backward read freed weights (``setStorage ... out of bounds for storage of
    size 0``). On the alias, the in-place op leaves the output's history alone."""
    return _pytree.tree_map_only(
        torch.Tensor, lambda t: alias(t) if t.requires_grad else t, output
    )


def _inputs_requiring_gradients(layer: nn.Module, inputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """A sharded layer's floating-point inputs (in tuples and dicts too), each made to require
    gradients where it does not (a new leaf: the caller's tensor is left alone), before FSDP2's
    own pre-forward hook, so every replica reduce-scatters the layer as the backward leaves it,
    in the same order (module docstring). Costs the gradient of such an input (stage 0's first
    layer, a layer after a detached one); no weight's gradient changes."""

    def leaf(x: torch.Tensor) -> torch.Tensor:
        return x.detach().requires_grad_() if x.is_floating_point() and not x.requires_grad else x

    return cast(tuple[Any, ...], _pytree.tree_map_only(torch.Tensor, leaf, inputs))


class Checkpointing:
    """A sharded pipeline's checkpoints hold whole tensors, as an unsharded one's do, so they
    load under any balance, replica count or ``zero``: ``whole`` gathers each stage's state
    from its replicas before the first replica writes it; ``shard`` gives a sharded stage its
    shares of the whole tensors read back.

    The gathers are torch's (``DTensor.full_tensor``'s all-gathers at zero 2 and 3,
    ZeroRedundancyOptimizer's ``consolidate_state_dict`` broadcasts at zero 1), in ``group``,
    created with the pipeline's timeout; each runs through ``collectives`` (module
    docstring), so that a replica that dies or stops during a save makes the others raise an
    error naming it, after stopping every peer, before the first replica writes anything: the
    previous checkpoint stays the one ``latest`` names. Loading runs no collective (every
    replica reads the whole tensors and keeps its shares)."""

    def __init__(self, group: dist.ProcessGroup, collectives: Collectives, zero: int):
        self.group, self.collectives, self.zero = group, collectives, zero

    def whole(self, stages: Sequence[Stage]) -> list[WholeState]:
        """Per stage, its module and optimizer state_dicts whole (on the first replica; the
        optimizer's is None elsewhere). Every replica calls it: it gathers."""
        weights = self._gathering("weights", "DTensor.full_tensor's all-gathers")
        states: list[WholeState] = []
        for stage in stages:
            module = partial(_whole, stage.module.state_dict())
            states.append((self.collectives.call(weights, [self.group], module),
                           self._optimizer_state(stage.optimizer)))
        return states

    def _optimizer_state(self, optimizer: torch.optim.Optimizer | None) -> dict[str, Any] | None:
        """``optimizer``'s state_dict whole (None on a replica other than the first at zero
        1, where torch consolidates it on the first only)."""
        if optimizer is None:
            return None
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            state = optimizer.state_dict()
            what = self._gathering("optimizer state", "DTensor.full_tensor's all-gathers")
            state["state"] = self.collectives.call(what, [self.group], lambda: {
                i: _whole(s) for i, s in state["state"].items()
            })
            return state
        what = self._gathering(
            "optimizer state", "ZeroRedundancyOptimizer.consolidate_state_dict's broadcasts")
        self.collectives.call(what, [self.group], lambda: optimizer.consolidate_state_dict(to=0))
        if dist.get_rank(self.group) != 0:  # to the first replica, by group rank
            return None
        state = optimizer.state_dict()
        # torch keeps the gathered copy, a whole optimizer state: drop it
        optimizer._all_state_dicts = []  # type: ignore[attr-defined]
        return state

    def _gathering(self, what: str, how: str) -> str:
        """How errors name the gather of the sharded ``what`` for a checkpoint, by ``how``."""
        return (f"gathering the sharded {what} for a checkpoint ({how} over the replicas, "
                f"zero={self.zero})")

    @staticmethod
    def shard(
        stage: Stage, modules: dict[str, Any], optimizer_state: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """``modules`` and ``optimizer_state`` (by parameter name) with ``stage``'s whole
        tensors replaced by its shares, placed as its parameters are (no communication:
        every replica read the whole tensors)."""
        modules, optimizer_state = dict(modules), dict(optimizer_state)
        for key, value in stage.module.state_dict().items():
            if isinstance(value, DTensor) and key in modules:
                modules[key] = _like(value, modules[key])
        for name, param in stage.module.named_parameters():
            if isinstance(param, DTensor) and name in optimizer_state:
                optimizer_state[name] = {
                    k: _like(param, v) if isinstance(v, torch.Tensor) and v.shape == param.shape
                    else v
                    for k, v in optimizer_state[name].items()
                }
        return modules, optimizer_state


def _whole(state: dict[Any, Any]) -> dict[Any, Any]:
    """``state`` with each DTensor gathered from its shards (a collective), the rest as it is."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _like(sharded: DTensor, whole: torch.Tensor) -> DTensor:
    """This rank's share of ``whole``, placed as ``sharded`` is."""
    return distribute_tensor(
        whole.to(sharded.device), sharded.device_mesh, sharded.placements, src_data_rank=None
    )
