"""Staleness remedies for asynchronous schedules: held-out accuracy against lr, and throughput.

Accuracy (issue 21). Digits as in async_digits.py (8x8 images, 512 held-out samples, MLP
64-128-128-128-10 over 4 stages [2, 2, 2, 1], batch 64 in 8 micro-batches, init seeds 0..S-1,
the data order of seed s from generator 1000 + s), SGD(momentum 0.9) and AdamW(weight_decay
0.01), a grid of learning rates from where everything trains to where synchronous training
stops. The asynchronous update sequence runs in one process
(benchmarks/delayed.py's DelayedPipeline: the runtime's own stages, weight versions and
compensations, in PipeDream's and 2BW's order; tests/benchmarks/test_delayed.py checks it against
Pipeline), and every (lr, seed) pair of a variant trains at once as one ensemble (one independent
MLP per pair, its own parameter group and lr), which is what makes the sweep affordable on a shared
2-core machine. Variants:

  sync-micro       one synchronous update per micro-batch of 8 (reference of the PipeDream rows)
  default          Pipeline's defaults (weight_prediction and delay_compensation "auto")
  stale            PipeDream without weight stashing
  stash            PipeDream with weight stashing
  predict          stashing on predicted weights (weight_prediction="momentum")
  spike            stashing + spike compensation
  spike+predict    spike compensation with prediction (Kosson et al.'s combination)
  lag-lr+predict   lr / (1 + lag) per stage, with prediction
  pipemare         PipeMare: no stashing, lr warm-up per stage's delay, discrepancy correction
  pipemare+predict PipeMare's lr warm-up with prediction
  spike+lag-lr+predict, spike+pipemare+predict   combinations
  lag-momentum     momentum 1 - (1 - mu) / k and SGD's lr / k per stage, k = 1 + 2 lag
  lag-momentum+predict, spike+lag-momentum+predict   with prediction, and with spike too
  sync-1f1b        one synchronous update per mini-batch of 64 (reference of the 2BW rows)
  2bw-default, 2bw, 2bw-predict, 2bw-spike+predict, 2bw-lag-momentum+predict,
  2bw-spike+lag-momentum+predict   PipeDream-2BW (lag 1) as above
  sync-nadamw      sync-micro with the Nesterov method's NAdamW (momentum 0.99, held constant)
  nesterov         the Nesterov method (issue 32): PipeDream, stashing, NAdamW at 0.99 (constant)

The second task (``--optimizers gpt``, benchmarks/staleness_gpt.py) is a small byte-level GPT
on the bundled King James text with AdamW, one (lr, seed) run after another, for the
PipeDream variants of GPT_VARIANTS.

Reported: mean held-out accuracy (digits) or loss (GPT) over seeds per (task, lr, variant), the
difference to the reference, and whether the issue's goal holds: at most 0.5 points below
sync-micro wherever sync-micro reaches 90 %; a GPT loss at most 2 % above sync-micro's wherever
that is below 3.0 nats, what byte frequencies alone give (being ahead is no miss). Raw results
go to a JSON file (runs can be split with --variants and merged); the table (markdown) and the
plot (the metric against lr, one line per variant) are made from it.

Throughput. 2 processes over gloo, one torch thread each, 16 x Linear(512)+ReLU in 2 stages,
PipeDream with 8 micro-batches of batch 128, each method against today's prediction
(alternating rounds, median per-step time of the slower rank).

    pip install -e ".[bench]"
    nice -n 19 python benchmarks/staleness_study.py --part accuracy        # docs/staleness.*
    nice -n 19 python benchmarks/staleness_study.py --part throughput
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from functools import partial
from pathlib import Path

from async_digits import BATCH, CHUNKS, PLAIN, _digits, _mlp, linear_workload
from pipeline_timing import TimingRun, time_configs
from schedules_throughput import BLOCKS, WIDTH
from staleness_gpt import UNIGRAM, run_gpt

from pipetrain.optim import CONSTANT, nadamw

PIPEDREAM = {  # on top of PLAIN: each variant names every remedy it applies
    "sync-micro": dict(schedule="1f1b"),
    "default": dict(weight_prediction="auto", delay_compensation="auto"),
    "stale": dict(weight_stashing=False),
    "stash": {},
    "predict": dict(weight_prediction="momentum"),
    "spike": dict(delay_compensation="spike"),
    "spike+predict": dict(delay_compensation="spike", weight_prediction="momentum"),
    "lag-lr+predict": dict(delay_compensation="lag-lr", weight_prediction="momentum"),
    "pipemare": dict(delay_compensation="pipemare", weight_stashing=False),
    "pipemare+predict": dict(delay_compensation="pipemare", weight_prediction="momentum"),
    "spike+lag-lr+predict": dict(delay_compensation="spike+lag-lr",
                                 weight_prediction="momentum"),
    "spike+pipemare+predict": dict(delay_compensation="spike+pipemare",
                                   weight_prediction="momentum"),
    "lag-momentum": dict(delay_compensation="lag-momentum"),
    "lag-momentum+predict": dict(delay_compensation="lag-momentum", weight_prediction="momentum"),
    "spike+lag-momentum+predict": dict(delay_compensation="spike+lag-momentum",
                                       weight_prediction="momentum"),
}
TWO_BW = {
    "sync-1f1b": dict(schedule="1f1b"),
    "2bw-default": dict(schedule="pipedream-2bw", weight_prediction="auto",
                        delay_compensation="auto"),
    "2bw": dict(schedule="pipedream-2bw"),
    "2bw-predict": dict(schedule="pipedream-2bw", weight_prediction="momentum"),
    "2bw-spike+predict": dict(schedule="pipedream-2bw", delay_compensation="spike",
                              weight_prediction="momentum"),
    "2bw-lag-momentum+predict": dict(schedule="pipedream-2bw", delay_compensation="lag-momentum",
                                     weight_prediction="momentum"),
    "2bw-spike+lag-momentum+predict": dict(schedule="pipedream-2bw",
                                           delay_compensation="spike+lag-momentum",
                                           weight_prediction="momentum"),
}
NESTEROV = {  # issue 32: NAdamW (pipetrain.optim.nadamw) in AdamW's place; digits and GPT only
    "sync-nadamw": dict(schedule="1f1b", optimizer="nadamw"),
    "nesterov": dict(optimizer="nadamw"),
}
PIPEDREAM.update(NESTEROV)
VARIANTS = {**{k: ("micro", v) for k, v in PIPEDREAM.items()},
            **{k: ("mini", v) for k, v in TWO_BW.items()}}
REFERENCE = {**{v: "sync-micro" for v in PIPEDREAM}, **{v: "sync-1f1b" for v in TWO_BW}}
LRS = {"sgd": [0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08],
       "adamw": [0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032],
       "gpt": [0.0003, 0.001, 0.003, 0.01, 0.03, 0.1]}
TITLES = {"sgd": "digits, SGD momentum 0.9", "adamw": "digits, AdamW (weight decay 0.01)",
          "gpt": "GPT on KJV bytes, AdamW"}
GPT_VARIANTS = ["sync-micro", "stash", "predict", "spike+predict", "lag-lr+predict",
                "lag-momentum+predict", *NESTEROV]  # the default under AdamW is "predict"
BALANCE = [2, 2, 2, 1]
TRAINS, GOAL = 90.0, 0.5  # sync accuracy (%) from which the goal applies; allowed gap (points)
GPT_GOAL = 2.0  # allowed held-out loss above the reference (%) wherever it is below UNIGRAM
# issue 32's goal for the Nesterov method against synchronous AdamW: (at the best lr of each,
# at every lr where synchronous training trains), in % of the GPT's loss or digits' points
NESTEROV_GOAL = {"gpt": (1.0, 3.0), "adamw": (1.0, 1.0)}


def _ensemble(seeds: list[int], stacked: bool):
    """The MLP of async_digits.py, one independent member per entry of ``seeds`` (member r
    initialised as _mlp(seeds[r])), on inputs shaped (members, batch, features). ``stacked``:
    one parameter per layer holding every member (one optimizer group: SGD with the lr folded
    into each member's loss weight); else one parameter per member (a group each: AdamW)."""
    import torch
    from torch import nn

    class EnsembleLinear(nn.Module):
        def __init__(self, layers: list[nn.Linear]):
            super().__init__()
            weights = [m.weight.detach().t().clone() for m in layers]
            biases = [m.bias.detach().clone() for m in layers]
            if stacked:
                self.weight = nn.Parameter(torch.stack(weights))
                self.bias = nn.Parameter(torch.stack(biases))
            else:
                self.weight = nn.ParameterList(nn.Parameter(w) for w in weights)
                self.bias = nn.ParameterList(nn.Parameter(b) for b in biases)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            w, b = self.weight, self.bias
            if not stacked:
                w, b = torch.stack(list(w)), torch.stack(list(b))
            return torch.baddbmm(b.unsqueeze(1), x, w)

    members = [_mlp(s) for s in seeds]
    layers = [
        EnsembleLinear([m[i] for m in members]) if isinstance(members[0][i], nn.Linear)
        else nn.ReLU()
        for i in range(len(members[0]))
    ]
    return nn.Sequential(*layers)


def _loss(weights):
    """Each member's mean cross entropy times its weight, summed: every member gets its own
    gradient (scaled by its weight)."""
    import torch.nn.functional as F

    def loss(out, y):
        per = F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction="none")
        return (per.view(y.shape).mean(1) * weights).sum()

    return loss


