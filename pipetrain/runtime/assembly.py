"""Building this process's stages: the model split by balance, the weights stages share found,
the world placed, the layers brought up on their ranks' devices, and each stage given what it
uses (config.py's numbers, its weight versions, its gradient all-reduces, CUDA graphs where
asked and possible)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from typing import cast

import torch
from torch import nn

from pipetrain.layer_tree import LayerTree
from pipetrain.observe.progress import logger
from pipetrain.runtime.agreement import fingerprint
from pipetrain.runtime.compiled import inductor_refusal
from pipetrain.runtime.config import PipelineConfig, check_balance
from pipetrain.runtime.cuda_graphs import pipeline_refusal, slots_needed, stage_refusal
from pipetrain.runtime.data_parallel import Sync, tied_parameters
from pipetrain.runtime.layers import LayerSource
from pipetrain.runtime.sharding import (
    Reduction,
    ShardedGradients,
    refusal,
    zero_redundancy,
)
from pipetrain.runtime.split_backward import Leaves
from pipetrain.runtime.stage import Stage, StageOptions
from pipetrain.runtime.stage_module import StageModule
from pipetrain.runtime.world import World
from pipetrain.training.batchnorm import DeferredBatchNorm, assign_stages
from pipetrain.training.lazy import is_meta
from pipetrain.training.weights import stage_versions
from schedules import Kind, Schedule, inflight

Tie = tuple[nn.Parameter, tuple[int, ...]]  # a weight shared by stages, and those stages
Parts = list[tuple[int, LayerTree]]  # per stage: the offset of its first layer, its slice


def split(model: LayerTree, balance: Sequence[int]) -> Parts:
    """(offset, slice) per stage; slices keep the full model's state_dict keys."""
    balance = check_balance(model, balance)
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    slices = [model[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return list(zip(bounds, slices, strict=False))


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forward half, for evaluation (no gradients, no optimizer step)."""
    keep = {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT}
    actions = {r: tuple(a for a in ops if a.kind in keep) for r, ops in schedule.actions.items()}
    return Schedule(
        schedule.name + "-forward", schedule.stages, schedule.microbatches, actions,
        schedule.placement, schedule.lag, schedule.update_every,
    )


def _asynchronous_refusal(model: LayerTree, schedule: str, ties: list[Tie]) -> str:
    """Why an asynchronous schedule refuses this pipeline's weights tied across stages (named,
    with their stages): each stage would update its copy at its own time."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    listed = "; ".join(
        f"{' = '.join(names[id(p)])} on stages {list(stages)}" for p, stages in ties[:3]
    )
    return (
        f"schedule {schedule!r} does not support tied weights yet, and this "
        f"pipeline has {len(ties)} weight(s) tied across stages ({listed}): use a synchronous "
        "schedule (e.g. '1f1b'), or untie them or keep each tie's layers on one stage"
    )


def _joint(ties: list[Tie], schedule: Schedule) -> set[tuple[int, ...]]:
    """The sets of ranks sharing weights that some rank of theirs holds on several of its
    stages (each rank's copy belongs to its first stage using it)."""
    holders: dict[tuple[int, ...], dict[int, set[int]]] = {}
    for _, stages in ties:
        ranks = tuple(sorted({schedule.rank_of(s) for s in stages}))
        for rank in ranks:
            first = min(s for s in stages if schedule.rank_of(s) == rank)
            holders.setdefault(ranks, {}).setdefault(rank, set()).add(first)
    return {ranks for ranks, by_rank in holders.items()
            if any(len(firsts) > 1 for firsts in by_rank.values())}


