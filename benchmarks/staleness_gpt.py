"""The language-model task of the staleness study (benchmarks/staleness_study.py, issue 21), and
where its staleness hurts.

The byte-level GPT of examples/train_gpt.py, smaller so that a grid of learning rates, seeds
and methods fits a 2-core machine: width 64, 4 blocks of 4 heads, context 64, its head untied
(the asynchronous schedules do not take weights tied across stages), over 4 stages
[embedding + block, block, block, block + head]. AdamW (betas 0.9 / 0.95, weight decay 0.1,
as train_gpt.py) with train_gpt.py's schedule (linear warm-up over a tenth of the updates,
cosine decay to a tenth of the peak lr), one update per micro-batch of 8 windows drawn
from the training text (seed 1000 + s); the held-out loss is the mean over the first
``EVAL_BATCHES`` batches of 64 consecutive held-out windows (the end of Acts).

Run as a script it prints the diagnosis of docs/staleness.md: PipeDream's gap to synchronous
training next to runs that change one thing (which stages are late and by how much, the split,
the per-stage learning rates without staleness, 2BW's update per mini-batch), with the loss
spikes of each run (a micro-batch loss more than ``SPIKE`` times the lowest of the
``SPIKE_WINDOW`` before it):

    python benchmarks/staleness_gpt.py --lrs 0.003 0.01 --seeds 3
    python benchmarks/staleness_gpt.py --lrs 0.001 0.003 0.01 --updates 2400 --match "per 4"
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import torch
from delayed import DelayedPipeline

from pipetrain.optim import CONSTANT, nadamw

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
BALANCE = [2, 1, 1, 2]
CONTEXT, MICRO, EVAL_BATCHES = 64, 8, 8
UNIGRAM = 3.0  # nats: the held-out loss of byte frequencies alone; below it a model has learnt
SPIKE, SPIKE_WINDOW = 1.25, 5
PREDICT = dict(weight_prediction="momentum", delay_compensation=None)
STASH = dict(weight_prediction=None, delay_compensation=None)
SYNC = dict(schedule="1f1b")


def adamw(lr: float):
    """The task's optimizer: AdamW as examples/train_gpt.py (betas 0.9 / 0.95, decay 0.1)."""
    return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def nesterov(lr: float):
    """The Nesterov method's NAdamW (pipetrain.optim.nadamw, momentum 0.99) with the task's
    beta2 and weight decay, its momentum held constant (no warm-up)."""
    return nadamw(lr, beta2=0.95, weight_decay=0.1, momentum_decay=CONSTANT)


def nesterov_warmup(lr: float):
    """As :func:`nesterov` with torch's momentum warm-up (momentum_decay 0.004, nadamw's
    default), the setting of the authors' code."""
    return nadamw(lr, beta2=0.95, weight_decay=0.1)