def run_variant(variant: str, kind: str, lrs: list[float], seeds: int, epochs: int,
                data) -> dict[str, list[float]]:
    """Held-out accuracy (%) and loss per (lr, seed) member of one ensemble run. SGD (without
    weight decay) runs every member at lr 1 with its loss weighted by its lr: the velocity is
    then lr times the member's own, and every remedy (spike, lr scaling, prediction, PipeMare's
    correction) is linear in it, so each member follows its own lr exactly."""
    import torch
    from delayed import DelayedPipeline

    xtr, ytr, xte, yte = data
    pairs = [(lr, s) for lr in lrs for s in range(seeds)]
    stacked = kind == "sgd"
    model = _ensemble([s for _, s in pairs], stacked)
    member = {id(p): r for layer in model for name, plist in layer.named_children()
              for r, p in enumerate(plist.parameters()) if name in ("weight", "bias")}

    def optimizer(params):
        if stacked:
            return torch.optim.SGD(params, lr=1.0, momentum=0.9)
        groups = [{"params": [p for p in params if member[id(p)] == r], "lr": pairs[r][0]}
                  for r in range(len(pairs))]
        groups = [g for g in groups if g["params"]]
        if name == "nadamw":
            return nadamw(groups[0]["lr"], weight_decay=0.01, momentum_decay=CONSTANT)(groups)
        return torch.optim.AdamW(groups, lr=groups[0]["lr"], weight_decay=0.01)

    unit, options = VARIANTS[variant]
    options = {"schedule": "pipedream", **PLAIN, **options}
    name = options.pop("optimizer", kind)
    weights = torch.tensor([lr if stacked else 1.0 for lr, _ in pairs])
    pipe = DelayedPipeline(model, BALANCE, loss_fn=_loss(weights), optimizer=optimizer,
                           **options)
    size = BATCH // CHUNKS if unit == "micro" else BATCH
    gens = [torch.Generator().manual_seed(1000 + s) for _, s in pairs]
    steps = len(xtr) // BATCH
    for _ in range(epochs):
        orders = [torch.randperm(len(xtr), generator=g) for g in gens]
        for k in range(steps):
            idx = torch.stack([o[k * BATCH : (k + 1) * BATCH] for o in orders])
            for j in range(0, BATCH, size):
                part = idx[:, j : j + size]
                pipe.train_step(xtr[part], ytr[part])
    logits = pipe.eval_step(xte.expand(len(pairs), *xte.shape))
    assert isinstance(logits, torch.Tensor)
    acc = (logits.argmax(-1) == yte).float().mean(-1) * 100
    loss = torch.stack([torch.nn.functional.cross_entropy(out, yte) for out in logits])
    return {"accuracy": [float(a) for a in acc],
            "loss": [float(v) if math.isfinite(float(v)) else float("inf") for v in loss],
            "lrs": [lr for lr, _ in pairs]}


