"""One GPU's training step: pipetrain (eager and with CUDA graphs) against
torch.distributed.pipelining, and the peak memory of each schedule and checkpoint mode.

Setup (issue 33): the example GPT (examples/models.py) at width 1024, 12 blocks, 16 heads,
context 512, vocabulary 256; batch 32 in 8 micro-batches; fused AdamW; gradients clipped to a
global norm of 1.0. Both libraries hold the whole model as ONE stage on cuda:0 (world size 1),
so both run exactly the same micro-batches and the difference is each runtime's own cost.
torch's side is what its user writes: the stage under torch.autocast (the ``Autocast`` wrapper
of benchmarks/gpt_throughput.py), ScheduleGPipe or Schedule1F1B, then
``torch.nn.utils.clip_grad_norm_`` and the optimizer step. pipetrain's is
``Pipeline(devices=["cuda:0"], precision=..., clip_grad_norm=1.0)`` with recompute="never"
(as torch's, which does not recompute), plus the same with ``cuda_graphs=True``.

Timing: one fresh process per precision builds every variant, warms each up, then runs
``--rounds`` rounds of ``--steps`` steps per variant, the order rotating every round; a step's
time is the host's from its call until the GPU is done (synchronised after the step). The
table gives each variant's median and torch's median over pipetrain's (above 1: pipetrain is
faster), and the loss after the last step (the same steps on the same batch: the columns
should agree). Memory: each row a fresh process that trains ``--memory-steps`` steps in bf16
and reports the GPU's peak allocation (on the CPU: the process's peak resident set): plain
gradient accumulation over the micro-batches, and pipetrain's GPipe and 1F1B under each
checkpoint mode (and with CUDA graphs).

    python benchmarks/gpu_step.py                     # about 4-5 minutes on one H200
    python benchmarks/gpu_step.py --rounds 3 --out gpu_step.md
    python benchmarks/gpu_step.py --smoke             # seconds on the CPU (tiny model, no graphs)
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from gpt_throughput import Autocast, _imports
from ranks import spawn_ranks
from timing import rotation

SCHEDULES = ("gpipe", "1f1b")
PRECISIONS = ("bf16", "fp32")
CHECKPOINTS = ("never", "except_last", "always")
DTYPES = {"fp32": None, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Setup:
    """The model, batch and device of a run (``smoke``: a tiny model on the CPU)."""

    dim: int = 1024
    blocks: int = 12
    heads: int = 16
    context: int = 512
    batch: int = 32
    chunks: int = 8
    device: str = "cuda:0"
    clip: float = 1.0

    def model(self) -> torch.nn.Sequential:
        """The same weights for every variant: a copy of one model built per process."""
        if self not in _BUILT:
            models, _ = _imports()
            _BUILT[self] = models.gpt(vocab=256, dim=self.dim, blocks=self.blocks,
                                      heads=self.heads, context=self.context, seed=0)
        return copy.deepcopy(_BUILT[self])

    def data(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, (self.batch, self.context + 1), generator=g)
        # contiguous: torch.distributed.pipelining before 2.10 checks the strides of its inputs
        return (tokens[:, :-1].contiguous().to(self.device),
                tokens[:, 1:].contiguous().to(self.device))


_BUILT: dict[Setup, torch.nn.Sequential] = {}
SMOKE = Setup(dim=32, blocks=2, heads=2, context=16, batch=8, chunks=4, device="cpu")


def _adamw(params):
    fused = any(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=fused or None)


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    models, _ = _imports()
    return models.lm_loss(logits.float(), targets)


class _Pipetrain:
    def __init__(self, setup: Setup, schedule: str, precision: str, graphs: bool = False,
                 checkpoint: str = "never"):
        import pipetrain

        self.pipe = pipetrain.Pipeline(
            setup.model(), [setup.blocks + 2], chunks=setup.chunks, schedule=schedule,
            recompute=checkpoint, loss_fn=_loss, optimizer=_adamw, devices=[setup.device],
            precision=precision, clip_grad_norm=setup.clip, cuda_graphs=graphs,
        )

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        return float(self.pipe.train_step(x, y))


class _Torch:
    """torch.distributed.pipelining, one stage holding the whole model (world size 1)."""

    def __init__(self, setup: Setup, schedule: str, precision: str):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        device = torch.device(setup.device)
        self.module = Autocast(setup.model().to(device), DTYPES[precision], device.type)
        self.opt = _adamw(list(self.module.parameters()))
        stage = PipelineStage(self.module, 0, 1, device)
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        self.schedule = kind(stage, n_microbatches=setup.chunks, loss_fn=_loss)
        self.clip = setup.clip

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        self.schedule.step(x, target=y, losses=losses)
        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.opt.step()
        return float(torch.stack(losses).mean().detach())


class _Accumulation:
    """Plain gradient accumulation over the micro-batches, in one module: the memory floor."""

    def __init__(self, setup: Setup, precision: str):
        self.model = setup.model().to(setup.device)
        self.opt = _adamw(list(self.model.parameters()))
        self.setup, self.dtype = setup, DTYPES[precision]

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros((), device=self.setup.device)
        device = torch.device(self.setup.device).type
        for xs, ys in zip(x.chunk(self.setup.chunks), y.chunk(self.setup.chunks), strict=True):
            with torch.autocast(device, dtype=self.dtype, enabled=self.dtype is not None):
                loss = _loss(self.model(xs), ys) / self.setup.chunks
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.setup.clip)
        self.opt.step()
        return float(total)


def _finish(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _join_world(port: int, device: str) -> None:
    """A process group of one (torch.distributed.pipelining wants one)."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)


