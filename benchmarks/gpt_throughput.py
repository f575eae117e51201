"""GPT throughput: tokens/s of examples/train_gpt.py's model and training step on 2 CPU ranks,
pipetrain's 1F1B and interleaved 1F1B against torch.distributed.pipelining's Schedule1F1B and
ScheduleInterleaved1F1B, in fp32 and bf16 autocast, side by side in one run.

Model and step as the example's default: examples.models.gpt (dim 128, 4 blocks, context 128,
842k parameters, head tied to the embedding), batch 16 x 128 bytes of the bundled text in 4
micro-batches, AdamW, gradients clipped to a global norm of 1.0, no activation checkpointing,
one torch thread per rank, each rank pinned to its core. The same fixed split for both:
2 stages of [3, 3] layers (1F1B), 4 stages of [2, 1, 1, 2] (interleaved, stage c*2+r on rank r).

torch's side does what a user of torch.distributed.pipelining must do by hand to train the same
model: run each stage's forward under torch.autocast (bf16), all-reduce the tied embedding/head
weight's gradient between the first and the last stage's ranks, and clip by the global norm
(each rank's squared norm all-reduced, the tied weight counted once); pipetrain does all of this
inside Pipeline(precision=, clip_grad_norm=). The learning-rate schedule is left out on both
sides (it costs nothing measurable).

Variants alternate: every round runs each variant for a few steps, the order rotating from round
to round; a step's time is the slowest rank's; the table gives the median over all timed steps,
and "vs torch" torch's same schedule and precision's median step over pipetrain's (above 1:
pipetrain is faster). bf16 on a CPU without native bf16 (AVX512-BF16 or AMX) is emulated and
several times slower than fp32; the table still compares the two libraries at each precision.

    python benchmarks/gpt_throughput.py                    # about 3-6 minutes on 2 cores
    python benchmarks/gpt_throughput.py --rounds 5 --precisions fp32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import spawn_ranks
from timing import round_robin
from torch import nn

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
BATCH, CHUNKS, CONTEXT, RANKS = 16, 4, 128, 2
BALANCE = {"1f1b": [3, 3], "interleaved": [2, 1, 1, 2]}
SCHEDULES = tuple(BALANCE)
PRECISIONS = ("fp32", "bf16")
CLIP = 1.0


def _imports():
    """The example's model, loss and data (examples/ as a script sees it)."""
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import models
    import text

    return models, text


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)


class _Pipetrain:
    def __init__(self, schedule: str, precision: str, x, y):
        import pipetrain

        models, _ = _imports()
        self.pipe = pipetrain.Pipeline(
            models.gpt(), BALANCE[schedule], chunks=CHUNKS, schedule=schedule,
            recompute="never", loss_fn=models.lm_loss, optimizer=_adamw, timeout=300,
            precision=precision, clip_grad_norm=CLIP,
        )
        self.x, self.y = x, y

    def step(self) -> None:
        self.pipe.train_step(self.x, self.y)


class Autocast(nn.Module):
    """A stage's layers run under torch.autocast on ``device_type``, as a
    torch.distributed.pipelining user would wrap them (benchmarks/gpu_step.py uses it too)."""

    def __init__(self, inner: nn.Module, dtype: torch.dtype | None, device_type: str = "cpu"):
        super().__init__()
        self.inner, self.dtype, self.device_type = inner, dtype, device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=self.dtype, enabled=self.dtype is not None):
            return self.inner(x)


