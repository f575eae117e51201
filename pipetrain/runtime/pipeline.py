"""The user's object: split an nn.Sequential into stages and train it with a schedule.

One process per rank under torchrun, or every rank as a thread of this process on its own
device (``devices=[...]``): the World (pipetrain/runtime/world.py) holds what differs between the
two, pipetrain/runtime/assembly.py builds the stages, and this class is the training logic both
share: the options (config.py), the schedule, the stages and the steps.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import Unpack  # typing has it from Python 3.11; torch requires this

from pipetrain.checkpoints import checkpointing
from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.observe.progress import Progress, logger
from pipetrain.observe.trace import Recorder
from pipetrain.runtime import batch_agreement, microbatch
from pipetrain.runtime.assembly import Tie, assemble, forward_only
from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.decoding import incremental
from pipetrain.runtime.generation import Generation
from pipetrain.runtime.inflight import InFlight
from pipetrain.runtime.layers import LayerSource
from pipetrain.runtime.loss_items import LossItems, takes_items
from pipetrain.runtime.metrics import StepMetrics
from pipetrain.runtime.options import RENAMED, PipelineOptions, checked, renamed, with_options
from pipetrain.runtime.placement import Placement
from pipetrain.runtime.planning import warn_other_microbatch
from pipetrain.runtime.prompts import Sampling
from pipetrain.runtime.rng import draw_seeds
from pipetrain.runtime.runner import Runner
from pipetrain.runtime.sharding import Checkpointing
from pipetrain.runtime.stage_module import PipelineLayers
from pipetrain.runtime.transport import Transport
from pipetrain.runtime.update import Update, learning_rate
from pipetrain.runtime.world import make_world
from pipetrain.training.precision import LossScaler
from schedules import build, validate


class Pipeline:
    """Train ``model`` split by ``balance`` into stages, ``chunks`` micro-batches a step.

    Without ``devices`` this process is one rank of a torchrun job of ``stages x replicas``
    ranks: replica k's stage s is rank k * stages + s, and each stage's replicas average their
    gradients before every optimizer step (under an asynchronous schedule, once per weight
    version, just before the stage's update). With ``devices`` every stage runs here as a thread,
    stage s on ``devices[s]``. Both run the same schedule and train like one process would.
    Weights shared by layers on different stages stay identical: their gradients are summed
    across those stages. Each stage draws its random numbers (dropout) from a stream of its
    own, seeded from torch's global generator when the pipeline is built (call
    ``torch.manual_seed`` first for a reproducible run, the same in either mode); a recomputed
    micro-batch replays its forward's draws, and checkpoints save the streams
    (pipetrain/runtime/rng.py).

    A model built on the meta device (``with torch.device("meta"):``, shapes only) is never
    built whole: each process materializes only its own stages' layers, on its device, and
    initializes them by the per-layer rule from ``init_seed`` (pipetrain/training/lazy.py), so any
    split gives the weights ``pipetrain.init_layers(model, init_seed, init)`` gives the model
    built eagerly; or each stage reads its own tensors from ``weights``.

    The keyword options, each declared once in pipetrain/runtime/options.py, come in groups:
    split, training, the step, asynchronous schedules, placement, layer values, saving,
    execution, observation.

    Args:
        model: the ``nn.Sequential`` to train, or a ``pipetrain.LayerTree`` (layers named by
            their paths in one module tree: ``pipetrain.hf.sequential(model)``); its layers are
            the units a split cuts between. Built on the meta device, it needs ``init_seed``
            or ``weights``.
        balance: layers per stage, e.g. ``[4, 8]``; its entries sum to ``len(model)``. Leave it
            out when ``plan`` gives it.
        plan: a ``partitioner.Plan`` or its JSON file (from ``pipetrain plan``): the balance,
            and the schedule, micro-batch count and each stage's recomputation mode unless those
            are passed too; its ``zero`` level, ``reduce_scatter`` mode and copies of the
            pipeline (``data_parallel``: ``replicas``), which its memory and step time are
            predicted for, so a different one passed too is refused. A plan made for another
            model is refused; a first step whose micro-batches differ from the plan's profiled
            size warns once.
        chunks: micro-batches per mini-batch (default 1, or the plan's); the batch size must be
            a multiple of it.
        schedule: the schedule's name in schedules/registry.py, or its lists (a
            ``schedules.Schedule``). A name (default the registry's ``DEFAULT_SCHEDULE``, or
            the plan's): "gpipe", "1f1b", "interleaved" or "looped-bfs" (several stages per
            rank; pass as many devices or processes as ranks), "zb-h1", "zb-h2" (zero bubble,
            split backward), "zbv" (zero bubble in a V, two stages per rank), "v-half" and
            "v-min" (the V holding about 1/2 and 1/3 of zbv's activations), "dualpipev" (the
            same V, forwards and backwards in overlapped pairs; at least as many micro-batches
            as stages), or the asynchronous "pipedream" and "pipedream-2bw", which never flush
            between steps (see ``weight_stashing``). Lists (``schedules.from_csv(text)``, or a
            generator's) must have one stage per entry of ``balance``, place them on as many
            ranks as there are devices or processes, and run ``chunks`` micro-batches (default:
            theirs); lists that the registry builds under their name run as that name.
        recompute: activation recomputation, "never", "except_last" or "always" (torchgpipe's
            modes), one for every stage or a list of one per stage (as a plan made under a
            memory cap may choose). Default: the plan's, else the schedule's entry
            ("except_last" under "gpipe", else "never"; "never" with ``cuda_graphs``). Under
            the asynchronous schedules the recomputed forward reads the weight version its
            forward read (the stashed or predicted copy); without stashing, recomputation is
            refused on every stage but the last. Its old name ``checkpoint`` still works for
            one release, with a FutureWarning.
        loss_fn: ``loss_fn(output, target)``, a scalar, on the last stage; the step's loss is
            its mean over the micro-batches. Without it (or ``optimizer``) the pipeline
            evaluates, and ``train_step`` refuses to run.
        optimizer: a factory, ``lambda params: torch.optim.AdamW(params, ...)``: each stage
            builds its own optimizer of its parameters. torch's fused optimizers
            (``fused=True``) skip a non-finite step on the device, without a host sync.
        lr_scheduler: a factory, ``lambda optimizer: ...``: one learning-rate schedule per
            stage optimizer, stepped after each of its steps (not after a skipped one).
        precision: "fp32" (default), "bf16" or "fp16": each stage runs under autocast and
            sends activations in that dtype; "fp16" adds a dynamic loss scale (``scaler``)
            whose overflow check every rank agrees on (pipetrain/training/precision.py).
        clip_grad_norm: clip by the norm of the whole model's gradients (asynchronous: each
            stage's), as ``torch.nn.utils.clip_grad_norm_`` would in one process
            (pipetrain/runtime/update.py). Under the asynchronous schedules, per stage: each
            update's gradients (averaged over the replicas) are clipped by that stage's own
            norm, so the whole model's norm is at most ``clip_grad_norm * sqrt(stages)``; the
            stages of one version update at different moments, and a norm over all of them
            would stall the pipeline (pipetrain/runtime/inflight.py).
        nonfinite: synchronous schedules: "skip" (default) skips a step whose loss or
            gradients are not finite on any stage, on every rank, leaving the weights, the
            optimizer state and the learning-rate schedule as they were, with a warning naming
            the step and the stages; "raise" raises NonFiniteError instead.
        weight_stashing: asynchronous schedules: a micro-batch's forward and backward read one
            weight version (default True). False without prediction is PipeDream's naive,
            inconsistent variant.
        weight_prediction: asynchronous schedules: "momentum", "spectrain" or "msnag" run both
            passes on the weights predicted after the stage's lag (pipetrain/training/weights.py);
            None stashes only. Default "auto", the staleness study's pick (docs/staleness.md):
            prediction for SGD with momentum, Adam and AdamW.
        delay_compensation: async: "spike", "lag-lr", "lag-momentum", "pipemare",
            "error-feedback", several joined by "+", or a DelayCompensation:
            changes the updates of late gradients (pipetrain/training/compensation.py), with
            or without prediction. "error-feedback" (any optimizer) is the one-step-delay
            correction for "pipedream-2bw", e.g. with ``pipetrain.optim.muon_adamw``. Default
            "auto": with prediction, "spike+lag-momentum" under "pipedream" and "spike" under
            "pipedream-2bw" for SGD with momentum; "error-feedback" under "pipedream-2bw" for
            ``muon_adamw`` with stashed weights; nothing otherwise. ``weight_prediction=None,
            delay_compensation=None`` is PipeDream's weight stashing.
        devices: one device per rank to run every stage in this process; None (default) runs
            this process's rank of a torchrun job (``pipetrain.init_distributed()`` first).
        group: the process group of the job (default: the whole world).
        replicas: data-parallel copies of the pipeline (default: the plan's
            ``data_parallel``, else world size / ranks per pipeline); the world must be ranks
            per pipeline x replicas processes.
        timeout: seconds a stage waits for a peer before it raises CommunicationTimeout
            (default 300).
        zero: what each stage's data-parallel replicas shard among them (ZeRO,
            pipetrain/runtime/sharding.py): 0 nothing (default, or the plan's), 1 the optimizer
            state, 2 also the gradients, 3 also the weights (torch's FSDP2 for 2 and 3). Without
            replicas there is nothing to shard and it changes nothing. Checkpoints hold whole
            tensors; ``pipe.module.state_dict()`` holds each stage's shards (DTensors) at 2
            and 3.
        reduce_scatter: when zero 2 and 3 reduce-scatter each stage's gradients: "step"
            (default, or the plan's) once per mini-batch, after the stage's last backward (or
            W): one collective, but a step holds the stage's whole gradients until then;
            "microbatch" after every backward (or W), as FSDP2 does by default: a rank holds
            only its shard of the gradients accumulated, at a reduce-scatter per micro-batch.
            The parameters are the same (the sums in another order). Refused at zero 0 and 1.
        init_seed: the per-layer initialization rule's seed (pipetrain/training/lazy.py): layer i is
            seeded from it and i, then ``init(layer)`` or its modules' ``reset_parameters()``
            run. Needed for a meta-device model without ``weights``; on an eagerly built model
            it re-initializes every layer by the rule.
        init: ``init(layer)``, the rule's initialization of one layer, in place of its
            modules' ``reset_parameters()``.
        weights: a whole-model ``.safetensors`` or ``.pt`` file, keys as in
            ``model.state_dict()``, or a Hugging Face checkpoint directory (safetensors shards
            and their index; a tied weight saved once is read for each of its keys): each stage
            reads only its own tensors (pipetrain/checkpoints/weightfile.py). Missing, unexpected
            or wrongly shaped keys are refused in one error.
        checkpoint_dir: resume from the newest checkpoint in this folder, if any (``step``
            tells how many steps are done; the first rank says so).
        checkpoint_every: with ``checkpoint_dir``, save a checkpoint there every this many
            steps (0, the default: never).
        deferred_batch_norm: make BatchNorm's running statistics those of the whole mini-batch
            rather than of the last micro-batch, also for a BatchNorm run several times per
            forward; one used by stages of different ranks is refused
            (pipetrain/training/batchnorm.py).
        cuda_graphs: True captures each stage's training forward and backward as CUDA graphs
            after the first step with each micro-batch shape and replays them from then on
            (pipetrain/runtime/cuda_graphs.py); what cannot be captured is refused with the reason,
            and "auto" runs it eagerly instead. Default False.
        compile: True runs each layer of every stage through ``torch.compile``; or a list of one
            bool per stage. Each layer (a transformer block) is compiled on its own, as
            torchtitan compiles each block, and identical blocks share one compiled graph
            (pipetrain/runtime/compiled.py). Inductor needs a C++ compiler on a CPU and triton
            on a GPU; without one, construction is refused. Under the zero-bubble schedules a
            compiled stage runs its whole backward in B (a compiled layer's backward makes its
            input and weight gradients together) and its W finds nothing left to do. Default
            False.
        check_batches: on the first step, and the first after a resume, the ranks compare
            the batches they were given (batch sizes, and a fingerprint of each ``x`` and
            ``y`` given to more than one rank; pipetrain/runtime/batch_agreement.py) and refuse
            different ones on every rank (default True). Later steps are not checked.
        track_memory: count the bytes each stage saves for backward (``stage.ledger``), and
            hold each stage to the micro-batches its schedule keeps in flight.
        trace: a folder where each rank writes the actions it ran, with times (``pipetrain
            trace DIR`` merges them); the same on every rank. Default: the PIPETRAIN_TRACE
            environment variable, else off.
        progress: True prints each step's metrics on the first rank;
            ``pipetrain.Progress(every=N, total=T)`` every N steps, with a bar up to step T (a
            bare number is refused as ambiguous).

    After construction, ``config`` holds every option as resolved (pipetrain/runtime/config.py),
    ``recompute`` the recomputation mode in force (a tuple when stages differ), ``schedule``
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

    @with_options  # its signature lists every option (options.py), as help() shows
    def __init__(
        self,
        model: nn.Sequential | LayerTree,
        balance: Sequence[int] | None = None,
        **options: Unpack[PipelineOptions],
    ):
        model = layer_tree(model)
        options = renamed(options)  # type: ignore[assignment]  # old names, with a warning
        self.config = config = PipelineConfig.resolve(model, balance, **options)
        source = LayerSource(**checked("layers", options))
        source.check(model)
        self.balance, self.chunks = list(config.balance), config.chunks
        self.timeout, self.recompute, self.precision = (
            config.timeout, config.recompute, config.precision
        )
        placing = checked("world", options)
        placing["replicas"] = config.planned_replicas or placing["replicas"]  # the plan's copies
        self.world = make_world(**placing, timeout=config.timeout)
        ranks = self.world.pipeline_ranks(config.spec, len(self.balance))
        config.check_ranks(ranks, placed=self.world.placed)
        self.schedule = config.lists or build(
            config.schedule, len(self.balance), config.chunks, ranks=ranks
        )
        validate(self.schedule)
        self._evaluation = forward_only(self.schedule)
        seeds = draw_seeds(len(self.balance))  # every stage's, in every process: see rng.py
        self.stages, ties = assemble(model, config, self.schedule, self.world, source, seeds)
        group = self.world.replica_group()  # ZeRO's checkpoints gather and re-shard over it
        collectives = self.world.replica_collectives()
        self._sharded = (  # its gathers named and bounded as the replicas' other collectives
            Checkpointing(group, collectives, config.zero)
            if config.zero and group is not None and collectives is not None else None
        )
        self.stage = self.world.first_stage(self.schedule)  # None: every stage is here
        self._layers = PipelineLayers(
            kv for stage in self.stages for kv in stage.module.positions()
        )
        self._start_training(ties)
        self._generation = Generation(  # the whole model's layers say how it decodes
            self.world, self.stages, self.schedule, self._runner,
            incremental(model.called()),
        )
        logger.info(
            "pipeline of %d stages, balance %s, %s, %d micro-batches; here: stages %s",
            len(self.balance), self.balance, config.schedule, config.chunks,
            [s.index for s in self.stages],
        )

    def _start_training(self, ties: list[Tie]) -> None:
        """The state of training: the step across stages (fp16's loss scale, clipping), the
        asynchronous pipeline's counters, tracing, progress, and a resumed checkpoint."""
        config, world = self.config, self.world
        device = self.stages[0].device
        self.scaler = LossScaler(device=device) if config.loss_scaling else None
        self._update: Update | None = None
        if not self.schedule.asynchronous:  # every rank agrees on each step (update.py)
            self._update = Update(
                self.stages, config.clip_grad_norm, self.scaler,
                {id(p): stages[0] for p, stages in ties}, world.sum_over_ranks,
                world.placement.replicas, nonfinite=config.nonfinite,
            )
        self._inflight = InFlight(
            self.schedule, self.chunks, world, self.stages, config.clip_grad_norm
        )
        recorders: list[Recorder | None] = (
            world.recorders(self.schedule, self.save_trace) if config.trace
            else [None] * len(self.transports)
        )
        self._runner = Runner(world, self.stages, self.chunks, self.timeout, recorders)
        last = [stage for stage in self.stages if stage.is_last]
        self._items = (  # the mini-batch's count for a loss that takes num_items_in_batch
            LossItems(last[0], config.loss_divisor, world.replica_group(),
                      world.replica_collectives())
            if last and takes_items(config.loss_fn) and not config.update_per_microbatch
            else None
        )
        self._metrics = StepMetrics(world, config.progress, self._update)
        self.step = 0  # training steps done (restored with a checkpoint)
        self._checkpoints = checkpointing.Checkpoints()
        self._unchecked_microbatch = config.planned_microbatch  # to compare with the first step's
        self._unchecked_batch = config.check_batches  # the ranks compare the next step's batch
        if config.checkpoint_dir is not None and self.load(config.checkpoint_dir) is not None:
            if world.placement.is_coordinator:  # said by default: a resume is no surprise
                (config.progress or Progress()).note(
                    f"pipetrain: resumed from step {self.step} of {config.checkpoint_dir}"
                )

    def save_trace(self, folder: str | os.PathLike[str] | None = None) -> list[Path]:
        """Write this process's trace records (done at exit too when tracing)."""
        folder = folder or self.config.trace
        if folder is None:
            raise ValueError("tracing is off: pass Pipeline(..., trace=DIR) or a folder here")
        return self._runner.save_trace(Path(folder))

    # -- the user's view --------------------------------------------------------------------

    @property
    def module(self) -> PipelineLayers:
        """This process's layers (all of them in single-process mode), keyed as in the model:
        one object for the pipeline's life. It refuses hooks, which would never run there;
        hooks on ``pipe.stages[i].module`` run once per micro-batch on stage i."""
        return self._layers

    @property
    def checkpoint(self) -> str | tuple[str, ...]:
        """The old name of ``recompute`` (FutureWarning; it goes in the next release)."""
        warnings.warn(f"Pipeline.checkpoint is now Pipeline.{RENAMED['checkpoint']}; the old "
                      "name goes in the next release", FutureWarning, stacklevel=2)
        return self.recompute

    @property
    def num_stages(self) -> int:
        return self.schedule.stages

    @property
    def placement(self) -> Placement:
        """Which pipeline ranks this process runs, of which replica (runtime/placement.py)."""
        return self.world.placement

    @property
    def transports(self) -> list[Transport]:
        """The links of each pipeline rank this process runs (pipetrain/runtime/transport.py)."""
        return self.world.transports

    def train_step(
        self, x: microbatch.Batch | None, y: microbatch.Batch | None
    ) -> torch.Tensor:
        """Run one mini-batch through every micro-batch's forward and backward, then one
        optimizer step per stage. Returns the mini-batch's mean loss on every rank, as a 0-d
        float64 tensor (a plain ``torch.Tensor``) on this rank's device: the step never waits for
        the device to know it; reading it (``float(loss)``, ``loss.item()``, ``f"{loss:.3f}"``,
        a comparison) does. ``round(loss, 3)`` is not defined for a tensor: round
        ``float(loss)``, or use ``loss.round(decimals=3)`` for a tensor.
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
            plain 0-d float64 tensor on this rank's device: reading it (``float(loss)``,
            ``f"{loss:.3f}"``) waits for the device, the step itself does not.
        """
        self.config.check_trainable()
        if self._unchecked_batch:  # every rank gathers before any can refuse its own batch
            summaries = self.world.gather_objects(
                batch_agreement.summarize(x, y), "the first step's check of the batch"
            )
            batch_agreement.check(summaries, self.world.placement.ranks[0])
            self._unchecked_batch = False
        microbatch.check_batches(x, y)
        batch = x if x is not None else y
        if self._unchecked_microbatch is not None and batch is not None:
            warn_other_microbatch(self._unchecked_microbatch, batch, self.chunks)
            self._unchecked_microbatch = None  # once: the first step's
        lr = learning_rate(self.stages)  # the rate this step trains with
        if self._items is not None:
            self._items.count(y)
        if self._update is not None:  # synchronous: the list ends with the step's actions
            self._update.begin(self.step + 1)
            start = time.perf_counter()  # zeroing the gradients is no part of the step
            executors = self._runner.run(
                self._update.call_list(self.schedule), x, y, self._update
            )
            value, stepped = self._update.result()  # the loss came with the agreement
            step_time = time.perf_counter() - start
        else:
            value, stepped, step_time, executors = self._inflight.train(
                self._runner, x, y, self.step + 1
            )
        self.step += 1
        self._metrics.record(
            self.step, value, step_time, executors, self.stages, batch, {"lr": lr, **stepped}
        )
        for stage in self.stages:  # no stage runs now: capture what the step met first
            if stage.graphs is not None:
                stage.graphs.capture_pending()
        every, folder = self.config.checkpoint_every, self.config.checkpoint_dir
        if folder is not None and every and self.step % every == 0:
            self.save(folder)
        return value.detach()

    @property
    def in_flight(self) -> bool:
        """Whether micro-batches are still in the pipeline (asynchronous schedules only)."""
        return self._inflight.active

    def flush(self) -> None:
        """Drain an asynchronous pipeline: run every in-flight micro-batch's backward and its
        update, so that the weights are settled. Every rank calls it; a no-op when nothing is in
        flight (always, for synchronous schedules). The next train_step warms up again. It
        takes no arguments: it drains what earlier ``train_step`` calls left in flight.
        """
        if not self.in_flight:
            return
        self._runner.run(self._inflight.drain(), None, None, self._inflight, self._inflight.fed)
        self._inflight.flushed()

    def save(self, folder: str | os.PathLike[str]) -> Path:
        """Write a checkpoint of every stage (module, optimizer, step, RNG) under ``folder``;
        every rank calls it (the first replica writes). A crash during the save leaves the
        previous one whole; a replica lost while a sharded stage's state is gathered from the
        replicas (zero 1 to 3) is named, as in a step's collectives. An asynchronous pipeline
        is flushed first. Saving again at the step this pipeline last saved (or loaded) in
        ``folder``, with nothing trained since, returns that checkpoint: e.g. a final save
        right after a periodic one.

        Args:
            folder: where the checkpoints live; each save adds one named by the step (the same
                folder on every rank, shared when ranks run on several machines).

        Returns:
            The checkpoint written or found (``folder`` itself on replicas that do not write).
        """
        self.flush()
        whole = self._sharded.whole(self.stages) if self._sharded is not None else None
        if self.world.placement.replica > 0:
            return Path(folder)  # replicas hold the same state as the first
        return self._checkpoints.save(
            folder, self.step, self.stages, self.world.barrier,
            self.world.placement.is_coordinator, self.num_stages, self.scaler, whole,
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
        shard = self._sharded.shard if self._sharded is not None else None
        resumed = self._checkpoints.load(folder, self.stages, self.scaler, shard)
        if resumed is not None:
            self.step = resumed
            self._unchecked_batch = self.config.check_batches  # a resumed run's data, checked
            logger.info("resumed from step %d of %s", self.step, folder)
        return resumed

    @property
    def metrics(self) -> dict[str, Any]:
        """The last step's metrics as numbers (see the class docstring). The step keeps its
        device's figures (loss, gradient norm, skipped, loss scale) as tensors; the first read
        after a step waits for the device once, and reports any skipped step not yet warned of."""
        return self._metrics.read()

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
        microbatch.check_batches(x, None)
        self.flush()
        modes = [stage.module.training for stage in self.stages]
        for stage in self.stages:
            stage.module.eval()
        try:
            self._runner.run(self._evaluation, x, None, None)
        finally:
            for stage, mode in zip(self.stages, modes, strict=True):
                stage.module.train(mode)
        outputs = self._runner.outputs
        return microbatch.gather(outputs) if outputs else None

    def generate(
        self, input_ids: torch.Tensor | None, *, max_new_tokens: int | None = None,
        attention_mask: torch.Tensor | None = None, do_sample: bool | None = None,
        temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
        seed: int | None = None, eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None, generation_config: object | None = None,
    ) -> torch.Tensor:
        """Continue each prompt by up to ``max_new_tokens`` tokens, in eval mode and without
        gradients (training mode is restored after; an asynchronous pipeline is flushed
        first). The batch is cut into ``chunks`` micro-batches that follow each other through
        the stages, so the stages overlap. A model whose layers decode incrementally
        (pipetrain.hf's: a key/value cache per stage and micro-batch) runs only the new token
        at each step; any other is run over the whole sequence each step
        (pipetrain/runtime/decoding.py, pipetrain/runtime/generation.py). Greedy decoding
        gives transformers' ``generate(do_sample=False)`` on the same weights.

        Args:
            input_ids: the prompts (batch, seq), integer token ids; only the first stage
                reads them (None elsewhere). The batch size must be a multiple of ``chunks``.
            max_new_tokens: how many tokens to add at most (0: the prompts as they are).
            attention_mask: 1 for a token, 0 for padding (pad on the left, as for
                transformers' generate); positions count the tokens only.
            do_sample: draw each token from softmax(logits / ``temperature``) instead of
                taking the argmax (default False); each row draws from a generator of its own
                seeded from ``seed`` (default 0) and its row, so a run is reproducible under
                any split and chunks.
            top_k, top_p: sampling draws among the ``top_k`` likeliest tokens (default: all),
                then among the fewest whose probability reaches ``top_p`` (default 1.0: all),
                as transformers applies them after the temperature (default 1.0).
            eos_token_id: one id or several; a row that produces one is finished: it then
                produces ``pad_token_id`` (default: the first ``eos_token_id``), and
                generation stops once every row is, as transformers' generate does.
            generation_config: a transformers ``GenerationConfig`` (``model.generation_config``;
                any object with its attribute names): each argument left None takes its
                value from it (its ``do_sample``, ``temperature``, ``top_k``, ``top_p``,
                ``eos_token_id``, ``pad_token_id``, ``max_new_tokens``), else the default
                above. Without one no default is read from a model.

        Returns:
            The sequences, prompt and new tokens, (batch, seq + new), on every rank, on the
            device of its first stage (in one process: stage 0's).
        """
        sampling = Sampling.of(
            generation_config, max_new_tokens=max_new_tokens, do_sample=do_sample,
            temperature=temperature, seed=seed, eos_token_id=eos_token_id,
            pad_token_id=pad_token_id, top_k=top_k, top_p=top_p,
        )
        self.flush()
        return self._generation.run(input_ids, attention_mask, sampling)