def _timing(rank: int, port: int, setup: dict, precisions: list[str], opts: dict,
            results) -> None:
    """A fresh process: every variant of each of ``precisions``, alternated over rounds."""
    import torch.distributed as dist

    run = Setup(**setup)
    try:
        _join_world(port, run.device)
    except Exception as error:  # torch's variants then fail on their own; pipetrain's run
        print(f"no process group of one: {error}", file=sys.stderr)
    results.put([_time_precision(run, precision, opts) for precision in precisions])
    if dist.is_initialized():
        dist.destroy_process_group()


def _time_precision(run: Setup, precision: str, opts: dict) -> dict:
    x, y = run.data()
    graphs = opts["graphs"] and run.device.startswith("cuda")
    builders = {}
    for schedule in SCHEDULES:
        builders[f"pipetrain {schedule}"] = lambda s=schedule: _Pipetrain(run, s, precision)
        if graphs:
            builders[f"graphs {schedule}"] = lambda s=schedule: _Pipetrain(run, s, precision, True)
        builders[f"torch {schedule}"] = lambda s=schedule: _Torch(run, s, precision)
    variants, last, failed = {}, {}, {}
    for name, build in builders.items():  # warm-up (graphs: the eager step, then the capture)
        try:
            variants[name] = build()
            _steps(variants[name], x, y, opts["warmup"], run.device, last, name)
        except Exception as error:  # the other variants' figures still count
            failed[name] = f"{type(error).__name__}: {error}"[:300]
            variants.pop(name, None)
            print(f"{precision} {name} failed: {failed[name]}", file=sys.stderr)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(opts["rounds"]):
        for name in rotation(list(variants), r):
            if name in failed:
                continue
            try:
                times[name] += _steps(variants[name], x, y, opts["steps"], run.device, last, name)
            except Exception as error:
                failed[name] = f"{type(error).__name__}: {error}"[:300]
                print(f"{precision} {name} failed: {failed[name]}", file=sys.stderr)
    medians = {name: statistics.median(t) for name, t in times.items()
               if t and name not in failed}
    return {"precision": precision, "median": medians, "loss": last, "failed": failed}


def _steps(variant, x, y, count: int, device: str, last: dict, name: str) -> list[float]:
    """``count`` steps of ``variant``, each timed until the GPU is done; the last loss kept."""
    times = []
    for _ in range(count):
        start = time.perf_counter()
        last[name] = variant.step(x, y)
        _finish(device)
        times.append(time.perf_counter() - start)
    return times


def _memory(rank: int, port: int, setup: dict, row: str, steps: int, results) -> None:
    """A fresh process: one row's peak memory over ``steps`` bf16 steps (pipetrain in one
    process needs no process group)."""
    from pipetrain.observe.progress import peak_memory

    run = Setup(**setup)
    if row == "accumulation":
        variant: _Accumulation | _Pipetrain = _Accumulation(run, "bf16")
    else:
        schedule, checkpoint, *graphs = row.split()
        variant = _Pipetrain(run, schedule, "bf16", bool(graphs), checkpoint)
    x, y = run.data()
    for _ in range(steps):
        variant.step(x, y)
    _finish(run.device)
    results.put({"row": row, "bytes": peak_memory(torch.device(run.device))})


def memory_rows(graphs: bool) -> list[str]:
    """Plain accumulation, then each schedule under each checkpoint mode (and with graphs)."""
    rows = ["accumulation"] + [f"{s} {c}" for s in SCHEDULES for c in CHECKPOINTS]
    return rows + ([f"{s} never graphs" for s in SCHEDULES] if graphs else [])


def time_table(results: list[dict], graphs: bool) -> list[str]:
    """The issue's table: per precision and schedule, each library's median step and ratio
    (a variant that failed shows as "failed"; its error went to stderr and below)."""
    head = "| precision, schedule | pipetrain | torch.distributed.pipelining | torch / pipetrain |"
    rule = "|---|---|---|---|"
    if graphs:
        head += " pipetrain cuda_graphs | torch / cuda_graphs |"
        rule += "---|---|"
    lines = [head + " loss after the last step (pipetrain, [graphs,] torch) |", rule + "---|"]
    for result in results:
        med, loss = result["median"], result["loss"]
        for schedule in SCHEDULES:
            names = [f"pipetrain {schedule}", f"torch {schedule}"]
            names += [f"graphs {schedule}"] if graphs else []
            ms = [f"{med[n] * 1e3:.1f} ms" if n in med else "failed" for n in names]
            ratios = [_ratio(med, f"torch {schedule}", n) for n in names[::2]]
            line = f"| {result['precision']}, {schedule} | {ms[0]} | {ms[1]} | {ratios[0]} |"
            if graphs:
                line += f" {ms[2]} | {ratios[1]} |"
            losses = [f"{loss[n]:.4f}" if n in loss else "-" for n in names[:1] + names[2:]
                      + names[1:2]]
            lines.append(line + " " + ", ".join(losses) + " |")
    errors = [f"- {r['precision']} {n}: {e}" for r in results for n, e in r["failed"].items()]
    return lines + (["", "failed:", *errors] if errors else [])