def accuracy_part(kinds: list[str], variants: list[str], seeds: int, epochs: int,
                  updates: int, raw: Path, jobs: int) -> None:
    import torch

    torch.set_num_threads(1)  # tiny matrices: more threads only contend on a shared machine
    data = _digits()
    results = json.loads(raw.read_text()) if raw.exists() else {}
    for kind in kinds:
        for variant in variants:
            if (kind == "gpt" and variant not in GPT_VARIANTS
                    or kind == "sgd" and variant in NESTEROV):
                continue
            start = time.perf_counter()
            if kind == "gpt":
                options = {**PLAIN, **PIPEDREAM[variant]}
                name = options.pop("optimizer", "adamw")
                run = {**run_gpt(options, LRS[kind], seeds, updates, optimizer=name, jobs=jobs),
                       "updates": updates}
            else:
                run = {**run_variant(variant, kind, LRS[kind], seeds, epochs, data),
                       "epochs": epochs}
            results[f"{kind}/{variant}"] = {**run, "seeds": seeds}
            raw.write_text(json.dumps(results, indent=1))
            print(f"{kind} {variant}: {time.perf_counter() - start:.0f} s", flush=True)


def _means(results: dict, kind: str, variant: str) -> dict[float, float]:
    """Mean over seeds per lr: held-out accuracy (%) on digits, held-out loss on GPT."""
    r = results.get(f"{kind}/{variant}")
    if r is None:
        return {}
    by_lr: dict[float, list[float]] = {}
    for lr, a in zip(r["lrs"], r["loss" if kind == "gpt" else "accuracy"], strict=True):
        by_lr.setdefault(lr, []).append(a)
    return {lr: statistics.mean(v) for lr, v in by_lr.items()}