OPTIMIZERS = {"adamw": adamw, "nadamw": nesterov, "nadamw-warmup": nesterov_warmup}
# name: (DelayedPipeline options, other run_gpt arguments, the row it is compared with)
DIAGNOSIS: dict[str, tuple[dict, dict, str]] = {
    "synchronous": (SYNC, {}, ""),
    "PipeDream, prediction (AdamW's default)": (PREDICT, {}, "synchronous"),
    "PipeDream, stashing": (STASH, {}, "synchronous"),
    "every stage 3 late (one consistent delay)": (PREDICT, dict(lags=[3, 3, 3, 3]),
                                                  "synchronous"),
    "first stage (embedding + block) 3 late": (PREDICT, dict(lags=[3, 0, 0, 0]), "synchronous"),
    "first stage 1 late": (PREDICT, dict(lags=[1, 0, 0, 0]), "synchronous"),
    "stages 1-3 1 late": (PREDICT, dict(lags=[1, 1, 1, 0]), "synchronous"),
    "embedding alone 3 late": (PREDICT, dict(lags=[3, 0, 0, 0, 0], balance=[1, 1, 1, 1, 2]),
                               "synchronous"),
    "PipeDream, lag-lr + prediction": (dict(weight_prediction="momentum",
                                            delay_compensation="lag-lr"), {}, "synchronous"),
    "late stages' gradients at the live weights (an oracle)": (PREDICT, dict(oracle=True),
                                                               "synchronous"),
    "synchronous at lag-lr's stage rates": (SYNC, dict(stage_scale=[1 / 4, 1 / 3, 1 / 2, 1]),
                                            "synchronous"),
    "synchronous, update per 4 micro-batches": (SYNC, dict(unit=4), ""),
    "2BW (lag 1), update per 4 micro-batches": (
        dict(schedule="pipedream-2bw", **PREDICT), dict(unit=4),
        "synchronous, update per 4 micro-batches"),
    "synchronous, NAdamW 0.99": (SYNC, dict(optimizer="nadamw"), "synchronous"),
    "PipeDream, Nesterov (NAdamW 0.99, stashing)": (
        STASH, dict(optimizer="nadamw"), "synchronous, NAdamW 0.99"),
    "first stage 3 late, Nesterov (NAdamW 0.99)": (
        STASH, dict(optimizer="nadamw", lags=[3, 0, 0, 0]), "synchronous, NAdamW 0.99"),
    "first stage 1 late, Nesterov (NAdamW 0.99)": (
        STASH, dict(optimizer="nadamw", lags=[1, 0, 0, 0]), "synchronous, NAdamW 0.99"),
    "every stage 3 late, Nesterov (NAdamW 0.99)": (
        STASH, dict(optimizer="nadamw", lags=[3, 3, 3, 3]), "synchronous, NAdamW 0.99"),
    "synchronous, NAdamW 0.99 with torch's momentum warm-up": (
        SYNC, dict(optimizer="nadamw-warmup"), "synchronous"),
    "PipeDream, Nesterov with torch's momentum warm-up": (
        STASH, dict(optimizer="nadamw-warmup"),
        "synchronous, NAdamW 0.99 with torch's momentum warm-up"),
    "width 128: synchronous": (SYNC, dict(dim=128), ""),
    "width 128: synchronous, NAdamW 0.99": (SYNC, dict(dim=128, optimizer="nadamw"),
                                            "width 128: synchronous"),
    "width 128: PipeDream, Nesterov (NAdamW 0.99)": (
        STASH, dict(dim=128, optimizer="nadamw"), "width 128: synchronous, NAdamW 0.99"),
}


class FreshGradients(DelayedPipeline):
    """DelayedPipeline with an oracle, for the study: no pipeline has these gradients when it
    updates. After each unit's backward, every late stage's gradient is replaced by the whole
    model's gradient at the live weights on that unit (what synchronous training would apply),
    so the one thing left late is what the last stage learns from: activations that the late
    stages' weights produced."""

    def _update(self, x: object, y: object) -> None:
        late = [p for stage, lag in zip(self.stages, self.lags, strict=True) if lag
                for p in stage.module.parameters()]
        loss_fn = self.stages[-1].loss_fn
        assert loss_fn is not None
        loss = loss_fn(self.module(x), y)
        for p, fresh in zip(late, torch.autograd.grad(loss, late), strict=True):
            p.grad = fresh
        super()._update(x, y)


def spikes(losses: list[float]) -> int:
    """Micro-batch losses more than SPIKE times the lowest of the SPIKE_WINDOW before them."""
    return sum(
        losses[i] > SPIKE * min(losses[i - SPIKE_WINDOW : i])
        for i in range(SPIKE_WINDOW, len(losses))
    )


def run_gpt(
    options: dict, lrs: list[float], seeds: int, updates: int, *, jobs: int = 1,
    **arguments,
) -> dict[str, list[float]]:
    """Held-out loss and loss spikes per (lr, seed) after ``updates`` micro-batches of data,
    with DelayedPipeline ``options`` and :func:`train_once`'s ``arguments``; ``jobs`` > 1 runs
    the pairs in that many processes (one torch thread each)."""
    pairs = [(lr, s) for lr in lrs for s in range(seeds)]
    work = partial(train_once, options, updates, **arguments)
    if jobs > 1:
        with multiprocessing.get_context("spawn").Pool(jobs) as pool:
            runs = pool.starmap(work, pairs)
    else:
        runs = [work(lr, s) for lr, s in pairs]
    return {"loss": [loss for loss, _ in runs], "spikes": [jumps for _, jumps in runs],
            "lrs": [lr for lr, _ in pairs]}


