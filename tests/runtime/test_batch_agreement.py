"""Ranks given different mini-batches are refused on the first step (and the first after a
resume), on every rank, naming what differs (real gloo processes: the check gathers across
them); check_batches=False turns it off."""

from __future__ import annotations

import torch
from torch import nn

import pipetrain
from pipetrain.runtime import batch_agreement
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd


def _pipe(**options) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(mlp(), [6, 6], chunks=2, loss_fn=nn.functional.cross_entropy,
                              optimizer=sgd, timeout=60, **options)


def _refusal(step) -> str | None:
    try:
        step()
    except ValueError as error:
        return str(error)
    return None


def _scenarios(rank: int, world: int, folder: str) -> dict[str, str | None]:
    own = batches(3, seed=10 + rank)  # a data order seeded per rank: the bug
    shared = batches(3)
    x, y = shared[0]
    found = {}
    found["shuffled per rank"] = _refusal(lambda: _pipe().train_step(*own[0]))
    found["first x, last y of other sizes"] = _refusal(
        lambda: _pipe().train_step(x if rank == 0 else None, y[:12] if rank == 1 else None)
    )
    found["the same batch"] = _refusal(lambda: _pipe().train_step(x, y))
    found["switched off"] = _refusal(lambda: _pipe(check_batches=False).train_step(*own[0]))
    pipe = _pipe()
    pipe.train_step(x, y)
    found["second step, not checked"] = _refusal(lambda: pipe.train_step(*own[1]))
    pipe.save(folder)
    pipe.load(folder)
    found["first step after a resume"] = _refusal(lambda: pipe.train_step(*own[2]))
    return found


def test_ranks_given_different_batches_are_refused_on_every_rank(tmp_path):
    ranks = values(run_ranks(_scenarios, 2, str(tmp_path), deadline=180))
    assert ranks[0] == ranks[1]  # every rank raised the same error: none waits for another
    found = ranks[0]
    assert "the targets (y) of rank 0 and rank 1 differ" in found["shuffled per rank"]
    assert "seed the data order (shuffle, sampler) the same on every rank" in (
        found["shuffled per rank"]
    )
    assert "check_batches=False" in found["shuffled per rank"]
    assert "their batch sizes differ (rank 0 x 24, rank 1 y 12)" in (
        found["first x, last y of other sizes"]
    )
    assert found["the same batch"] is None and found["switched off"] is None
    assert found["second step, not checked"] is None
    assert "differ" in found["first step after a resume"]


def test_a_fingerprint_tells_batches_apart_on_any_dtype():
    x = torch.randn(64, 3, 8)
    assert batch_agreement.fingerprint(x) == batch_agreement.fingerprint(x.clone())
    assert batch_agreement.fingerprint(x) != batch_agreement.fingerprint(x[torch.randperm(64)])
    labels = torch.randint(0, 10, (64,))
    assert batch_agreement.fingerprint(labels) != batch_agreement.fingerprint(labels.flip(0))
    halves = (x.bfloat16(), labels > 4)
    assert batch_agreement.fingerprint(halves) == batch_agreement.fingerprint(
        tuple(t.clone() for t in halves)
    )
    assert batch_agreement.summarize("not a batch", None) == {
        "error": "AttributeError: 'str' object has no attribute 'shape'"
    }