def assemble(
    model: LayerTree, config: PipelineConfig, schedule: Schedule, world: World,
    source: LayerSource, seeds: Sequence[int],
) -> tuple[list[Stage], list[Tie]]:
    """This process's stages of ``schedule``, in stage order, once ``world`` has placed the
    ranks and every rank agrees on the settings; and the weights shared by stages (the
    tensors the stages hold). On one rank the stages using a shared weight share one tensor,
    which the first of them steps; across ranks its gradient is summed."""
    if config.deferred_batch_norm:
        model = cast(LayerTree, DeferredBatchNorm.convert(model, config.chunks))
    parts, ties = split(model, config.balance), tied_parameters(model, config.balance)
    world.place(schedule, [stages for _, stages in ties])
    world.agree(lambda: fingerprint(
        model, balance=list(config.balance), chunks=config.chunks, schedule=config.schedule,
        lists=config.lists_digest,
        recompute=config.recompute, replicas=world.placement.replicas, zero=config.zero,
        reduce_scatter=config.reduce_scatter,
        weight_stashing=config.weight_stashing, weight_prediction=config.weight_prediction,
        check_batches=config.check_batches, compile=config.compile, **source.settings(),
    ))
    if schedule.asynchronous and ties:
        raise ValueError(_asynchronous_refusal(model, config.schedule, ties))
    here = sorted(s for r in world.placement.ranks for s in schedule.stages_on(r))
    if config.deferred_batch_norm:
        assign_stages(dict(enumerate(layers for _, layers in parts)), here)
    group = world.replica_group()  # None: one replica, nothing to shard over
    zero = config.zero if group is not None else 0
    reason = refusal(zero, schedule, bool(config.cuda_graphs))
    if reason is not None:
        raise ValueError(reason)
    devices = {s: world.device(schedule.rank_of(s)) for s in here}
    # a meta model that FSDP2 shards comes up a layer at a time, each sharded before the next
    # (with weights tied across stages, a stage at a time: their all-reduce binds them first)
    by_layer = zero >= 2 and is_meta(model) and not ties
    # the gradient all-reduces bind their buffers on the device: the layers go there first
    made = {} if by_layer else source.bring_up(model, parts, devices)
    ties = [(cast(nn.Parameter, made.get(id(p), p)), stages) for p, stages in ties]
    owner = {id(p): min(s for s in stages if s in here) for p, stages in ties
             if any(s in here for s in stages)}
    rank_ties = [(p, tuple(sorted({schedule.rank_of(s) for s in stages}))) for p, stages in ties]
    owned = {s: [p for p in parts[s][1].parameters()
                 if p.requires_grad and owner.get(id(p), s) == s] for s in here}
    tied = {id(p) for p, _ in ties}
    # at zero 2 and 3 only the tied weights are all-reduced here (whole: sharding.py)
    reduced = owned if zero < 2 else {
        s: [p for p in params if id(p) in tied] for s, params in owned.items()
    }
    shared = world.gradient_syncs(reduced, rank_ties, _joint(ties, schedule),
                                  per_version=schedule.asynchronous)
    if zero == 1 and group is not None and config.optimizer is not None:
        named = world.replica_collectives()
        assert named is not None, "a replica group comes with its waits"
        config = replace(config, optimizer=zero_redundancy(config.optimizer, group, named))
    built = []
    for s in here:
        syncs: list[Sync]
        sharding = None
        if zero >= 2 and group is not None:
            collectives = world.replica_collectives()
            assert collectives is not None, "a replica group comes with its waits"
            offset, layers = parts[s][0], StageModule.of(parts[s][1])
            parts[s] = (offset, layers)
            bring_up = partial(_bring_up_layer, source, model, offset, devices[s])
            whole = [p for p in layers.parameters() if id(p) in tied]
            sharding = ShardedGradients(layers, group, zero, devices[s],
                                        bring_up if by_layer else None, whole,
                                        collectives=collectives, reduction=Reduction(
                                            schedule.splits_backward,
                                            config.reduce_scatter == "microbatch"))
            syncs = [*shared[s], sharding]
        else:
            syncs = shared[s]
        built.append(_build_stage(
            config, schedule, parts, s, world.device(schedule.rank_of(s)), seeds[s],
            owned_elsewhere=frozenset(i for i, o in owner.items() if o != s), syncs=syncs,
            weight_leaves=sharding.leaves if sharding is not None else None,
            after_weights=sharding.weights_made if sharding is not None else None,
        ))
    return built, ties


def _bring_up_layer(
    source: LayerSource, model: LayerTree, offset: int, device: torch.device, index: int
) -> None:
    """Layer ``offset + index`` of a meta ``model`` on ``device`` with its values, if it has
    tensors yet to make."""
    at = offset + index
    if is_meta(model[at]):
        source.bring_up(model, [(at, model[at : at + 1])], {0: device})


def _build_stage(
    config: PipelineConfig, schedule: Schedule, parts: Parts, index: int,
    device: torch.device, seed: int, owned_elsewhere: frozenset[int],
    syncs: Sequence[Sync], weight_leaves: Leaves | None,
    after_weights: Callable[[], None] | None = None,
) -> Stage:
    """Stage ``index`` on ``device``, whole; asynchronous schedules give it its weight
    versions, ZeRO 2 and 3 the gathered weights its W reaches (``weight_leaves``) and what
    follows each W (``after_weights``)."""
    offset, module = parts[index]
    versions = None
    if schedule.asynchronous:
        versions = partial(
            stage_versions, lag=schedule.lag[index], update_every=schedule.update_every,
            weight_stashing=config.weight_stashing,
            weight_prediction=config.weight_prediction, compensation=config.delay_compensation,
            schedule=config.schedule,
        )
    options = StageOptions(
        recompute_below=config.recompute_below(index), recompute_period=config.chunks,
        split_backward=schedule.splits_backward,
        loss_divisor=config.loss_divisor, autocast_dtype=config.autocast_dtype, seed=seed,
        lr_scheduler=config.lr_scheduler, syncs=syncs, owned_elsewhere=owned_elsewhere,
        weight_versions=versions, track_memory=config.track_memory,
        weight_leaves=weight_leaves, after_weights=after_weights,
        compile=config.stage_compile(index),
    )
    reason = inductor_refusal(device) if options.compile else None
    if reason is not None:
        raise ValueError(f"stage {index}: {reason}")
    stage = Stage(
        module, index, len(parts), offset, device, config.optimizer, config.loss_fn,
        options=options,
    )
    if stage.ledger is not None:
        stage.ledger.bound = inflight(schedule)[index]
    _use_graphs(config, schedule, stage)
    return stage


def _use_graphs(config: PipelineConfig, schedule: Schedule, stage: Stage) -> None:
    """Give ``stage`` CUDA graphs when asked and possible (pipetrain/runtime/cuda_graphs.py): under
    ``cuda_graphs=True`` what cannot be captured is refused, under "auto" it runs eagerly."""
    if not config.cuda_graphs:
        return
    reason = pipeline_refusal(
        schedule, config.recompute, config.track_memory, config.deferred_batch_norm
    ) or stage_refusal(stage.index, stage.device, stage.module)
    if reason is None:
        stage.use_graphs(slots_needed(schedule, stage.index), config.cuda_graphs is True)
    elif config.cuda_graphs is True:
        raise ValueError(
            f"{reason}. Pass cuda_graphs='auto' to run what cannot be captured eagerly, "
            "or cuda_graphs=False"
        )
    else:
        logger.info("stage %d runs eagerly (cuda_graphs='auto'): %s", stage.index, reason)