def train_once(
    options: dict, updates: int, lr: float, seed: int, *,
    lags: list[int] | None = None, balance: list[int] = BALANCE,
    stage_scale: list[float] | None = None, unit: int = 1, oracle: bool = False,
    optimizer: str = "adamw", dim: int = 64,
) -> tuple[float, float]:
    """One run: held-out loss and loss spikes after ``updates`` micro-batches of data, with
    DelayedPipeline ``options`` (``lags``: its per-stage lags), an update per ``unit``
    micro-batches, stage s's learning rate ``stage_scale[s]`` times the schedule's,
    (``oracle``) the fresh gradients of :class:`FreshGradients`, ``optimizer`` (a key of
    OPTIMIZERS) and the model's width ``dim``."""
    torch.set_num_threads(1)
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import models
    import text
    from train_gpt import lr_factor

    train, held = text.load_corpus()
    evaluation = text.held_out_batches(held, 64, CONTEXT)[:EVAL_BATCHES]
    steps = updates // unit
    model = models.gpt(dim=dim, blocks=4, heads=4, context=CONTEXT, seed=seed, tied=False)
    pipe = (FreshGradients if oracle else DelayedPipeline)(
        model, balance, loss_fn=models.lm_loss,
        optimizer=OPTIMIZERS[optimizer](lr),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_factor(steps, max(steps // 10, 1))),
        lags=lags, **{"schedule": "pipedream", **options},
    )
    for stage, scale in zip(pipe.stages, stage_scale or [], strict=False):
        assert stage.optimizer is not None and stage.scheduler is not None
        stage.scheduler.base_lrs = [b * scale for b in stage.scheduler.base_lrs]
        for group in stage.optimizer.param_groups:
            group["lr"] *= scale
    batches = text.training_batches(train, MICRO * unit, CONTEXT, seed=1000 + seed)
    for _ in range(steps):
        pipe.train_step(*next(batches))
    with torch.no_grad():
        loss = statistics.mean(
            float(models.lm_loss(pipe.eval_step(x), y)) for x, y in evaluation
        )
    return (loss if loss == loss else float("inf")), float(spikes(pipe.losses))  # NaN: diverged


def diagnose(lrs: list[float], seeds: int, updates: int, match: list[str], jobs: int = 1) -> None:
    """Print DIAGNOSIS's rows (those whose name contains one of ``match``, if given): mean
    held-out loss, its difference to the row compared with (when that ran), and the mean
    number of loss spikes per run, for each lr."""
    torch.set_num_threads(1)
    means: dict[str, list[float]] = {}
    print(f"GPT on KJV bytes, AdamW, {updates} micro-batches of {MICRO} windows, mean of "
          f"{seeds} seeds: held-out loss (difference to the row compared with, %) and loss "
          "spikes per run\n")
    print("| run | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " |")
    print("|---|" + "---|" * len(lrs))
    for name, (options, arguments, reference) in DIAGNOSIS.items():
        if match and not any(text in name for text in match):
            continue
        start = time.perf_counter()
        run = run_gpt(options, lrs, seeds, updates, jobs=jobs, **arguments)
        means[name] = [statistics.mean(run["loss"][i * seeds : (i + 1) * seeds])
                       for i in range(len(lrs))]
        cells = []
        for i, loss in enumerate(means[name]):
            jumps = statistics.mean(run["spikes"][i * seeds : (i + 1) * seeds])
            versus = (f" ({100 * (loss / means[reference][i] - 1):+.1f} %)"
                      if reference in means else "")
            cells.append(f"{loss:.3f}{versus}, {jumps:.1f} spikes")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description="where staleness hurts the GPT task")
    parser.add_argument("--lrs", nargs="+", type=float, default=[0.003, 0.01])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=600, help="micro-batches of data")
    parser.add_argument("--match", nargs="+", default=[], help="only the runs naming one of these")
    parser.add_argument("--jobs", type=int, default=1, help="processes, one run each at a time")
    args = parser.parse_args()
    diagnose(args.lrs, args.seeds, args.updates, args.match, args.jobs)


if __name__ == "__main__":
    main()
