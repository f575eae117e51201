"""The user's object: split an nn.Sequential into stages and train it with a schedule.

One process per stage under torchrun (``DistributedTransport``), or every stage as a thread of
this process on its own device (``devices=[...]``, ``LocalTransport``). Both run the same
schedule through the same executor.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from partitioner import Plan
from pipetrain import checkpointing, microbatch
from pipetrain.agreement import check_same, fingerprint
from pipetrain.batchnorm import DeferredBatchNorm
from pipetrain.compensation import AUTO, DelayCompensation
from pipetrain.config import PipelineConfig, check_balance
from pipetrain.cuda_graphs import pipeline_refusal, slots_needed, stage_refusal
from pipetrain.data_parallel import GradientSync, tied_parameters
from pipetrain.distributed import local_device, quiet_io_threads
from pipetrain.errors import PeerError, PipelineError
from pipetrain.executor import Carry, Executor
from pipetrain.layers import LayerSource
from pipetrain.lazy import InitFn
from pipetrain.placement import Placement, join
from pipetrain.planning import warn_other_microbatch
from pipetrain.precision import LossScaler
from pipetrain.progress import Progress, logger, memory_kind, memory_label, peak_memory
from pipetrain.readback import step_loss
from pipetrain.rng import draw_seeds
from pipetrain.stage import LossFn, OptimizerFactory, SchedulerFactory, Stage
from pipetrain.stage_module import PipelineLayers
from pipetrain.trace import Recorder, measure_clock_offset
from pipetrain.transport import DistributedTransport, LocalHub, Transport
from pipetrain.update import Update, learning_rate
from pipetrain.weights import stage_versions
from schedules import Kind, Schedule, build, drain, for_call, inflight, lookup, validate

Tie = tuple[nn.Parameter, tuple[int, ...]]  # a weight shared by stages, and those stages


def split(model: nn.Sequential, balance: Sequence[int]) -> list[tuple[int, nn.Sequential]]:
    """(offset, slice) per stage; slices keep the full model's state_dict keys."""
    balance = check_balance(model, balance)
    bounds = [sum(balance[:s]) for s in range(len(balance) + 1)]
    slices = [cast(nn.Sequential, model[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    return list(zip(bounds, slices, strict=False))


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forward half, for evaluation (no gradients, no optimizer step)."""
    keep = {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT}
    actions = {r: tuple(a for a in ops if a.kind in keep) for r, ops in schedule.actions.items()}
    return Schedule(
        schedule.name + "-forward", schedule.stages, schedule.microbatches, actions,
        schedule.placement, schedule.lag, schedule.update_every,
    )


def pipeline_ranks(
    schedule: str, stages: int, devices: Sequence[str | torch.device] | None,
    group: dist.ProcessGroup | None, replicas: int | None,
) -> int:
    """How many ranks run the pipeline: one per stage, except for schedules that put several
    stages on a rank, where the devices (or the processes of one replica) count them."""
    if not lookup(schedule).multi_stage_per_rank:
        if devices is not None and len(devices) != stages:
            raise ValueError(
                f"devices lists {len(devices)} devices for {stages} stages; give one "
                "device per entry of balance"
            )
        return stages
    if devices is not None:
        ranks = len(devices)
    elif dist.is_initialized():
        ranks = max(dist.get_world_size(group) // (replicas or 1), 1)
    else:
        return stages  # join() explains that there is no process group
    if stages % ranks or stages < ranks:
        chunks = max(stages // ranks, 2)
        raise ValueError(
            f"{schedule} with {ranks} ranks x {chunks} chunks needs balance with "
            f"{ranks * chunks} entries (a multiple of {ranks}, one per stage), got {stages}"
        )
    return ranks


class Pipeline:
    """Train ``model`` split by ``balance`` into stages, ``chunks`` micro-batches a step.

    Without ``devices`` this process is one rank of a torchrun job of ``stages x replicas``
    ranks: replica k's stage s is rank k * stages + s, and each stage's replicas average their
    gradients before every optimizer step. With ``devices`` every stage runs here as a thread,
    stage s on ``devices[s]``. Both run the same schedule and train like one process would.
    Weights shared by layers on different stages stay identical: their gradients are summed
    across those stages. Each stage draws its random numbers (dropout) from a stream of its
    own, seeded from torch's global generator when the pipeline is built (call
    ``torch.manual_seed`` first for a reproducible run, the same in either mode); a recomputed
    micro-batch replays its forward's draws, and checkpoints save the streams (pipetrain/rng.py).

    A model built on the meta device (``with torch.device("meta"):``, shapes only) is never
    built whole: each process materializes only its own stages' layers, on its device, and
    initializes them by the per-layer rule from ``init_seed`` (pipetrain/lazy.py), so any
    split gives the weights ``pipetrain.init_layers(model, init_seed, init)`` gives the model
    built eagerly; or each stage reads its own tensors from ``weights``.

    Args:
        model: the ``nn.Sequential`` to train; its layers are the units a split cuts between.
            Built on the meta device, it needs ``init_seed`` or ``weights``.
        balance: layers per stage, e.g. ``[4, 8]``; its entries sum to ``len(model)``. Leave it
            out when ``plan`` gives it.
        plan: a ``partitioner.Plan`` or its JSON file (from ``pipetrain plan``): the balance,
            and the schedule, micro-batch count and each stage's checkpoint mode unless those
            are passed too. A plan made for another model is refused; a first step whose
            micro-batches differ from the plan's profiled size warns once.
        chunks: micro-batches per mini-batch (default 1, or the plan's); the batch size must be
            a multiple of it.
        schedule: the schedule's name in schedules/registry.py (default "1f1b", or the
            plan's): "gpipe", "1f1b", "interleaved" (several stages per rank; pass as many
            devices or processes as ranks), "zb-h1", "zb-h2" (zero bubble, split backward),
            or the asynchronous "pipedream" and "pipedream-2bw", which never flush between
            steps (see ``weight_stashing``).
        checkpoint: activation recomputation, "never", "except_last" or "always" (torchgpipe's
            modes), one for every stage or a list of one per stage (as a plan made under a
            memory cap may choose). Default: the plan's, else the schedule's entry
            ("except_last" under "gpipe", else "never"; "never" with ``cuda_graphs``). The
            asynchronous schedules refuse recomputation.
        loss_fn: ``loss_fn(output, target)``, a scalar, on the last stage; the step's loss is
            its mean over the micro-batches. Without it (or ``optimizer``) the pipeline
            evaluates, and ``train_step`` refuses to run.
        optimizer: a factory, ``lambda params: torch.optim.AdamW(params, ...)``: each stage
            builds its own optimizer of its parameters. torch's fused optimizers
            (``fused=True``) skip a non-finite step on the device, without a host sync.
        devices: one device per rank to run every stage in this process; None (default) runs
            this process's rank of a torchrun job (``pipetrain.init_distributed()`` first).
        group: the process group of the job (default: the whole world).
        replicas: data-parallel copies of the pipeline (default: world size / ranks per
            pipeline).
        timeout: seconds a stage waits for a peer before it raises CommunicationTimeout
            (default 300).
        deferred_batch_norm: make BatchNorm's running statistics those of the whole mini-batch
            rather than of the last micro-batch (pipetrain/batchnorm.py).
        track_memory: count the bytes each stage saves for backward (``stage.ledger``), and
            hold each stage to the micro-batches its schedule keeps in flight.
        trace: a folder where each rank writes the actions it ran, with times (``pipetrain
            trace DIR`` merges them); the same on every rank. Default: the PIPETRAIN_TRACE
            environment variable, else off.
        progress: True prints each step's metrics on the first rank;
            ``pipetrain.Progress(every=N, total=T)`` every N steps, with a bar up to step T (a
            bare number is refused as ambiguous).
        checkpoint_dir: resume from the newest checkpoint in this folder, if any (``step``
            tells how many steps are done; the first rank says so).
        checkpoint_every: with ``checkpoint_dir``, save a checkpoint there every this many
            steps (0, the default: never).
        weight_stashing: asynchronous schedules: a micro-batch's forward and backward read one
            weight version (default True). False without prediction is PipeDream's naive,
            inconsistent variant.
        weight_prediction: asynchronous schedules: "momentum", "spectrain" or "msnag" run both
            passes on the weights predicted after the stage's lag (pipetrain/weights.py); None
            stashes only. Default "auto", the staleness study's pick (docs/staleness.md):
            prediction for SGD with momentum, Adam and AdamW.
        precision: "fp32" (default), "bf16" or "fp16": each stage runs under autocast and
            sends activations in that dtype; "fp16" adds a dynamic loss scale (``scaler``)
            whose overflow check every rank agrees on (pipetrain/precision.py).
        clip_grad_norm: clip by the norm of the whole model's gradients, as
            ``torch.nn.utils.clip_grad_norm_`` would in one process (pipetrain/update.py).
        lr_scheduler: a factory, ``lambda optimizer: ...``: one learning-rate schedule per
            stage optimizer, stepped after each of its steps (not after a skipped one).
        delay_compensation: asynchronous schedules: "spike", "lag-lr", "lag-momentum",
            "pipemare", several joined by "+", or a DelayCompensation: changes the updates of
            late gradients (pipetrain/compensation.py), with or without prediction. Default
            "auto": with prediction, "spike+lag-momentum" under "pipedream" and "spike" under
            "pipedream-2bw" for SGD with momentum, nothing otherwise. ``weight_prediction=None,
            delay_compensation=None`` is PipeDream's weight stashing.
        cuda_graphs: True captures each stage's training forward and backward as CUDA graphs
            after the first step with each micro-batch shape and replays them from then on
            (pipetrain/cuda_graphs.py); what cannot be captured is refused with the reason,
            and "auto" runs it eagerly instead. Default False.
        init_seed: the per-layer initialization rule's seed (pipetrain/lazy.py): layer i is
            seeded from it and i, then ``init(layer)`` or its modules' ``reset_parameters()``
            run. Needed for a meta-device model without ``weights``; on an eagerly built model
            it re-initializes every layer by the rule.
        init: ``init(layer)``, the rule's initialization of one layer, in place of its
            modules' ``reset_parameters()``.
        weights: a whole-model ``.safetensors`` or ``.pt`` file, keys as in
            ``model.state_dict()``: each stage reads only its own tensors
            (pipetrain/weightfile.py). Missing, unexpected or wrongly shaped keys are refused
            in one error.
        nonfinite: synchronous schedules: "skip" (default) skips a step whose loss or
            gradients are not finite on any stage, on every rank, leaving the weights, the
            optimizer state and the learning-rate schedule as they were, with a warning naming
            the step and the stages; "raise" raises NonFiniteError instead.

    After construction, ``config`` holds every option as resolved (pipetrain/config.py),
    ``checkpoint`` the recomputation mode in force (a tuple when stages differ), ``schedule``
    the schedule, ``stages`` this process's stages and ``step`` the steps done. ``metrics``
    holds each step's figures on every rank: "loss", "step_time", "samples_per_second",
    "stage_bubble", "stage_peak_memory" and "peak_memory" (per device of this process,
    "cuda:N" the GPU's peak allocation, "cpu(process)" the process's peak resident set,
    ``peak_memory_kind`` saying which; on the first rank of a multi-process run with
    ``progress``, one per rank "rankN"), "lr", "skipped_step", with clipping "grad_norm"
    (before clipping) and, for fp16, "loss_scale". The step keeps them as device tensors; the
    first read of ``metrics`` after a step waits for the device. No step waits for the device
    except where an optimizer that cannot skip on the device, an ``lr_scheduler``,
    ``nonfinite="raise"`` or ``progress`` asks for it. ``flush()`` drains an asynchronous
    pipeline; ``eval_step`` and ``save`` call it.
    """

    def __init__(
        self,
        model: nn.Sequential,
        balance: Sequence[int] | None = None,
        *,
        plan: str | os.PathLike[str] | Plan | None = None,
        chunks: int | None = None,
        schedule: str | None = None,
        checkpoint: str | Sequence[str] | None = None,
        loss_fn: LossFn | None = None,
        optimizer: OptimizerFactory | None = None,
        devices: Sequence[str | torch.device] | None = None,
        group: dist.ProcessGroup | None = None,
        replicas: int | None = None,
        timeout: float = 300.0,
        deferred_batch_norm: bool = False,
        track_memory: bool = False,
        trace: str | os.PathLike[str] | None = None,
        progress: bool | Progress = False,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int = 0,
        weight_stashing: bool = True,
        weight_prediction: str | None = AUTO,
        precision: str = "fp32",
        clip_grad_norm: float | None = None,
        lr_scheduler: SchedulerFactory | None = None,
        delay_compensation: str | DelayCompensation | None = AUTO,
        cuda_graphs: bool | str = False,
        init_seed: int | None = None,
        init: InitFn | None = None,
        weights: str | os.PathLike[str] | None = None,
        nonfinite: str = "skip",
    ):
        self.config = config = PipelineConfig.resolve(
            model, balance, plan=plan, chunks=chunks, schedule=schedule, checkpoint=checkpoint,
            loss_fn=loss_fn, optimizer=optimizer, timeout=timeout,
            deferred_batch_norm=deferred_batch_norm, track_memory=track_memory, trace=trace,
            progress=progress, checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
            weight_stashing=weight_stashing, weight_prediction=weight_prediction,
            precision=precision, clip_grad_norm=clip_grad_norm, lr_scheduler=lr_scheduler,
            delay_compensation=delay_compensation, cuda_graphs=cuda_graphs,
            nonfinite=nonfinite,
        )
        self._source = LayerSource(init_seed, init, weights)
        self._source.check(model)
        if config.deferred_batch_norm:
            model = cast(nn.Sequential, DeferredBatchNorm.convert(model, config.chunks))
        parts, ties = split(model, config.balance), tied_parameters(model, config.balance)
        self.balance, self.chunks = list(config.balance), config.chunks
        self.timeout, self.checkpoint, self.precision = (
            config.timeout, config.checkpoint, config.precision
        )
        ranks = pipeline_ranks(config.schedule, len(parts), devices, group, replicas)
        config.check_planned_ranks(ranks, placed=devices is not None or dist.is_initialized())
        self.schedule = build(config.schedule, len(parts), config.chunks, ranks=ranks)
        validate(self.schedule)
        self._evaluation = forward_only(self.schedule)
        seeds = draw_seeds(len(parts))  # every stage's, in every process: see pipetrain/rng.py
        if devices is not None:
            self._assemble_threads(model, parts, ties, devices, seeds)
        else:
            self._assemble_processes(model, parts, ties, group, replicas, seeds)
        self._layers = PipelineLayers(
            OrderedDict((k, m) for stage in self.stages for k, m in stage.module.named_children())
        )
        self._start_training(ties)
        logger.info(
            "pipeline of %d stages, balance %s, %s, %d micro-batches; here: stages %s",
            len(parts), self.balance, config.schedule, config.chunks,
            [s.index for s in self.stages],
        )

    # -- assembly: every stage as a thread here, or this process's stages of a torchrun job --

    def _assemble_threads(
        self, model: nn.Sequential, parts: list[tuple[int, nn.Sequential]], ties: list[Tie],
        devices: Sequence[str | torch.device], seeds: list[int],
    ) -> None:
        """Every stage here, stage s on its rank's device, the ranks linked by a LocalHub. A
        shared weight is one tensor here: the first stage using it steps it."""
        hub = LocalHub([torch.device(d) for d in devices])
        rank_of = self.schedule.rank_of
        for _, stages in ties:
            if len({hub.devices[rank_of(s)] for s in stages}) > 1:
                raise ValueError(
                    f"stages {list(stages)} share a weight but sit on different devices; "
                    "put them on one device or untie the weight"
                )
        self._refuse_unsupported(ties, replicas=1)
        made = self._source.bring_up(
            model, parts, {s: hub.devices[rank_of(s)] for s in range(len(parts))}
        )
        ties[:] = [(cast(nn.Parameter, made.get(id(p), p)), stages) for p, stages in ties]
        self.stages = [
            self._build_stage(
                parts, s, hub.devices[rank_of(s)], seeds[s],
                owned_elsewhere=frozenset(
                    id(p) for p, stages in ties if s in stages and s != stages[0]
                ),
            )
            for s in range(len(parts))
        ]
        self.transports: list[Transport] = [hub.endpoint(r) for r in range(self.schedule.ranks)]
        self._threads: ThreadPoolExecutor | None = ThreadPoolExecutor(self.schedule.ranks)
        self.stage: int | None = None
        self._world: dist.ProcessGroup | None = None

    def _assemble_processes(
        self, model: nn.Sequential, parts: list[tuple[int, nn.Sequential]], ties: list[Tie],
        group: dist.ProcessGroup | None, replicas: int | None, seeds: list[int],
    ) -> None:
        """This rank's stages of a torchrun job, after every rank agrees on the settings.
        Weights shared across ranks are summed over those ranks; on one rank, the stages using
        a weight share one tensor and the first of them steps it."""
        config, rank_of = self.config, self.schedule.rank_of
        self._threads = None
        self._world = group  # every rank of every replica: the step's agreement
        rank_sets = [tuple(sorted({rank_of(s) for s in stages})) for _, stages in ties]
        cross = [r for r in rank_sets if len(r) > 1]
        with quiet_io_threads():
            self.placement = join(group, self.schedule.ranks, replicas, cross, config.timeout)
        check_same(
            fingerprint(
                model, balance=self.balance, chunks=config.chunks, schedule=config.schedule,
                checkpoint=config.checkpoint, replicas=self.placement.replicas,
                weight_stashing=config.weight_stashing,
                weight_prediction=config.weight_prediction, **self._source.settings(),
            ),
            self.placement.pipeline_group, self.placement.pipeline_ranks,
        )
        self._refuse_unsupported(ties, self.placement.replicas)
        here = self.schedule.stages_on(self.placement.stage)
        self.stage = here[0]
        device = local_device()
        owner = {id(p): min(s for s in stages if s in here) for p, stages in ties
                 if any(s in here for s in stages)}
        # the gradient all-reduces bind their buffers on the device: the layers go there first
        made = self._source.bring_up(model, parts, dict.fromkeys(here, device))
        ties[:] = [(cast(nn.Parameter, made.get(id(p), p)), stages) for p, stages in ties]
        self.stages = [
            self._build_stage(
                parts, s, device, seeds[s],
                owned_elsewhere=frozenset(i for i, o in owner.items() if o != s),
                syncs=_gradient_syncs(
                    parts[s][1], s, self.placement, ties, config.timeout, rank_of, owner
                ),
            )
            for s in here
        ]
        self._ranks, self._group = self.placement.pipeline_ranks, self.placement.pipeline_group
        self.transports = [DistributedTransport(self._group, self._ranks, device)]

    def _refuse_unsupported(self, ties: list[Tie], replicas: int) -> None:
        """The asynchronous schedules run neither replicas nor weights tied across stages."""
        if self.schedule.asynchronous and (ties or replicas > 1):
            raise ValueError(
                f"schedule {self.config.schedule!r} does not support data-parallel replicas or "
                "weights tied across stages yet; use a synchronous schedule for those"
            )

    def _build_stage(
        self, parts: list[tuple[int, nn.Sequential]], index: int, device: torch.device,
        seed: int, owned_elsewhere: frozenset[int], syncs: Sequence[GradientSync] = (),
    ) -> Stage:
        """Stage ``index`` on ``device``, whole; asynchronous schedules give it its weight
        versions, and under "pipedream" every micro-batch is an update of its own."""
        config, schedule = self.config, self.schedule
        offset, module = parts[index]
        versions = None
        if schedule.asynchronous:
            versions = partial(
                stage_versions, lag=schedule.lag[index], update_every=schedule.update_every,
                weight_stashing=config.weight_stashing,
                weight_prediction=config.weight_prediction, compensation=config.compensation,
                schedule=config.schedule,
            )
        stage = Stage(
            module=module, index=index, count=len(parts), offset=offset, device=device,
            optimizer=config.optimizer, loss_fn=config.loss_fn,
            checkpoint=config.stage_checkpoint(index),
            track_memory=config.track_memory, owned_elsewhere=owned_elsewhere,
            split_backward=schedule.splits_backward, lr_scheduler=config.lr_scheduler,
            autocast_dtype=config.autocast_dtype, seed=seed, syncs=syncs,
            weight_versions=versions,
            loss_divisor=schedule.update_every or None,  # micro-batches per update
        )
        if stage.ledger is not None:
            stage.ledger.bound = inflight(schedule)[index]
        self._use_graphs(stage)
        return stage

    def _use_graphs(self, stage: Stage) -> None:
        """Give ``stage`` CUDA graphs when asked and possible (pipetrain/cuda_graphs.py):
        under ``cuda_graphs=True`` what cannot be captured is refused, under "auto" it runs
        eagerly."""
        config = self.config
        if not config.cuda_graphs:
            return
        reason = pipeline_refusal(
            self.schedule, config.checkpoint, config.track_memory, config.deferred_batch_norm
        ) or stage_refusal(stage.index, stage.device, stage.module)
        if reason is None:
            stage.use_graphs(slots_needed(self.schedule, stage.index), config.cuda_graphs is True)
        elif config.cuda_graphs is True:
            raise ValueError(
                f"{reason}. Pass cuda_graphs='auto' to run what cannot be captured eagerly, "
                "or cuda_graphs=False"
            )
        else:
            logger.info("stage %d runs eagerly (cuda_graphs='auto'): %s", stage.index, reason)

    def _start_training(self, ties: list[Tie]) -> None:
        """The state of training: the step across stages (fp16's loss scale, clipping), the
        asynchronous pipeline's counters, tracing, progress, and a resumed checkpoint."""
        config = self.config
        device = self.stages[0].device
        self.scaler = LossScaler(device=device) if config.precision == "fp16" else None
        self._update: Update | None = None
        if not self.schedule.asynchronous:  # every rank agrees on each step (update.py)
            self._update = Update(
                self.stages, config.clip_grad_norm, self.scaler,
                {id(p): stages[0] for p, stages in ties}, self._sum_over_ranks,
                1 if self._threads is not None else self.placement.replicas,
                count=self.schedule.stages, nonfinite=config.nonfinite,
            )
        self._calls = 0  # asynchronous: train_steps since the last flush
        self._fed = 0  # asynchronous: micro-batches fed so far (their global numbers)
        self._call_lists: dict[int, Schedule] = {}
        self._failed: str | None = None
        self._loss: tuple[torch.Tensor, dist.Work | None] | None = None  # on its way
        self._carry = [Carry() for _ in self.transports]
        self._recorders = (
            self._start_tracing() if config.trace else [None] * len(self.transports)
        )
        self._progress = config.progress
        # the last step's metrics, device tensors where the device made them
        self._metrics: dict[str, Any] = {}
        self._read: dict[str, Any] | None = None  # the same as numbers, once read
        self.step = 0  # training steps done (restored with a checkpoint)
        self._protected: frozenset[str] = frozenset()  # checkpoints saved after the resumed one
        self._saved: tuple[int, Path] | None = None  # the step and checkpoint last saved or loaded
        self._unchecked_microbatch = config.planned_microbatch  # to compare with the first step's
        if config.checkpoint_dir is not None and self.load(config.checkpoint_dir) is not None:
            if self._coordinator:  # said by default: a run that starts at step N is no surprise
                (self._progress or Progress()).note(
                    f"pipetrain: resumed from step {self.step} of {config.checkpoint_dir}"
                )

    def _start_tracing(self) -> list[Recorder | None]:
        if self._threads is not None:
            return [Recorder(r, r, self.schedule) for r in range(self.schedule.ranks)]
        offset, latency = measure_clock_offset(self._group, self._ranks)
        recorder = Recorder(dist.get_rank(), self.placement.stage, self.schedule, offset, latency)
        atexit.register(self.save_trace)
        return [recorder]

    def save_trace(self, folder: str | os.PathLike[str] | None = None) -> list[Path]:
        """Write this process's trace records (done at exit too when tracing)."""
        folder = folder or self.config.trace
        if folder is None:
            raise ValueError("tracing is off: pass Pipeline(..., trace=DIR) or a folder here")
        return [r.save(Path(folder)) for r in self._recorders if r is not None]

    # -- the user's view --------------------------------------------------------------------

    @property
    def module(self) -> nn.Sequential:
        """This process's layers (all of them in single-process mode), keyed as in the model:
        one object for the pipeline's life. It refuses hooks, which would never run there;
        hooks on ``pipe.stages[i].module`` run once per micro-batch on stage i."""
        return self._layers

    @property
    def num_stages(self) -> int:
        return self.schedule.stages

    def train_step(
        self, x: microbatch.Batch | None, y: microbatch.Batch | None
    ) -> torch.Tensor:
        """Run one mini-batch through every micro-batch's forward and backward, then one
        optimizer step per stage. Returns the mini-batch's mean loss on every rank, as a 0-d
        float64 tensor on this rank's device: the step never waits for the device to know it;
        reading it (``float(loss)``, ``loss.item()``, ``f"{loss:.3f}"``, a comparison) does.
        A step whose loss or gradients are not finite on any stage is skipped on every rank
        (see ``nonfinite``).

        Under an asynchronous schedule it feeds the mini-batch into the pipeline and runs the
        backwards (and updates) that are due, those of earlier mini-batches included, without
        waiting for this one's to finish. The loss returned is still THIS mini-batch's mean loss:
        the last stage has no lag, so every micro-batch fed here finishes its loss in this call
        (computed with the weights each stage had, or was predicted to have, at its forward).
        The last stage sends it on as soon as its last forward ends, so the other ranks wait for
        that forward, not for the backwards behind it.

        Args:
            x: the mini-batch's input, a Tensor or a tuple of Tensors split along dimension 0
                into ``chunks`` micro-batches. Only the first stage reads it: other ranks may
                pass None.
            y: the targets ``loss_fn`` compares the output with, split the same way; only the
                last stage reads it (None elsewhere).

        Returns:
            The mini-batch's mean loss, the same on every rank (averaged over replicas), as a
            0-d float64 tensor on this rank's device: reading it (``float(loss)``,
            ``f"{loss:.3f}"``) waits for the device, the step itself does not.
        """
        self.config.check_trainable()
        _check_batches(x, y)
        batch = x if x is not None else y
        if self._unchecked_microbatch is not None and batch is not None:
            warn_other_microbatch(self._unchecked_microbatch, batch, self.chunks)
            self._unchecked_microbatch = None  # once: the first step's
        lr = learning_rate(self.stages)  # the rate this step trains with
        if self._update is not None:  # synchronous: the step's agreement carries the loss
            for stage in self.stages:
                stage.zero_grad()
            start = time.perf_counter()  # zeroing the gradients is no part of the step
            self._update.begin()
            executors = self._run(self.schedule, x, y, True)
            value, stepped = self._update.run(self.step + 1)
            step_time = time.perf_counter() - start
        else:
            start, self._loss = time.perf_counter(), None
            for stage in self.stages:
                stage.losses.clear()
            executors = self._run(self._call_list(self._calls), x, y, True, self._report_loss)
            self._calls += 1
            self._fed += self.chunks
            if self._loss is None:  # ranks without the last stage, and single-process mode
                self._report_loss()
            step_time = time.perf_counter() - start
            value, stepped = self._received_loss(), {"grad_norm": None}
        self.step += 1
        self._record_metrics(value, step_time, executors, batch, {"lr": lr, **stepped})
        for stage in self.stages:  # no stage runs now: capture what the step met first
            if stage.graphs is not None:
                stage.graphs.capture_pending()
        every, folder = self.config.checkpoint_every, self.config.checkpoint_dir
        if folder is not None and every and self.step % every == 0:
            self.save(folder)
        return step_loss(value)

    def _call_list(self, call: int) -> Schedule:
        """The list of the call-th train_step since the last flush (cached: from the call at
        which every stage's warm-up is over, the lists are all the same)."""
        call = min(call, -(-self.schedule.stages // self.chunks))
        if call not in self._call_lists:
            self._call_lists[call] = for_call(self.schedule, call)
        return self._call_lists[call]

    @property
    def in_flight(self) -> bool:
        """Whether micro-batches are still in the pipeline (asynchronous schedules only)."""
        return self.schedule.asynchronous and self._calls > 0

    def flush(self) -> None:
        """Drain an asynchronous pipeline: run every in-flight micro-batch's backward and its
        update, so that the weights are settled. Every rank calls it; a no-op when nothing is in
        flight (always, for synchronous schedules). The next train_step warms up again. It
        takes no arguments: it drains what earlier ``train_step`` calls left in flight.
        """
        if not self.in_flight:
            return
        self._run(drain(self.schedule, self._calls), None, None, training=True)
        self._calls = 0

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write a checkpoint of every stage (module, optimizer, step, RNG) under ``folder``;
        every rank calls it (the first replica writes). A crash during the save leaves the
        previous one whole. An asynchronous pipeline is flushed first. Saving again at the
        step this pipeline last saved (or loaded) in ``folder``, with nothing trained since,
        returns that checkpoint: e.g. a final save right after a periodic one.

        Args:
            folder: where the checkpoints live; each save adds one named by the step (the same
                folder on every rank, shared when ranks run on several machines).

        Returns:
            The checkpoint written or found (``folder`` itself on replicas that do not write).
        """
        self.flush()
        if self._threads is None and self.placement.replica > 0:
            return Path(folder)  # replicas hold the same state as the first
        if self._saved is not None and self._already_saved(folder, *self._saved):
            return self._saved[1]
        path = checkpointing.save(
            folder, self.step, self.stages, self._barrier, self._coordinator, self.num_stages,
            self.scaler,
            self._protected,
        )
        self._saved = (self.step, path)
        return path

    def _already_saved(self, folder: str | os.PathLike[str], step: int, path: Path) -> bool:
        """Whether ``path``, this pipeline's checkpoint of ``step``, holds its state now: same
        step, same folder, still complete on disk (the same answer on every rank)."""
        return (
            step == self.step
            and path.parent.resolve() == Path(folder).resolve()
            and (path / "manifest.json").is_file()
        )

    def load(self, folder: str | os.PathLike[str]) -> int | None:
        """Restore the newest checkpoint in ``folder`` (made under any balance); every rank
        calls it. An asynchronous pipeline is flushed first.

        Args:
            folder: a folder ``save`` wrote checkpoints to.

        Returns:
            The step of the checkpoint restored (also ``self.step``), or None if there is none.
        """
        self.flush()  # an asynchronous pipeline settles before its weights are replaced
        resumed = checkpointing.load(folder, self.stages, self.scaler)
        if resumed is None:
            return None
        self.step, path = resumed
        self._protected = checkpointing.saved_after(path)
        self._saved = (self.step, path)
        logger.info("resumed from step %d of %s", self.step, folder)
        return self.step

    @property
    def _coordinator(self) -> bool:
        return self._threads is not None or self.placement.is_coordinator

    def _barrier(self) -> None:
        if self._threads is None:
            dist.barrier(group=self._group)

    @property
    def metrics(self) -> dict[str, Any]:
        """The last step's metrics as numbers (see the class docstring). The step keeps its
        device's figures (loss, gradient norm, skipped, loss scale) as tensors; the first read
        after a step waits for the device once, and reports any skipped step not yet warned of."""
        if self._update is not None:
            self._update.report(wait=True)
        if self._read is None:
            self._read = {k: _number(v) for k, v in self._metrics.items()}
        return self._read

    def _record_metrics(
        self, loss: torch.Tensor, step_time: float, executors: list[Executor], batch: object,
        extra: dict[str, Any],
    ) -> None:
        size = microbatch.batch_size(batch, "batch") if batch is not None else None  # type: ignore[arg-type]
        bubbles = [1.0 - e.compute_time / step_time for e in executors]
        memory = [float(peak_memory(s.device)) for s in self.stages]
        # One figure per device this process tells apart; a CPU's is the whole process's.
        peaks = {memory_label(s.device): m for s, m in zip(self.stages, memory, strict=True)}
        kind = memory_kind(self.stages[0].device)
        if self._progress is not None and self._threads is None:
            bubbles, memory = self._gather_from_stages(bubbles[0], memory[0])
            peaks = {f"rank{r}": m for r, m in zip(self._ranks, memory, strict=True)}
        self._read = None
        self._metrics = {
            "step": self.step,
            "loss": loss,
            "step_time": step_time,
            "samples_per_second": size / step_time if size else None,
            "stage_bubble": bubbles,
            "stage_peak_memory": memory,
            "peak_memory": peaks,
            "peak_memory_kind": kind,
            **extra,
        }
        if logger.isEnabledFor(logging.DEBUG):  # reading the metrics waits for the device
            logger.debug("step %d: %s", self.step, self.metrics)
        if self._progress is not None and self._coordinator:
            self._progress.update(self.metrics)

    def _sum_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` summed over every rank of every replica (in one process: itself)."""
        if self._threads is not None:
            return value
        work = dist.all_reduce(value, group=self._world, async_op=True)
        assert work is not None
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as error:
            assert isinstance(self.transports[0], DistributedTransport)
            self.transports[0].raise_failure(error)
        return value

    def _gather_from_stages(self, bubble: float, memory: float) -> tuple[list[float], list[float]]:
        mine = torch.tensor([bubble, memory], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in self._ranks]
        dist.all_gather(every, mine, group=self._group)
        return [float(t[0]) for t in every], [float(t[1]) for t in every]

    def eval_step(self, x: microbatch.Batch | None) -> microbatch.Batch | None:
        """Forward only, in eval mode and without gradients. An asynchronous pipeline is
        flushed first: evaluation sees settled weights.

        Args:
            x: the input, a Tensor or a tuple of Tensors split along dimension 0 into
                ``chunks`` micro-batches; only the first stage reads it (None elsewhere).

        Returns:
            The model's output for the whole batch on the rank of the last stage (in one
            process: here), None on other ranks.
        """
        _check_batches(x, None)
        self.flush()
        modes = [stage.module.training for stage in self.stages]
        for stage in self.stages:
            stage.module.eval()
        try:
            self._run(self._evaluation, x, None, training=False)
        finally:
            for stage, mode in zip(self.stages, modes, strict=True):
                stage.module.train(mode)
        return microbatch.gather(self._outputs) if self._outputs else None

    # -- running the schedule ---------------------------------------------------------------

    def _split(
        self, value: microbatch.Batch | None, what: str, device: torch.device
    ) -> list[Any] | None:
        if value is None:
            return None
        return microbatch.scatter(microbatch.to_device(value, device), self.chunks, what)

    def _run(
        self, schedule: Schedule, x: object, y: object, training: bool,
        losses_done: Callable[[], None] | None = None,
    ) -> list[Executor]:
        """Run ``schedule`` on this process's stages; outputs land in ``self._outputs``.
        ``losses_done`` goes to a process's executor (see Executor), not to threads'."""
        if self._failed:
            raise PipelineError(
                f"this pipeline stopped after a failure ({self._failed}); build a new one "
                "(and reload a checkpoint) to go on"
            )
        first, last = self.stages[0], self.stages[-1]
        inputs = self._split(x, "x", first.device) if first.is_first else None  # type: ignore[arg-type]
        targets = self._split(y, "y", last.device) if last.is_last else None  # type: ignore[arg-type]
        by_index = {stage.index: stage for stage in self.stages}
        here = range(schedule.ranks) if self._threads is not None else [self.placement.stage]
        executors = [
            Executor(
                [by_index[s] for s in schedule.stages_on(rank)], transport, schedule, rank,
                self.timeout, training, recorder if training else None,
                base=self._fed if training else 0, carry=carry,
                losses_done=losses_done if self._threads is None else None,
            )
            for rank, transport, recorder, carry in zip(
                here, self.transports, self._recorders, self._carry, strict=True
            )
        ]
        try:
            if self._threads is None:  # this thread: a caller's no_grad would drop the graph
                with torch.enable_grad() if training else nullcontext():
                    self._outputs = executors[0].run(inputs, targets)
                return executors
            futures = [self._threads.submit(e.run, inputs, targets) for e in executors]
            errors = [f.exception() for f in futures]
            root = next((e for e in errors if e and not isinstance(e, PeerError)), None)
            if root or any(errors):
                raise root or next(e for e in errors if e)
            self._outputs = futures[-1].result()
            return executors
        except Exception as error:
            self._failed = f"{type(error).__name__}: {error}"
            logger.error("pipeline failed: %s", self._failed)
            raise

    def _report_loss(self) -> None:
        """Asynchronous schedules (a synchronous step's agreement carries the loss instead):
        start handing the last stage's mean loss of the mini-batch to every rank (a
        broadcast that ``_received_loss`` waits for). The last stage's rank calls it the moment
        its last forward ends (the executor's ``losses_done``), the other ranks after their
        list: the first stage need not wait for the last stage's backwards before it feeds
        the next mini-batch."""
        last = self.stages[-1]
        if last.is_last:
            loss = torch.stack(list(last.losses.values())).mean(dtype=torch.float64)
        else:
            loss = torch.zeros((), dtype=torch.float64, device=last.device)
        work = None
        if self._threads is None:
            work = dist.broadcast(loss, self._ranks[-1], group=self._group, async_op=True)
        self._loss = (loss, work)

    def _received_loss(self) -> torch.Tensor:
        """The loss ``_report_loss`` sent, once it is here (averaged over replicas); on the
        device, unread."""
        assert self._loss is not None, "_report_loss comes first"
        (value, work), self._loss = self._loss, None
        if work is None:
            return value
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
            if self.placement.replica_group is not None:  # the mean over every replica's batch
                dist.all_reduce(value, group=self.placement.replica_group)
                value /= self.placement.replicas
        except RuntimeError as error:
            transport = self.transports[0]
            assert isinstance(transport, DistributedTransport)
            try:
                transport.raise_failure(error)
            except PeerError as failure:
                self._failed = f"{type(failure).__name__}: {failure}"
                transport.abort(f"stage {self.placement.stage} stopped: {failure}")
                late = f"the loss of step {self.step + 1} did not arrive: {failure}"
                raise type(failure)(late) from error
        return value


def _number(value: object) -> object:
    """A metric as a number: a 0-d tensor read (the host waits for the device), else as is."""
    if isinstance(value, torch.Tensor) and value.dim() == 0:
        return value.item()
    return value


def _check_batches(x: object, y: object) -> None:
    """The same check of the caller's batches for train_step and eval_step, before any work:
    each a Tensor or a tuple of Tensors (or None on ranks that do not read it), x and y of one
    batch size."""
    sizes = {
        what: microbatch.batch_size(value, what)  # type: ignore[arg-type]
        for what, value in (("x", x), ("y", y))
        if value is not None
    }
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"x has batch size {sizes['x']} but y has {sizes['y']}; pass matching batches"
        )


def _gradient_syncs(
    module: nn.Module, index: int, placement: Placement, ties: list[Tie],
    timeout: float, rank_of: Callable[[int], int], owner: dict[int, int],
) -> list[GradientSync]:
    """All-reduces before each optimizer step: one per set of ranks sharing weights (summed
    over those ranks, averaged over replicas; on each rank, the stage that steps a shared
    weight reduces it), one over replicas for the rest."""
    scale = 1.0 / placement.replicas
    mine = [
        p for p in module.parameters()
        if p.requires_grad and owner.get(id(p), index) == index
    ]
    ranks_of = {id(p): tuple(sorted({rank_of(s) for s in stages})) for p, stages in ties}
    syncs = []
    for rank_set, group in placement.tie_groups.items():
        ids = {id(p) for p in mine}
        shared = [p for p, _ in ties if id(p) in ids and ranks_of[id(p)] == rank_set]
        if shared:
            syncs.append(GradientSync(shared, group, scale, timeout))
    rest = [p for p in mine if len(ranks_of.get(id(p), ())) < 2]
    if placement.replica_group is not None and rest:
        syncs.append(GradientSync(rest, placement.replica_group, scale, timeout))
    return syncs
