"""Asynchronous 2BW with and without the error-feedback correction, for AdamW and Muon (issue 49.2).

Per optimizer (AdamW; Muon on the hidden matrices with AdamW on the rest, pipetrain.optim.
muon_adamw) and variant:

  sync       synchronous 1F1B (one update per mini-batch, no delay)
  async      "pipedream-2bw", weight_prediction="auto" (AdamW: prediction; Muon: stashing),
             no compensation (Pipeline's default before this study)
  async+ef   "pipedream-2bw", stashing, delay_compensation="error-feedback"

each at each lr of a sweep, for several seeds, one run after another in this process
(benchmarks/delayed.py's DelayedPipeline: the runtime's stages, weight versions and
compensation in 2BW's update order; tests/benchmarks/test_delayed.py checks it against
Pipeline), one torch thread. Tasks:

  digits  the MLP of async_digits.py (64-128-128-128-10 over 4 stages [2, 2, 2, 1]), batch 64,
          the data order of seed s from generator 1000 + s, weight decay 0.01; Muon on the two
          128x128 matrices, AdamW on the input layer, the head and the biases
  gpt     the byte-level GPT of benchmarks/staleness_gpt.py (width 64, 4 blocks, 4 stages),
          an update per micro-batch of 8 windows, betas 0.9 / 0.95, weight decay 0.1, warm-up
          and cosine decay; Muon on the blocks' matrices, AdamW on the embeddings and the head

Reported per (task, optimizer, variant) at its best lr (lowest mean final held-out loss over
seeds): that loss, digits' accuracy, and the gap to sync of the same optimizer; a plot of the
training-loss curves (moving average) at those lrs. Raw results (one entry per run) go to a
JSON file, filled as runs finish, so that a study can be resumed or split.

    python benchmarks/error_feedback_study.py --task digits --updates 2000 --seeds 3
    python benchmarks/error_feedback_study.py --task gpt --updates 600 --seeds 3
    python benchmarks/error_feedback_study.py --report
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from async_digits import _digits, _mlp
from delayed import DelayedPipeline
from staleness_gpt import CONTEXT, EVAL_BATCHES, EXAMPLES, MICRO
from torch import nn

from pipetrain.optim import muon_adamw

DIGITS_BALANCE, GPT_BALANCE, BATCH = [2, 2, 2, 1], [2, 1, 1, 2], 64
VARIANTS = {
    "sync": dict(schedule="1f1b"),
    "async": dict(schedule="pipedream-2bw", delay_compensation=None),
    "async+ef": dict(schedule="pipedream-2bw", weight_prediction=None,
                     delay_compensation="error-feedback"),
}
OPTIMIZERS = ("adamw", "muon")
LRS = {"digits": [0.001, 0.003, 0.01, 0.03], "gpt": [0.001, 0.003, 0.01, 0.03]}
CURVE = 100  # updates per point of the training-loss curve (their mean)


def optimizer(name: str, lr: float, task: str, plain: list[nn.Parameter]):
    """The factory of one run: AdamW, or Muon with ``plain`` (input and output layers) on
    AdamW; the task's betas and weight decay for both."""
    decay, betas = (0.01, (0.9, 0.999)) if task == "digits" else (0.1, (0.9, 0.95))
    if name == "muon":
        return muon_adamw(lr, adamw=plain, weight_decay=decay, betas=betas)
    return lambda ps: torch.optim.AdamW(ps, lr=lr, betas=betas, weight_decay=decay)


def curve(losses: list[float]) -> list[float]:
    return [statistics.mean(losses[i : i + CURVE]) for i in range(0, len(losses), CURVE)]


def digits_run(name: str, variant: str, lr: float, seed: int, updates: int, data) -> dict:
    """One digits run: held-out loss and accuracy after ``updates`` updates, and the curve."""
    xtr, ytr, xte, yte = data
    model = _mlp(seed)
    plain = [*model[0].parameters(), *model[-1].parameters()]
    pipe = DelayedPipeline(model, DIGITS_BALANCE, loss_fn=nn.functional.cross_entropy,
                           optimizer=optimizer(name, lr, "digits", plain), **VARIANTS[variant])
    gen = torch.Generator().manual_seed(1000 + seed)
    order = torch.randperm(len(xtr), generator=gen)
    steps = len(xtr) // BATCH
    for k in range(updates):
        if k and k % steps == 0:
            order = torch.randperm(len(xtr), generator=gen)
        idx = order[(k % steps) * BATCH : (k % steps + 1) * BATCH]
        pipe.train_step(xtr[idx], ytr[idx])
    logits = pipe.eval_step(xte)
    assert isinstance(logits, torch.Tensor)
    return {"loss": _finite(float(nn.functional.cross_entropy(logits, yte))),
            "accuracy": float((logits.argmax(-1) == yte).float().mean()) * 100,
            "curve": curve(pipe.losses)}