def _ratio(medians: dict[str, float], theirs: str, ours: str) -> str:
    if theirs not in medians or ours not in medians:
        return "-"
    return f"{medians[theirs] / medians[ours]:.2f}"


def memory_table(peaks: dict[str, int | None]) -> list[str]:
    """Each row's peak (None: its process failed) and its ratio to plain accumulation's."""
    base = peaks.get("accumulation")
    lines = ["| bf16 run | peak memory | vs accumulation |", "|---|---|---|"]
    for row, value in peaks.items():
        if value is None:
            lines.append(f"| {row} | failed | - |")
            continue
        ratio = f"{value / base:.2f}" if base else "-"
        lines.append(f"| {row} | {value / 2**30:.2f} GiB | {ratio} |")
    return lines


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternation rounds (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per variant and round")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps per variant first (graphs capture after the first)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS))
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--no-memory", action="store_true", help="leave the memory rows out")
    parser.add_argument("--no-graphs", action="store_true", help="leave cuda_graphs=True out")
    parser.add_argument("--timeout", type=float, default=600.0, help="per fresh process (s)")
    parser.add_argument("--out", help="also write the tables (markdown) to this file")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny model on the CPU, 1 round, no graphs: seconds")
    args = parser.parse_args(argv)
    if set(args.precisions.split(",")) - set(PRECISIONS):
        parser.error(f"--precisions from {PRECISIONS}")
    if args.smoke:
        args.rounds, args.steps, args.warmup, args.memory_steps = 1, 1, 1, 1
        args.no_graphs = True
    return args


def main(argv: list[str] | None = None) -> int:
    args = _arguments(argv)
    setup = SMOKE if args.smoke else Setup()
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_step.py needs a CUDA GPU (or --smoke for the CPU check)", file=sys.stderr)
        return 2
    graphs = not args.no_graphs
    opts = {"rounds": args.rounds, "steps": args.steps, "warmup": args.warmup, "graphs": graphs}
    started = time.monotonic()
    precisions = args.precisions.split(",")
    # a process per precision (the variants of both would crowd one GPU); one for the smoke
    groups = [precisions] if args.smoke else [[p] for p in precisions]
    timed = []
    for group in groups:  # a process that dies leaves the other precision's rows standing
        try:
            timed += spawn_ranks(_timing, 1, asdict(setup), group, opts, timeout=args.timeout)
        except Exception as error:
            print(f"timing of {group} failed: {error}", file=sys.stderr)
            timed += [{"precision": p, "median": {}, "loss": {}, "failed": {"all": str(error)}}
                      for p in group]
    report = _Report(setup, args, time_table(timed, graphs), started)
    report.write()  # the time table stands even if a memory row runs out of time
    rows = [] if args.no_memory else memory_rows(graphs)
    if args.smoke:
        rows = rows[:1] + ["1f1b never"]
    peaks: dict[str, int | None] = {}
    for row in rows:  # a row that fails (out of memory, say) leaves the others standing
        try:
            got = spawn_ranks(_memory, 1, asdict(setup), row, args.memory_steps,
                              timeout=args.timeout)
            peaks[row] = got["bytes"]
        except Exception as error:
            print(f"memory row {row!r} failed: {error}", file=sys.stderr)
            peaks[row] = None
        report.memory = memory_table(peaks)
        report.write(final=row == rows[-1])
    if not rows:
        report.write(final=True)
    return 0


@dataclass
class _Report:
    """The tables so far, printed at the end and written to ``--out`` as they grow."""

    setup: Setup
    args: argparse.Namespace
    times: list[str]
    started: float
    memory: list[str] = field(default_factory=list)

    def text(self) -> str:
        setup, args = self.setup, self.args
        name = torch.cuda.get_device_name(0) if setup.device.startswith("cuda") else "CPU"
        return "\n".join([
            f"{name}; GPT width {setup.dim}, {setup.blocks} blocks, context {setup.context}, "
            f"batch {setup.batch} in {setup.chunks} micro-batches, one stage on {setup.device}, "
            f"AdamW (fused on CUDA), clip {setup.clip}; median of {args.rounds} rounds x "
            f"{args.steps} steps per variant, alternated; torch {torch.__version__}",
            "", *self.times, "", *self.memory,
            "", f"wall time {time.monotonic() - self.started:.0f} s",
        ])

    def write(self, final: bool = False) -> None:
        if self.args.out:
            Path(self.args.out).write_text(self.text() + "\n")
        if final:
            print(self.text())

if __name__ == "__main__":
    sys.exit(main())
