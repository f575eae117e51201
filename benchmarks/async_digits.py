"""Asynchronous PipeDream training for real: accuracy on scikit-learn's digits, and throughput.

Accuracy. Digits (8x8 images, 10 classes, 1797 samples; features / 16), a fixed split (512 test
samples, split seed 0), an MLP 64-128-128-128-10 (7 layers) over 4 stages [2, 2, 2, 1], the 4
stages as threads of this process (the same executor as across processes; tests/runtime/
test_async.py checks that both give the same numbers). Same hyper-parameters for every variant:
batch 64 in 8 micro-batches, SGD(lr, momentum=0.9), the same number of epochs, init seeds
0..S-1. Variants:

  sync-1f1b        1F1B with a flush, one update per mini-batch (loss / chunks)
  sync-micro       synchronous, one update per micro-batch of 8: PipeDream's update sequence
                   without staleness (the reference for the PipeDream variants; 2BW's is
                   sync-1f1b)
  async-stale      PipeDream without weight stashing (backward on newer weights)
  async-stash      PipeDream with weight stashing
  async-predict    PipeDream, forward and backward on predicted weights (SpecTrain rule)
  async-msnag      PipeDream, predicted with the momentum-decay rule (FTPipe "msnag")
  2bw              PipeDream-2BW: one update per mini-batch, delay 1, stashing

PipeDream updates after every micro-batch (8 updates of 8 samples per mini-batch, loss not
divided by chunks); 2BW and sync update once per mini-batch. Reported: final test accuracy and
loss (mean and spread over seeds) per learning rate, and a PNG of training loss against samples
seen at the learning rate where staleness hurts most.

Throughput. 2 processes over gloo, one torch thread each, MLP of 16 x Linear(512)+ReLU in 2
stages, batch --batch (128): sync 1F1B against PipeDream (stashing) and 2BW (stashing), for 4
and 8 micro-batches, alternating rounds of 10 consecutive train_steps (median per-step time of
the slowest rank). PipeDream pays one optimizer update and one weight copy per micro-batch,
2BW one of each per mini-batch.

    pip install -e ".[bench]"     # scikit-learn (the dataset), matplotlib (the PNG)
    python benchmarks/async_digits.py                      # both parts, a few minutes
    python benchmarks/async_digits.py --part accuracy --lrs 0.05 0.2 --seeds 3
"""

from __future__ import annotations

import argparse
import math
import statistics
from functools import partial

from pipeline_timing import TimingRun, Workload, time_configs
from schedules_throughput import BLOCKS, WIDTH, linear_model, mse

PLAIN = dict(weight_prediction=None, delay_compensation=None)  # not the default's remedies
VARIANTS = {
    "sync-1f1b": dict(schedule="1f1b", recompute="never"),
    "sync-micro": dict(schedule="1f1b", recompute="never", chunks=1),
    "async-stale": dict(PLAIN, schedule="pipedream", weight_stashing=False),
    "async-stash": dict(PLAIN, schedule="pipedream"),
    "async-predict": dict(PLAIN, schedule="pipedream", weight_prediction="momentum"),
    "async-msnag": dict(PLAIN, schedule="pipedream", weight_prediction="msnag"),
    "2bw": dict(PLAIN, schedule="pipedream-2bw"),
}
BATCH, CHUNKS, TEST = 64, 8, 512
REFERENCE = {  # the synchronous run with the same update sequence as the variant
    **{v: "sync-micro" for v in VARIANTS if v.startswith("async")}, "2bw": "sync-1f1b",
}
TRAINS = 50.0  # test accuracy (%) below which a run counts as not training


def _digits():
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x / 16.0, y, test_size=TEST, random_state=0,
                                          stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


def _mlp(seed: int):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def train_digits(variant: str, lr: float, seed: int, epochs: int, data) -> dict:
    import torch
    from torch import nn

    import pipetrain

    xtr, ytr, xte, yte = data
    options = {"chunks": CHUNKS, **VARIANTS[variant]}
    pipe = pipetrain.Pipeline(
        _mlp(seed), [2, 2, 2, 1], devices=["cpu"] * 4, loss_fn=nn.functional.cross_entropy,
        optimizer=lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9), **options,
    )
    micro = BATCH // CHUNKS if variant == "sync-micro" else BATCH
    g = torch.Generator().manual_seed(1000 + seed)
    losses, seen = [], []
    steps = len(xtr) // BATCH
    for _ in range(epochs):
        order = torch.randperm(len(xtr), generator=g)
        for k in range(steps):
            idx = order[k * BATCH : (k + 1) * BATCH]
            loss = statistics.mean(  # sync-micro: one synchronous step per micro-batch
                pipe.train_step(xtr[idx[j : j + micro]], ytr[idx[j : j + micro]])
                for j in range(0, BATCH, micro)
            )
            losses.append(loss if loss == loss else float("inf"))
            seen.append((len(seen) + 1) * BATCH)
    logits = pipe.eval_step(xte)  # flushes first
    assert isinstance(logits, torch.Tensor)
    test_loss = float(nn.functional.cross_entropy(logits, yte))
    test_loss = test_loss if math.isfinite(test_loss) else float("inf")
    accuracy = float((logits.argmax(1) == yte).float().mean()) * 100
    return {"losses": losses, "seen": seen, "test_loss": test_loss, "accuracy": accuracy}


