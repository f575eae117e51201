"""Looped BFS and interleaved ZB (stages 0 and 2 on rank 0, 1 and 3 on rank 1) and the V
schedules, ZB-V, V-Half, V-Min and DualPipeV (stages 0 and 3 on rank 0, 1 and 2 on rank 1), in
two gloo processes train like plain single-process training: 1e-5 on every parameter and loss,
as tests/property explains, with weights tied across the ranks, recomputation, AdamW, clipping
and micro-batch counts that are no multiple of the ranks. The V schedules also on three ranks
as threads, where V-Half and V-Min hold fewer micro-batches than ZB-V."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.property.model_space import CLIP, Case, ModelSpec, largest_difference, train_reference
from tests.property.test_equivalence import TOLERANCE, check_threads, train_in_processes

SHAPES = {
    "tied": Case(ModelSpec((), ("embedding", "affine", "affine", "head")), (1, 1, 1, 1), "",
                 2, 3, ("always", "never", "except_last", "never"), "adamw", CLIP, 2),
    "mlp": Case(ModelSpec((4,), ("linear", "relu_", "linear", "linear", "relu_", "linear")),
                (2, 1, 2, 1), "", 2, 4, ("never",) * 4, "sgd", None, 3),
    "one-micro-batch": Case(ModelSpec((4,), ("linear",) * 4), (1, 1, 1, 1), "", 2, 1,
                            ("except_last",) * 4, "sgd", CLIP, 2),
}
SIX = Case(ModelSpec((4,), ("linear",) * 6), (1,) * 6, "", 2, 6, ("except_last",) * 6, "sgd",
           CLIP, 1)  # three stages per rank, which ZB-V's V (two per rank) does not take
CASES = {
    f"{schedule}-{name}": replace(case, schedule=schedule)
    for schedule in ("looped-bfs", "interleaved-zb", "zbv", "v-half", "v-min")
    for name, case in SHAPES.items()
} | {f"{schedule}-six-stages": replace(SIX, schedule=schedule)
     for schedule in ("looped-bfs", "interleaved-zb")} | {
    # DualPipeV takes at least as many micro-batches as stages
    f"dualpipev-{name}": replace(case, schedule="dualpipev", chunks=chunks)
    for name, case, chunks in (("tied", SHAPES["tied"], 4), ("mlp", SHAPES["mlp"], 4),
                               ("six-micro-batches", SHAPES["tied"], 6))
}


@pytest.fixture(scope="module")
def per_case() -> dict[str, list[dict]]:
    per_rank = train_in_processes(list(CASES.values()))
    return {name: [rank[k] for rank in per_rank] for k, name in enumerate(CASES)}


@pytest.mark.parametrize("name", CASES)
def test_trains_like_one_process(per_case, name):
    results = per_case[name]
    assert all("error" not in r for r in results), [r.get("error") for r in results]
    worst, where = largest_difference(results, train_reference(CASES[name]))
    assert worst <= TOLERANCE, f"{where} differs from plain training by {worst:.3g}"


THREE_RANKS = Case(ModelSpec((4,), ("linear", "relu_") * 3), (1,) * 6, "", 3, 6,
                   ("never",) * 5 + ("except_last",), "adamw", CLIP, 2)


@pytest.mark.parametrize("schedule", ["zbv", "v-half", "v-min"])
def test_three_ranks_in_threads_train_like_one_process(schedule):
    check_threads(replace(THREE_RANKS, schedule=schedule))
