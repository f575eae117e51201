"""Looped BFS: each rank's breadth-first order, its placement, and the bubble and memory the
simulator gives it, against the formulas of Lamy-Poirier (2023)."""

from __future__ import annotations

import pytest

from schedules import Kind, build, inflight, interleaved, lookup, looped_bfs, simulate, validate

SIZES = [(p, v, m) for p in (1, 2, 3, 4) for v in (1, 2, 3) for m in (1, 2, 3, 5, 8)]


def breadth_first(rank: int, p: int, v: int, m: int) -> list[tuple[Kind, int, int]]:
    """Independent statement of the order: chunk by chunk forward, then chunk by chunk back."""
    own = [rank + c * p for c in range(v)]
    return [(Kind.FORWARD, s, i) for s in own for i in range(m)] + [
        (Kind.BACKWARD, s, i) for s in own[::-1] for i in range(m)
    ]


@pytest.mark.parametrize("p, v, m", SIZES)
def test_each_rank_runs_its_stages_breadth_first_and_the_lists_validate(p, v, m):
    schedule = looped_bfs(p, m, v)
    validate(schedule)
    assert schedule.name == "looped-bfs" and schedule.stages == p * v
    assert schedule.placement == tuple(s % p for s in range(p * v))
    for rank in range(p):
        got = [(a.kind, a.stage, a.microbatch) for a in schedule.compute(rank)]
        assert got == breadth_first(rank, p, v, m)


@pytest.mark.parametrize("p, v, m", [s for s in SIZES if s[2] >= s[0]])
@pytest.mark.parametrize("f, b", [(1.0, 2.0), (0.5, 0.5)])
def test_bubble_equals_interleaveds_when_micro_batches_fill_the_ranks(p, v, m, f, b):
    # uniform chunks, free transfers, m >= p: every rank busy v m (f + b), idle (p-1)(f + b)
    sim = simulate(looped_bfs(p, m, v), f, b)
    assert sim.busy == pytest.approx([v * m * (f + b)] * p)
    assert sim.step_time == pytest.approx(v * m * (f + b) + (p - 1) * (f + b))
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    if m % p == 0 and v > 1:  # same per-chunk work, Megatron's sizes
        assert sim.bubble_fraction == pytest.approx(
            simulate(interleaved(p, m, v), f, b).bubble_fraction
        )


@pytest.mark.parametrize("p, v, m", SIZES)
def test_memory_is_every_micro_batch_of_every_local_stage(p, v, m):
    sim = simulate(looped_bfs(p, m, v), 1.0, 2.0)
    assert sim.peak_inflight == (m * v,) * p
    assert inflight(looped_bfs(p, m, v)) == (m,) * (p * v)


def test_registered_with_several_stages_per_rank_and_any_micro_batch_count():
    spec = lookup("looped-bfs")
    assert spec.multi_stage_per_rank and not spec.split_backward and not spec.asynchronous
    assert build("looped-bfs", 6, 5, ranks=3) == looped_bfs(3, 5, 2)  # 5 is no multiple of 3
    with pytest.raises(ValueError, match="positive multiple of ranks=4"):
        build("looped-bfs", 6, 4, ranks=4)
    with pytest.raises(ValueError, match="at least one chunk"):
        looped_bfs(2, 4, 0)