def gpt_run(name: str, variant: str, lr: float, seed: int, updates: int, data) -> dict:
    """One GPT run: held-out loss after ``updates`` updates (a micro-batch of data each)."""
    import models
    import text
    from train_gpt import lr_factor

    train, evaluation = data
    model = models.gpt(dim=64, blocks=4, heads=4, context=CONTEXT, seed=seed, tied=False)
    plain = [*model[0].parameters(), *model[-1].parameters()]
    pipe = DelayedPipeline(
        model, GPT_BALANCE, loss_fn=models.lm_loss,
        optimizer=optimizer(name, lr, "gpt", plain),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
            opt, lr_factor(updates, max(updates // 10, 1))),
        **VARIANTS[variant],
    )
    batches = text.training_batches(train, MICRO, CONTEXT, seed=1000 + seed)
    for _ in range(updates):
        pipe.train_step(*next(batches))
    with torch.no_grad():
        loss = statistics.mean(float(models.lm_loss(pipe.eval_step(x), y)) for x, y in evaluation)
    return {"loss": _finite(loss), "curve": curve(pipe.losses)}


def _finite(value: float) -> float:
    return value if value == value and value != float("inf") else float("inf")


def _data(task: str):
    if task == "digits":
        return _digits()
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import text

    train, held = text.load_corpus()
    return train, text.held_out_batches(held, 64, CONTEXT)[:EVAL_BATCHES]


def study(task: str, optimizers: list[str], variants: list[str], lrs: list[float], seeds: int,
          updates: int, raw: Path) -> None:
    """Run every missing (optimizer, variant, lr, seed) of ``task`` and store it in ``raw``."""
    torch.set_num_threads(1)
    results = json.loads(raw.read_text()) if raw.exists() else {}
    data, run = _data(task), digits_run if task == "digits" else gpt_run
    for name in optimizers:
        for variant in variants:
            for lr in lrs:
                for seed in range(seeds):
                    key = f"{task}|{updates}|{name}|{variant}|{lr}|{seed}"
                    if key in results:
                        continue
                    start = time.perf_counter()
                    results[key] = run(name, variant, lr, seed, updates, data)
                    results[key]["seconds"] = time.perf_counter() - start
                    print(key, {k: v for k, v in results[key].items() if k != "curve"},
                          flush=True)
                    raw.write_text(json.dumps(results))


def best(results: dict, task: str, updates: int, name: str, variant: str) -> tuple[float, list]:
    """The lr with the lowest mean held-out loss over seeds, and its runs."""
    runs: dict[float, list] = {}
    for key, value in results.items():
        t, u, n, v, lr, _ = key.split("|")
        if (t, int(u), n, v) == (task, updates, name, variant):
            runs.setdefault(float(lr), []).append(value)
    lr = min(runs, key=lambda r: statistics.mean(x["loss"] for x in runs[r]))
    return lr, runs[lr]


def table(results: dict) -> list[str]:
    """Markdown rows: task, updates, optimizer, variant, best lr, loss, accuracy, gaps."""
    lines = ["| task (updates, seeds) | optimizer | variant | best lr | held-out loss | gap to "
             "sync | accuracy (%) | gap (points) |", "|---|---|---|---|---|---|---|---|"]
    groups = sorted({tuple(k.split("|")[:3]) for k in results})
    for task, updates, name in groups:
        sync = best(results, task, int(updates), name, "sync")[1]
        ref = statistics.mean(r["loss"] for r in sync)
        for variant in VARIANTS:
            if not any(k.startswith(f"{task}|{updates}|{name}|{variant}|") for k in results):
                continue
            lr, runs = best(results, task, int(updates), name, variant)
            loss = statistics.mean(r["loss"] for r in runs)
            acc = (f"{statistics.mean(r['accuracy'] for r in runs):.1f}"
                   if "accuracy" in runs[0] else "")
            gap_acc = (f"{statistics.mean(r['accuracy'] for r in runs) - statistics.mean(r['accuracy'] for r in sync):+.1f}"  # noqa: E501
                       if acc else "")
            lines.append(f"| {task} ({updates}, {len(runs)}) | {name} | {variant} | {lr:g} | "
                         f"{loss:.4f} | {100 * (loss - ref) / ref:+.2f} % | {acc} | {gap_acc} |")
    return lines


def plot(results: dict, png: Path) -> None:
    """Training-loss curves at each variant's best lr (mean over seeds), a panel per task and
    optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({tuple(k.split("|")[:3]) for k in results})
    fig, axes = plt.subplots(1, len(groups), figsize=(4.5 * len(groups), 3.6), squeeze=False)
    for ax, (task, updates, name) in zip(axes[0], groups, strict=True):
        for variant in VARIANTS:
            if not any(k.startswith(f"{task}|{updates}|{name}|{variant}|") for k in results):
                continue
            lr, runs = best(results, task, int(updates), name, variant)
            points = [statistics.mean(c) for c in zip(*(r["curve"] for r in runs), strict=True)]
            ax.plot([CURVE * (i + 1) for i in range(len(points))], points,
                    label=f"{variant} (lr {lr:g})")
        ax.set(title=f"{task}, {name}", xlabel="update", ylabel="training loss", yscale="log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=list(LRS), default="digits")
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--lrs", nargs="+", type=float)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--raw", type=Path, default=Path("docs/error_feedback.json"))
    parser.add_argument("--png", type=Path, default=Path("docs/error_feedback.png"))
    parser.add_argument("--report", action="store_true", help="table and plot from --raw")
    args = parser.parse_args()
    if args.report:
        results = json.loads(args.raw.read_text())
        print("\n".join(table(results)))
        plot(results, args.png)
        return
    study(args.task, args.optimizers, args.variants, args.lrs or LRS[args.task], args.seeds,
          args.updates, args.raw)


if __name__ == "__main__":
    main()
