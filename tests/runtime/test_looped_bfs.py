"""Looped BFS in two gloo processes (stages 0 and 2 on rank 0, 1 and 3 on rank 1) trains like
plain single-process training: 1e-5 on every parameter and loss, as tests/property explains,
with weights tied across the ranks, recomputation, AdamW, clipping and a micro-batch count
that is no multiple of the ranks (3)."""

from __future__ import annotations

import pytest

from tests.property.model_space import CLIP, Case, ModelSpec, largest_difference, train_reference
from tests.property.test_equivalence import TOLERANCE, train_in_processes

CASES = [
    Case(ModelSpec((), ("embedding", "affine", "affine", "head")), (1, 1, 1, 1), "looped-bfs",
         2, 3, ("always", "never", "except_last", "never"), "adamw", CLIP, 2),
    Case(ModelSpec((4,), ("linear", "relu_", "linear", "linear", "relu_", "linear")),
         (2, 1, 2, 1), "looped-bfs", 2, 4, ("never",) * 4, "sgd", None, 3),
    Case(ModelSpec((4,), ("linear",) * 6), (1, 1, 1, 1, 1, 1), "looped-bfs", 2, 6,
         ("except_last",) * 6, "sgd", CLIP, 1),
]


@pytest.fixture(scope="module")
def per_case() -> list[list[dict]]:
    per_rank = train_in_processes(CASES)
    return [[rank[k] for rank in per_rank] for k in range(len(CASES))]


@pytest.mark.parametrize("k", range(len(CASES)), ids=["tied", "mlp", "six-stages"])
def test_looped_bfs_trains_like_one_process(per_case, k):
    results = per_case[k]
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    worst, where = largest_difference(results, train_reference(CASES[k]))
    assert worst <= TOLERANCE, f"{where} differs from plain training by {worst:.3g}"
