"""A check that the ranks of a pipeline train on one mini-batch.

The first stage reads a step's inputs on its rank and the last stage the targets on its own;
ranks that draw different batches (a data order shuffled with a per-rank seed) would train on
one batch's inputs against another's targets, silently. On the first step (and the first after
a resume) every rank summarizes what it was given, and the ranks compare the summaries: the
batch size of every ``x`` and ``y`` given, and a fingerprint of each (shapes, dtypes and up to
``SAMPLED`` elements spread evenly over each tensor, hashed). What the fingerprint compares
needs a rank that holds both: a rank given only ``x`` (the first) and a rank given only ``y``
(the last) can be compared by batch size alone. Every rank raises the same error, so none waits
for a peer that stopped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from pipetrain.runtime.microbatch import Batch

SAMPLED = 4096  # elements of each tensor a fingerprint reads: one small copy to the host
WHAT = {"x": "inputs (x)", "y": "targets (y)"}


def _tensors(value: Batch) -> tuple[torch.Tensor, ...]:
    return tuple(value) if isinstance(value, tuple | list) else (value,)


def fingerprint(value: Batch) -> str:
    """A hash of ``value``'s shapes, dtypes and evenly spaced elements: equal for equal
    batches on any device, unequal for a batch drawn in another order (almost surely)."""
    digest = hashlib.sha1()
    for tensor in _tensors(value):
        flat = tensor.detach().reshape(-1)
        count = min(flat.numel(), SAMPLED)
        where = torch.linspace(0, max(flat.numel() - 1, 0), count).long().to(flat.device)
        sample = flat[where].cpu().contiguous()
        digest.update(f"{tuple(tensor.shape)} {tensor.dtype};".encode())
        digest.update(sample.view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def summarize(x: Batch | None, y: Batch | None) -> dict[str, Any]:
    """What this rank was given: per side, None or (batch size, fingerprint); or the reason
    it is not a batch (compared too, so that every rank stops, not only this one)."""
    summary: dict[str, Any] = {}
    try:
        for side, value in (("x", x), ("y", y)):
            summary[side] = None if value is None else (
                int(_tensors(value)[0].shape[0]), fingerprint(value)
            )
    except Exception as error:  # not a batch: microbatch.check_batches says how, on this rank
        return {"error": f"{type(error).__name__}: {error}"}
    if summary["x"] is not None and summary["y"] is not None and (
        summary["x"][0] != summary["y"][0]
    ):  # this rank's own x and y disagree: check_batches names the sizes, on this rank
        return {"error": f"x has batch size {summary['x'][0]} but y has {summary['y'][0]}"}
    return summary


def check(summaries: Sequence[dict[str, Any]], mine: int) -> None:
    """Raise ValueError, the same on every rank, unless the pipeline ranks' summaries (in rank
    order; this rank's at ``mine``) describe one mini-batch."""
    ranks = range(len(summaries))
    failed = [(r, s["error"]) for r, s in zip(ranks, summaries, strict=True) if "error" in s]
    if failed and "error" not in summaries[mine]:
        rank, error = failed[0]
        raise ValueError(f"rank {rank} was not given a batch ({error}); every rank stops")
    if failed:
        return  # this rank's own batch is wrong: check_batches raises its own error
    given = [
        (rank, side, summary[side]) for rank, summary in zip(ranks, summaries, strict=True)
        for side in ("x", "y") if summary[side] is not None
    ]
    sizes = {size for _, _, (size, _) in given}
    if len(sizes) > 1:
        listed = ", ".join(f"rank {r} {side} {size}" for r, side, (size, _) in given)
        _refuse(f"their batch sizes differ ({listed})")
    differ = []
    for side in ("y", "x"):
        prints = [(rank, fp) for rank, s, (_, fp) in given if s == side]
        other = next(((rank, fp) for rank, fp in prints if fp != prints[0][1]), None)
        if other is not None:
            differ.append(f"the {WHAT[side]} of rank {prints[0][0]} and rank {other[0]} differ "
                          f"(fingerprints {prints[0][1]} and {other[1]})")
    if differ:
        _refuse("; ".join(differ))


def _refuse(what: str) -> None:
    raise ValueError(
        f"the ranks of the pipeline were given different mini-batches: {what}. The first stage "
        "would train on one batch's inputs against another's targets. Give every rank of a "
        "pipeline the same batch each step: seed the data order (shuffle, sampler) the same on "
        "every rank, e.g. from the step or a shared seed, never from the rank (replicas split "
        "by their replica number, not the rank); Pipeline(check_batches=False) turns this "
        "check off"
    )
