"""V-Half and V-Min (schedules/v_shape.py) against the memory and bubble that Qi et al.,
"Pipeline Parallelism with Controllable Memory" (NeurIPS 2024, arXiv 2405.15362), state for
them, beside 1F1B and zbv, at p = 1..6 ranks and m = 1..3p micro-batches.

The claims, with F, B and W of one V stage each taking 1 (1F1B's stages are two V stages deep,
so its F, B and W take 2), from the paper's V-shape building blocks (its section 3) and its
authors' comparison table (README of sail-sg/zero-bubble-pipeline-parallelism and the
"Pipeline Parallelism with Controllable Memory" playground):

- peak activations per rank, in micro-batches of a 1F1B stage: 1F1B p, V-Half floor((p+2)/2),
  V-Min floor((p+4)/3); here counted in V stages, micro-batch-stages held from F to W
  (``simulate``'s ``peak_inflight``), twice those numbers;
- bubble: V-Half half of 1F1B's, V-Min two thirds. 1F1B idles (p-1)(F+B+W) = 6(p-1) per rank
  and step, a fraction (p-1)/(m+p-1) of it; so V-Half idles at most 3(p-1), a fraction at most
  (p-1)/(2m+p-1), and V-Min at most 4(p-1), a fraction at most 2(p-1)/(3m+2(p-1)), for m >= p
  (their blocks repeat from p micro-batches on).
"""

from __future__ import annotations

from functools import cache

import pytest

from schedules import (
    GENERATORS,
    Kind,
    Simulation,
    build,
    lookup,
    one_f_one_b,
    simulate,
    v_half,
    v_min,
    v_placement,
    validate,
)
from schedules.v_shape import _v_half_block, _v_min_block

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 3 * p + 1)]
SHAPES = {"v-half": (v_half, 2, 2), "v-min": (v_min, 4, 3)}  # (generator, a, b): peak rule


@cache
def _unit(name: str, p: int, m: int) -> Simulation:
    """The V schedule ``name`` (zbv, v-half or v-min) at unit F, B and W times."""
    return simulate(GENERATORS[name](p, m), 1.0, 1.0, weight=1.0)


@cache
def _one_f_one_b(p: int, m: int) -> Simulation:
    """1F1B on the same model cut into p stages: F, B and W of two V stages each."""
    return simulate(one_f_one_b(p, m), 2.0, 2.0, weight=2.0)


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("p, m", SIZES)
def test_lists_are_complete_deadlock_free_and_split_on_the_v(name, p, m):
    schedule = SHAPES[name][0](p, m)
    validate(schedule)  # every F, B and W once, in dependency order, no deadlock
    assert schedule.name == name and schedule.placement == v_placement(p)
    assert schedule.splits_backward
    for rank in range(p):
        kinds = [a.kind for a in schedule.compute(rank)]
        assert kinds.count(Kind.WEIGHT) == kinds.count(Kind.FORWARD) == 2 * m


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("p, m", SIZES)
def test_peak_memory_is_the_papers(name, p, m):
    _, offset, divisor = SHAPES[name]
    stated = 2 * ((p + offset) // divisor)  # micro-batch-stages: two per 1F1B micro-batch
    peak = max(_unit(name, p, m).peak_inflight)
    assert peak <= stated
    if m >= p:
        assert peak == stated


@pytest.mark.parametrize("p, m", SIZES)
def test_memory_is_below_zbv_and_1f1b(p, m):
    """zbv holds what 1F1B holds (2 min(m, p) micro-batch-stages); V-Min at most V-Half's, and
    both less from 3 ranks and p micro-batches on (with 2 ranks the rules give zbv's 4)."""
    half, least, v = (max(_unit(n, p, m).peak_inflight) for n in ("v-half", "v-min", "zbv"))
    assert v == 2 * max(_one_f_one_b(p, m).peak_inflight)
    assert least <= half <= v
    if p >= 3 and m >= p:
        assert half < v


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("p, m", SIZES)
def test_bubble_is_at_most_the_papers(name, p, m):
    share = {"v-half": 1 / 2, "v-min": 2 / 3}[name]
    sim = _unit(name, p, m)
    one = _one_f_one_b(p, m)
    assert one.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    idle = sim.step_time - 6 * m  # every rank computes 6m
    if m >= p:
        assert idle <= share * 6 * (p - 1)
        stated = share * 6 * (p - 1) / (6 * m + share * 6 * (p - 1))
        assert sim.bubble_fraction <= stated + 1e-12
    else:  # fewer micro-batches than ranks: the blocks never reach their rhythm
        assert sim.bubble_fraction <= one.bubble_fraction


@pytest.mark.parametrize("block", [_v_half_block, _v_min_block])
def test_repeated_blocks_never_collide(block):
    # micro-batch i's block lies 6 i slots after micro-batch 0's: a rank's four passes must
    # sit in distinct slots modulo 6, and each pass after the one it needs
    for p in range(1, 65):
        for r in range(p):
            down, up, back_up, back_down = block(p, r)
            assert len({down % 6, up % 6, back_up % 6, back_down % 6}) == 4, (p, r)
            assert down < up < back_up < back_down


@pytest.mark.parametrize("name", SHAPES)
def test_registered_as_a_v_of_two_stages_per_rank(name):
    spec = lookup(name)
    assert spec.multi_stage_per_rank and spec.split_backward and spec.stages_per_rank == 2
    assert build(name, 6, 5, ranks=3) == SHAPES[name][0](3, 5)
    with pytest.raises(ValueError, match="puts 2 stages on each rank"):
        build(name, 6, 4, ranks=2)
    with pytest.raises(ValueError, match=f"{name} folds the model into a V"):
        SHAPES[name][0](2, 4, 3)