def _difference(kind: str, mine: float, ref: float) -> float:
    """What the table shows: points of accuracy (digits) or % of held-out loss (GPT)."""
    return 100 * (mine / ref - 1) if kind == "gpt" else mine - ref


def _cell(kind: str, mine: dict[float, float], ref: dict[float, float], lr: float) -> str:
    """A table cell: the difference to the reference at ``lr`` ("-" where either did not run
    it), or the value itself where there is no reference."""
    if lr not in mine or ref and lr not in ref:
        return "-"
    return f"{_difference(kind, mine[lr], ref[lr]):+.1f}" if ref else f"{mine[lr]:.3g}"


def _behind(kind: str, mine: float, ref: float) -> float:
    """How far behind the reference, in the table's unit (negative: ahead)."""
    return _difference(kind, mine, ref) * (1 if kind == "gpt" else -1)


def goal_met(results: dict, kind: str, variant: str) -> bool | None:
    """Digits: at most GOAL points below the reference at every lr where the reference reaches
    TRAINS; GPT: a held-out loss at most GPT_GOAL % above it wherever it is below UNIGRAM."""
    mine, ref = _means(results, kind, variant), _means(results, kind, REFERENCE[variant])
    held = [lr for lr, a in ref.items() if (a < UNIGRAM if kind == "gpt" else a >= TRAINS)]
    if not mine or not held:
        return None  # nothing to compare, or the reference trains nowhere
    limit = GPT_GOAL if kind == "gpt" else GOAL
    return all(_behind(kind, mine[lr], ref[lr]) <= limit  # ahead is no miss
               for lr in held if lr in mine)


def _legend(kind: str, meta: dict) -> list[str]:
    if kind == "gpt":
        return [f"\n### {TITLES[kind]}, {meta['updates']} updates, mean of {meta['seeds']} "
                "seeds\n",
                "Held-out loss (nats per byte); the rows below the reference give the "
                f"difference to it (%). Goal: at most {GPT_GOAL:g} % above it wherever it is "
                f"below {UNIGRAM:g} (byte frequencies alone).\n"]
    return [f"\n### {TITLES[kind]}, {meta['epochs']} epochs, mean of {meta['seeds']} seeds\n",
            "Held-out accuracy (%); the rows below their reference give the difference to it "
            f"(points). Goal: at most {GOAL} below the reference wherever it reaches "
            f"{TRAINS:g} %.\n"]