class _Torch:
    def __init__(self, schedule: str, precision: str, rank: int, x, y):
        from torch.distributed.pipelining import (
            PipelineStage,
            Schedule1F1B,
            ScheduleInterleaved1F1B,
        )

        models, _ = _imports()
        dtype = {"fp32": None, "bf16": torch.bfloat16}[precision]
        balance = BALANCE[schedule]
        stages = len(balance)
        mine = list(range(rank, stages, RANKS))
        model = models.gpt()
        bounds = [sum(balance[:s]) for s in range(stages + 1)]
        self.stages = [
            PipelineStage(Autocast(model[bounds[s]:bounds[s + 1]], dtype), s, stages,
                          torch.device("cpu"))
            for s in mine
        ]
        self.first, self.last = 0 in mine, stages - 1 in mine
        self.params = [p for stage in self.stages for p in stage.submod.parameters()]
        self.opt = _adamw(self.params)
        # The tied weight: the embedding's on the first stage, the head's on the last.
        self.tied = [
            stage.submod.inner[0].tokens.weight if stage.stage_index == 0
            else stage.submod.inner[-1].project.weight
            for stage in self.stages if stage.stage_index in (0, stages - 1)
        ]
        self.counted = [p for p in self.params if not (self.last and p is self.tied[-1])]

        def loss(logits, targets):
            return models.lm_loss(logits.float(), targets)

        cls = Schedule1F1B if schedule == "1f1b" else ScheduleInterleaved1F1B
        stage_arg = self.stages[0] if schedule == "1f1b" else self.stages
        self.schedule = cls(stage_arg, n_microbatches=CHUNKS, loss_fn=loss)
        self.x, self.y = x, y

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        args = (self.x,) if self.first else ()
        kwargs = {"target": self.y, "losses": []} if self.last else {}
        self.schedule.step(*args, **kwargs)
        for p in self.tied:  # every rank holds the first or the last stage: all of them
            dist.all_reduce(p.grad)
        square = torch.stack([p.grad.double().pow(2).sum() for p in self.counted]).sum()
        dist.all_reduce(square)
        scale = CLIP / (square.sqrt() + 1e-6)
        if scale < 1:
            for p in self.params:
                p.grad.mul_(scale.to(p.grad.dtype))
        self.opt.step()


def _rank(rank: int, port: int, rounds: int, steps: int, names: list[str], out: dict) -> None:

    from pipetrain.runtime.distributed import pin_to_cores

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_cores(rank, RANKS)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=600))
    _, text = _imports()
    train, _ = text.load_corpus()
    x, y = next(text.training_batches(train, BATCH, CONTEXT, seed=0))
    variants: dict[str, _Pipetrain | _Torch] = {}
    for name in names:
        library, schedule, precision = name.split("-")
        variants[name] = (
            _Pipetrain(schedule, precision, x, y) if library == "pipetrain"
            else _Torch(schedule, precision, rank, x, y)
        )
    for variant in variants.values():  # warm-up (torch's first step infers shapes)
        for _ in range(2):
            variant.step()
    times = round_robin({name: v.step for name, v in variants.items()}, rounds, steps)
    out.update({name: statistics.median(values) for name, values in times.items()})
    dist.barrier()
    dist.destroy_process_group()


def _worker(rank, port, rounds, steps, names, results):
    out: dict = {}
    _rank(rank, port, rounds, steps, names, out)
    if rank == 0:
        results.put(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant per round")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    args = parser.parse_args()
    precisions, schedules = args.precisions.split(","), args.schedules.split(",")
    if set(precisions) - set(PRECISIONS) or set(schedules) - set(SCHEDULES):
        parser.error(f"precisions from {PRECISIONS}, schedules from {SCHEDULES}")
    names = [f"{library}-{schedule}-{precision}" for precision in precisions
             for schedule in schedules for library in ("pipetrain", "torch")]
    print(f"GPT 842k parameters, batch {BATCH} x {CONTEXT} tokens in {CHUNKS} micro-batches, "
          f"{RANKS} ranks pinned, {os.cpu_count()} cores; median of {args.rounds * args.steps} "
          "steps per variant")
    medians = spawn_ranks(_worker, RANKS, args.rounds, args.steps, names)
    print(f"{'schedule':<13}{'precision':<10}{'pipetrain tokens/s':>19}{'torch tokens/s':>16}"
          f"{'vs torch':>10}")
    for precision in precisions:
        for schedule in schedules:
            ours = medians[f"pipetrain-{schedule}-{precision}"]
            theirs = medians[f"torch-{schedule}-{precision}"]
            tokens = BATCH * CONTEXT
            print(f"{schedule:<13}{precision:<10}{tokens / ours:>19,.0f}{tokens / theirs:>16,.0f}"
                  f"{theirs / ours:>9.2f}x")


if __name__ == "__main__":
    main()
