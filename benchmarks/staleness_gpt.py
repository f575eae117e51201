"""The language-model task of the staleness study (benchmarks/staleness_study.py, issue 21).

The byte-level GPT of examples/train_gpt.py, smaller so that a grid of learning rates, seeds
and methods fits a 2-core machine: width 64, 4 blocks of 4 heads, context 64, its head untied
(the asynchronous schedules do not take weights tied across stages), over 4 stages
[embedding + block, block, block, block + head]. AdamW (betas 0.9 / 0.95, weight decay 0.1,
as train_gpt.py) with train_gpt.py's schedule (linear warm-up over a tenth of the updates,
cosine decay to a tenth of the peak lr), one update per micro-batch of 8 windows drawn
from the training text (seed 1000 + s); the held-out loss is the mean over the first
``EVAL_BATCHES`` batches of 64 consecutive held-out windows (the end of Acts).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

EXAMPLES = str(Path(__file__).resolve().parents[1] / "examples")
BALANCE = [2, 1, 1, 2]
CONTEXT, MICRO, EVAL_BATCHES = 64, 8, 8
UNIGRAM = 3.0  # nats: the held-out loss of byte frequencies alone; below it a model has learnt


def run_gpt(options: dict, lrs: list[float], seeds: int, updates: int) -> dict[str, list[float]]:
    """Held-out loss per (lr, seed) after ``updates`` updates, with DelayedPipeline
    ``options``."""
    import torch

    from pipetrain.delayed import DelayedPipeline

    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    import models
    import text
    from train_gpt import lr_factor

    train, held = text.load_corpus()
    evaluation = text.held_out_batches(held, 64, CONTEXT)[:EVAL_BATCHES]
    losses, pairs = [], [(lr, s) for lr in lrs for s in range(seeds)]
    for lr, seed in pairs:
        model = models.gpt(dim=64, blocks=4, heads=4, context=CONTEXT, seed=seed, tied=False)
        pipe = DelayedPipeline(
            model, BALANCE, loss_fn=models.lm_loss,
            optimizer=lambda ps, lr=lr: torch.optim.AdamW(ps, lr=lr, betas=(0.9, 0.95),
                                                          weight_decay=0.1),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(
                opt, lr_factor(updates, max(updates // 10, 1))),
            **{"schedule": "pipedream", **options},
        )
        batches = text.training_batches(train, MICRO, CONTEXT, seed=1000 + seed)
        for _ in range(updates):
            pipe.train_step(*next(batches))
        with torch.no_grad():
            loss = statistics.mean(
                float(models.lm_loss(pipe.eval_step(x), y)) for x, y in evaluation
            )
        losses.append(loss if loss == loss else float("inf"))  # NaN: diverged
    return {"loss": losses, "lrs": [lr for lr, _ in pairs]}
