"""The bridge from a plan file to a Pipeline: the model's layer signature and plan checking."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from torch import nn

from partitioner import Plan
from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.runtime.microbatch import Batch, batch_size


def layer_signature(model: nn.Sequential | LayerTree) -> tuple[list[str], list[int]]:
    """Per layer, its name ("name:Class", e.g. "3:Linear") and parameter count: what a profile
    records and a plan is checked against; a layer used at several positions is counted at
    each, as the model runs it."""
    model = layer_tree(model, "layer_signature")
    names = [f"{name}:{type(layer).__name__}" for name, layer in model.positions()]
    counts = [sum(p.numel() for p in layer.parameters()) for layer in model]
    return names, counts


def load_plan(plan: str | os.PathLike[str] | Plan, model: nn.Sequential | LayerTree) -> Plan:
    """The plan (read from JSON if a path), refused unless it was made for ``model`` and runs
    each stage on one rank per copy of the pipeline (its ``data_parallel`` copies run)."""
    if not isinstance(plan, Plan):
        plan = Plan.load(Path(plan))
    plan.check_model(*layer_signature(model))
    if any(len(plan.ranks(s)) != 1 for s in range(plan.stages)):
        raise ValueError(
            "this plan replicates single stages in data parallel, which Pipeline does not run "
            "yet; plan copies of the whole pipeline instead (`pipetrain plan PROFILE --devices N "
            "--batch-size B`, its data_parallel), or as many devices as stages (`pipetrain plan "
            "--stages N` without --devices)"
        )
    return plan


def warn_other_microbatch(planned: int, batch: Batch, chunks: int) -> None:
    """Warn when ``batch`` in ``chunks`` makes micro-batches of another size than the plan's
    ``planned``: the plan's balance, times and memory are those of its micro-batch size."""
    size = -(-batch_size(batch, "the batch") // chunks)
    if size != planned:
        warnings.warn(
            f"the plan was made for micro-batches of {planned} samples but this step's are "
            f"{size} ({chunks} of a mini-batch of {batch_size(batch, 'the batch')}): its split "
            f"and predictions may not hold; train with mini-batches of {planned * chunks}, or "
            f"profile one micro-batch of {size} samples and plan again",
            stacklevel=3,
        )