def nesterov_lines(results: dict, kind: str) -> list[str]:
    """Issue 32's comparison: synchronous AdamW and NAdamW, AdamW's asynchronous default and
    the Nesterov method, each at its own best lr, then the method at every lr against both
    synchronous runs, and whether it meets NESTEROV_GOAL."""
    default = "predict" if kind == "gpt" else "default"
    rows = {"sync-micro": "synchronous AdamW", "sync-nadamw": "synchronous NAdamW 0.99",
            default: "PipeDream, AdamW's default (prediction)",
            "nesterov": "PipeDream, Nesterov (NAdamW 0.99, stashing)"}
    means = {v: _means(results, kind, v) for v in rows}
    if not all(means.values()):
        return []
    best = {v: (min if kind == "gpt" else max)(m.items(), key=lambda item: item[1])
            for v, m in means.items()}
    digits = 3 if kind == "gpt" else 1
    unit = "%" if kind == "gpt" else "points"
    lines = [f"\n#### {TITLES[kind]}: the Nesterov method (issue 32)\n",
             f"Each at its own best lr (difference to synchronous AdamW's best, {unit}):\n",
             "| run | best | at lr | vs synchronous AdamW |", "|---|---|---|---|"]
    ref = best["sync-micro"][1]
    for v, label in rows.items():
        lr, value = best[v]
        lines.append(f"| {label} | {value:.{digits}f} | {lr:g} | "
                     f"{_difference(kind, value, ref):+.1f} |")
    lines += ["", f"The method at every lr (difference, {unit}):\n",
              "| against | " + " | ".join(f"lr {lr:g}" for lr in LRS[kind]) + " |",
              "|---|" + "---|" * len(LRS[kind])]
    mine = means["nesterov"]
    for v in ("sync-micro", "sync-nadamw"):
        lines.append(f"| {rows[v]} | " + " | ".join(
            _cell(kind, mine, means[v], lr) for lr in LRS[kind]) + " |")
    at_best, everywhere = NESTEROV_GOAL[kind]
    trains = [lr for lr, a in means["sync-micro"].items()
              if (a < UNIGRAM if kind == "gpt" else a >= TRAINS)]
    worst = max(_behind(kind, mine[lr], means["sync-micro"][lr]) for lr in trains if lr in mine)
    gap = _behind(kind, best["nesterov"][1], ref)
    met = gap <= at_best and worst <= everywhere
    lines.append(f"\nGoal (best within {at_best:g}, every lr where synchronous AdamW trains "
                 f"within {everywhere:g} {unit}): {'met' if met else 'not met'}: its best is "
                 f"{gap:+.1f} behind, its worst lr {worst:+.1f} behind (negative: ahead).")
    return lines


def report(raw: Path, markdown: Path, png: Path) -> None:
    results = json.loads(raw.read_text())
    lines = []
    for kind in LRS:
        names = [v for v in VARIANTS if f"{kind}/{v}" in results]
        if not names:
            continue
        lines += _legend(kind, results[f"{kind}/{names[0]}"])
        lines += ["| variant | " + " | ".join(f"lr {lr:g}" for lr in LRS[kind]) + " | goal |",
                  "|---|" + "---|" * (len(LRS[kind]) + 1)]
        for v in names:
            mine, ref = _means(results, kind, v), _means(results, kind, REFERENCE[v])
            if v == REFERENCE[v]:
                cells = [f"**{mine[lr]:.{3 if kind == 'gpt' else 1}f}**" if lr in mine else "-"
                         for lr in LRS[kind]]
                met = ""
            else:
                cells = [_cell(kind, mine, ref, lr) for lr in LRS[kind]]
                met = {True: "yes", False: "no", None: "n/a"}[goal_met(results, kind, v)]
            lines.append(f"| {v} | " + " | ".join(cells) + f" | {met} |")
        lines += nesterov_lines(results, kind)
    markdown.write_text(markdown.read_text().split("<!-- table -->")[0] + "<!-- table -->\n"
                        + "\n".join(lines) + "\n" if markdown.exists() else "\n".join(lines))
    print("\n".join(lines))
    _plot(results, png)