def accuracy_part(lrs: list[float], seeds: int, epochs: int, png: str) -> None:
    data = _digits()
    results: dict[tuple[str, float], list[dict]] = {}
    for lr in lrs:
        for variant in VARIANTS:
            results[variant, lr] = [train_digits(variant, lr, s, epochs, data)
                                    for s in range(seeds)]
    print(f"\ndigits, 4 stages, batch {BATCH} in {CHUNKS} micro-batches, SGD momentum 0.9, "
          f"{epochs} epochs, {seeds} seeds (mean ± sd)")
    print(f"{'lr':>6} {'variant':<14} {'test acc %':>14} {'test loss':>16} {'diff to ref':>12}"
          "  (ref: sync-micro for the PipeDream variants, sync-1f1b for 2bw)")

    def accuracy(variant: str, lr: float) -> float:
        return statistics.mean(r["accuracy"] for r in results[variant, lr])

    for lr in lrs:
        for variant in VARIANTS:
            rs = results[variant, lr]
            acc = [r["accuracy"] for r in rs]
            loss = [r["test_loss"] for r in rs]
            sd = lambda v: statistics.pstdev(v) * (len(v) / (len(v) - 1)) ** 0.5 if (  # noqa: E731
                len(v) > 1 and all(math.isfinite(a) for a in v)) else float("nan")
            diff = f"{statistics.mean(acc) - accuracy(REFERENCE[variant], lr):>+12.2f}" if (
                variant in REFERENCE) else f"{'':>12}"
            print(f"{lr:>6g} {variant:<14} {statistics.mean(acc):>8.2f} ± {sd(acc):<4.2f}"
                  f" {statistics.mean(loss):>9.4f} ± {sd(loss):<5.3f} {diff}")

    def gap(lr: float) -> float:
        """How much stale weights cost PipeDream at ``lr``: its synchronous reference minus
        the worse stale variant; -inf where the reference itself does not train."""
        if accuracy("sync-micro", lr) < TRAINS:
            return -math.inf
        return accuracy("sync-micro", lr) - min(
            accuracy(v, lr) for v in ("async-stale", "async-stash")
        )

    worst = max(lrs, key=gap)
    print(f"staleness hurts most at lr={worst:g} (sync-micro minus the worse stale variant: "
          f"{gap(worst):.2f} points; rates where sync-micro reaches < {TRAINS:g}% excluded)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, ax = plt.subplots(figsize=(8, 5))
    for variant in VARIANTS:
        rs = results[variant, worst]
        n = min(len(r["losses"]) for r in rs)
        mean = [statistics.mean(min(r["losses"][k], 5.0) for r in rs) for k in range(n)]
        window = 10
        smooth = [statistics.mean(mean[max(0, k - window + 1) : k + 1]) for k in range(n)]
        ax.plot(rs[0]["seen"][:n], smooth, label=variant)
    ax.set_xlabel("training samples seen")
    ax.set_ylabel(f"training loss (mean of {len(rs)} seeds, moving average of 10 steps)")
    ax.set_title(f"digits, 4-stage MLP, SGD lr={worst:g} momentum 0.9")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


# -- throughput ---------------------------------------------------------------------------------

THROUGHPUT = {
    "sync-1f1b": dict(schedule="1f1b", recompute="never"),
    "pipedream": dict(schedule="pipedream"),
    "2bw": dict(schedule="pipedream-2bw"),
}


def linear_workload(batch: int) -> Workload:
    """The throughput model (2 stages of BLOCKS x Linear(WIDTH)+ReLU) and a fixed random
    mini-batch of ``batch`` rows with MSE targets."""
    import torch

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, WIDTH, generator=g), torch.randn(batch, WIDTH, generator=g)
    return Workload(linear_model(), [BLOCKS, BLOCKS], mse, x, y)


def throughput_part(rounds: int, steps: int, batch: int) -> None:
    configs = {
        (name, chunks): dict(chunks=chunks, **options)
        for chunks in (4, 8)
        for name, options in THROUGHPUT.items()
    }
    medians = time_configs(TimingRun(2, partial(linear_workload, batch), configs, rounds,
                                     steps))["times"]
    print(f"\nthroughput, 2 stages (processes, gloo), {BLOCKS} x Linear({WIDTH})+ReLU, batch "
          f"{batch}; median per-step time over {rounds} rounds of {steps} steps")
    print(f"{'chunks':>6} " + " ".join(f"{n + ' s/step':>17}" for n in THROUGHPUT)
          + " " + " ".join(f"{n + ' speed-up':>18}" for n in list(THROUGHPUT)[1:]))
    for chunks in (4, 8):
        t = [medians[n, chunks] for n in THROUGHPUT]
        print(f"{chunks:>6} " + " ".join(f"{v:>17.4f}" for v in t) + " "
              + " ".join(f"{t[0] / v:>17.2f}x" for v in t[1:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["accuracy", "throughput", "all"], default="all")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.01, 0.02, 0.04])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--png", default="async_digits_loss.png")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128, help="throughput mini-batch")
    args = parser.parse_args()
    if args.part in ("accuracy", "all"):
        accuracy_part(args.lrs, args.seeds, args.epochs, args.png)
    if args.part in ("throughput", "all"):
        throughput_part(args.rounds, args.steps, args.batch)


if __name__ == "__main__":
    main()
