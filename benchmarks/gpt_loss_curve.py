"""The GPT example's held-out loss during training: the pipelined run (torchrun, 2 ranks, 1F1B)
over the single-process one, same seed, fp32, every other setting the example's default.

Runs examples/train_gpt.py twice with ``--eval-every`` (both at once: the curves do not depend
on timing), reads the held-out losses they print, and writes the curve as a picture, as JSON
lines and as a Markdown table:

    python benchmarks/gpt_loss_curve.py          # -> docs/gpt-val-loss.{png,jsonl,md}
    python benchmarks/gpt_loss_curve.py --steps 100 --eval-every 10 --out /tmp/curve
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from ranks import free_port

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
EVAL = re.compile(r"^step +(\d+) +validation loss (\d+\.\d+)", re.MULTILINE)
FINAL = re.compile(r"^validation loss (\d+\.\d+)", re.MULTILINE)


def start(command: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(command, cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


def curve(log: str, steps: int) -> list[tuple[int, float]]:
    final = FINAL.search(log)
    if final is None:
        raise RuntimeError(f"no validation loss in the run's output:\n{log[-3000:]}")
    points = [(int(step), float(loss)) for step, loss in EVAL.findall(log)]
    return points + [(steps, float(final.group(1)))]


def draw(path: Path, runs: dict[str, list[tuple[int, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4))
    for (label, points), style in zip(runs.items(), ("-", "--"), strict=False):
        axes.plot(*zip(*points, strict=True), style, marker=".", label=label)
    axes.set_xlabel("training step")
    axes.set_ylabel("held-out loss (nats per byte)")
    axes.set_title("examples/train_gpt.py, fp32, seed 0: pipelined vs one process")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--out", default=str(ROOT / "docs" / "gpt-val-loss"),
                        help="path stem of the .png, .jsonl and .md written")
    args = parser.parse_args()
    common = ["--steps", str(args.steps), "--eval-every", str(args.eval_every),
              "--precision", "fp32", "--seed", "0", "--no-sample"]
    with tempfile.TemporaryDirectory() as folder:
        pipelined = start([
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPT),
            *common, "--checkpoint-dir", f"{folder}/pipe",
        ])
        single = start([sys.executable, str(SCRIPT), *common, "--single-process",
                        "--checkpoint-dir", f"{folder}/single"])
        logs = {}
        for label, process in (("pipelined, 2 stages (1F1B)", pipelined),
                               ("single process", single)):
            output, _ = process.communicate(timeout=3600)
            if process.returncode:
                raise RuntimeError(f"{label} failed ({process.returncode}):\n{output[-3000:]}")
            logs[label] = output
    runs = {label: curve(log, args.steps) for label, log in logs.items()}
    (ours, theirs) = runs.values()
    if [s for s, _ in ours] != [s for s, _ in theirs]:
        raise RuntimeError("the two runs evaluated at different steps")
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    draw(stem.with_suffix(".png"), runs)
    rows = [{"step": s, "pipelined": a, "single_process": b, "difference": a - b}
            for (s, a), (_, b) in zip(ours, theirs, strict=True)]
    stem.with_suffix(".jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = ["| step | pipelined | single process | difference |", "|---:|---:|---:|---:|"]
    table += [f"| {r['step']} | {r['pipelined']:.4f} | {r['single_process']:.4f} | "
              f"{r['difference']:+.4f} |" for r in rows]
    gap = max(abs(r["difference"]) for r in rows)
    summary = (f"Final held-out loss: pipelined {ours[-1][1]:.4f}, single process "
               f"{theirs[-1][1]:.4f}; largest gap over the curve {gap:.4f}.")
    stem.with_suffix(".md").write_text(
        "# Held-out loss of examples/train_gpt.py, pipelined vs one process\n\n"
        f"`python benchmarks/gpt_loss_curve.py --steps {args.steps} --eval-every "
        f"{args.eval_every}` (fp32, seed 0, the example's other defaults).\n\n"
        + "\n".join(table) + f"\n\n{summary}\n"
    )
    print("\n".join(table))
    print(summary)
    print(f"wrote {stem}.png, .jsonl and .md")


if __name__ == "__main__":
    main()