def _plot(results: dict, png: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    kinds = [k for k in LRS if any(key.startswith(f"{k}/") for key in results)]
    fig, axes = plt.subplots(1, len(kinds), figsize=(6.5 * len(kinds), 5), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        for v in VARIANTS:
            mine = _means(results, kind, v)
            if mine:
                dashed = v in TWO_BW
                style = ("k" if v.startswith("sync") else "") + ("--" if dashed else "-")
                ax.plot(list(mine), list(mine.values()), style, marker="o", ms=3, label=v)
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        if kind == "gpt":
            ax.set_ylabel("held-out loss (nats per byte)")
            ax.set_ylim(1.8, 3.2)
        else:
            ax.set_ylabel("held-out accuracy (%)")
            ax.set_ylim(0, 100)
        ax.set_title(f"{TITLES[kind]}, 4 stages")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


# -- throughput ---------------------------------------------------------------------------------

THROUGHPUT = {  # on top of PLAIN
    "stash": {},
    "predict": dict(weight_prediction="momentum"),
    "spike+predict": dict(delay_compensation="spike", weight_prediction="momentum"),
    "lag-lr+predict": dict(delay_compensation="lag-lr", weight_prediction="momentum"),
    "pipemare+predict": dict(delay_compensation="pipemare", weight_prediction="momentum"),
    "spike+lag-lr+predict": dict(delay_compensation="spike+lag-lr",
                                 weight_prediction="momentum"),
    "lag-momentum+predict": dict(delay_compensation="lag-momentum", weight_prediction="momentum"),
    "spike+lag-momentum+predict": dict(delay_compensation="spike+lag-momentum",
                                       weight_prediction="momentum"),
}


THROUGHPUT_NESTEROV = {  # issue 32: the method against synchronous 1F1B and AdamW's default
    "1f1b (AdamW)": dict(schedule="1f1b", optimizer="adamw"),
    "predict (AdamW)": dict(weight_prediction="momentum", optimizer="adamw"),
    "nesterov (NAdamW)": dict(optimizer="nadamw"),
}


def throughput_part(rounds: int, steps: int, batch: int, methods: list[str]) -> None:
    """Median per-step time of each method, and its speed against the first one named."""
    table = {**THROUGHPUT, **THROUGHPUT_NESTEROV}
    configs = {
        name: {"chunks": 8, "schedule": "pipedream", **PLAIN, **table[name]}
        for name in methods
    }
    medians = time_configs(TimingRun(2, partial(linear_workload, batch), configs, rounds,
                                     steps))["times"]
    print(f"\nthroughput, 2 stages over 2 processes (gloo), {BLOCKS} x Linear({WIDTH})+ReLU, "
          f"batch {batch} in 8 micro-batches; median per-step time over {rounds} rounds of "
          f"{steps} steps")
    print(f"{'method':<22} {'s/step':>8} {'speed vs ' + methods[0]:>24}")
    for name, t in medians.items():
        print(f"{name:<22} {t:>8.4f} {medians[methods[0]] / t:>23.3f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=["accuracy", "report", "throughput"],
                        default="accuracy")
    parser.add_argument("--optimizers", nargs="+", choices=list(LRS), default=list(LRS),
                        help="sgd, adamw: digits; gpt: the language model (AdamW)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=10, help="digits")
    parser.add_argument("--updates", type=int, default=600, help="GPT")
    parser.add_argument("--jobs", type=int, default=1, help="GPT: runs in parallel processes")
    parser.add_argument("--raw", type=Path, default=Path("docs/staleness.json"))
    parser.add_argument("--markdown", type=Path, default=Path("docs/staleness.md"))
    parser.add_argument("--png", type=Path, default=Path("docs/staleness.png"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--methods", nargs="+",
                        default=["predict", *(m for m in THROUGHPUT if m != "predict")],
                        choices=[*THROUGHPUT, *THROUGHPUT_NESTEROV],
                        help="throughput: the first is the baseline")
    args = parser.parse_args()
    if args.part == "accuracy":
        accuracy_part(args.optimizers, args.variants, args.seeds, args.epochs, args.updates,
                      args.raw, args.jobs)
    if args.part in ("accuracy", "report"):
        report(args.raw, args.markdown, args.png)
    if args.part == "throughput":
        throughput_part(args.rounds, args.steps, args.batch, args.methods)


if __name__ == "__main__":
    main()
