"""List-scheduled zero bubble: ZB-V (the V placement) and interleaved ZB (interleaved 1F1B's
placement), each complete and deadlock-free, its step against the least any schedule can take
and against the schedules it improves on, and its memory against 1F1B's."""

from __future__ import annotations

import pytest

from schedules import (
    Kind,
    build,
    interleaved,
    interleaved_zb,
    lookup,
    one_f_one_b,
    simulate,
    v_placement,
    validate,
    zbv,
    zero_bubble_h1,
)

SIZES = [(p, m) for p in range(1, 7) for m in range(1, 25)]


def test_v_placement_folds_the_stages_back_over_the_ranks():
    assert v_placement(1) == (0, 0)
    assert v_placement(3) == (0, 1, 2, 2, 1, 0)


@pytest.mark.parametrize("p, m", SIZES)
def test_lists_are_complete_deadlock_free_and_hold_what_1f1b_holds(p, m):
    schedule = zbv(p, m)
    validate(schedule)  # every F, B and W once, in dependency order, no deadlock
    assert schedule.placement == v_placement(p) and schedule.splits_backward
    for rank in range(p):
        kinds = [a.kind for a in schedule.compute(rank)]
        assert kinds.count(Kind.WEIGHT) == kinds.count(Kind.FORWARD) == 2 * m
    sim = simulate(schedule, 1.0, 1.0, weight=1.0)
    # micro-batch-stages held until their W; 1F1B on the same model cut into p stages holds
    # min(m, p) micro-batches of a stage twice as large on its first rank
    assert max(sim.peak_inflight) <= 2 * simulate(one_f_one_b(p, m), 2.0, 4.0).peak_inflight[0]


@pytest.mark.parametrize("p, m", [(p, m) for p, m in SIZES if m >= p])
def test_step_is_the_least_possible_or_nearly_when_f_b_w_are_equal(p, m):
    # each rank computes 2 stages x m x (f + b + w) = 6m; the last rank cannot start before
    # p - 1 forwards reach it, so no schedule takes less than 6m + p - 1
    step = simulate(zbv(p, m), 1.0, 1.0, weight=1.0).step_time
    least = 6 * m + p - 1
    if p <= 4:
        assert step == pytest.approx(least)
    else:
        assert least <= step <= least + 2  # list scheduling's greed costs a tick or two


@pytest.mark.parametrize("p, m", SIZES)
def test_never_slower_than_zb_h1_on_the_same_model(p, m):
    # the same model cut into p stages of twice the work, f = b = w = 2
    v = simulate(zbv(p, m), 1.0, 1.0, weight=1.0).step_time
    assert v <= simulate(zero_bubble_h1(p, m), 2.0, 2.0, weight=2.0).step_time


def test_registered_as_a_v_of_two_stages_per_rank():
    spec = lookup("zbv")
    assert spec.multi_stage_per_rank and spec.split_backward and spec.stages_per_rank == 2
    assert build("zbv", 6, 5, ranks=3) == zbv(3, 5)
    with pytest.raises(ValueError, match="puts 2 stages on each rank: with ranks=2 it needs "
                                         "stages=4, got 6"):
        build("zbv", 6, 4, ranks=2)
    with pytest.raises(ValueError, match="two stages per rank"):
        zbv(2, 4, 3)


INTERLEAVED_SIZES = [(p, v, m) for p in range(1, 6) for v in (1, 2, 3, 4) for m in range(1, 17)]


@pytest.mark.parametrize("p, v, m", INTERLEAVED_SIZES)
def test_interleaved_zb_is_complete_deadlock_free_and_holds_what_1f1b_holds(p, v, m):
    schedule = interleaved_zb(p, m, v)
    validate(schedule)
    assert schedule.placement == tuple(s % p for s in range(p * v)) and schedule.splits_backward
    sim = simulate(schedule, 1.0, 1.0, weight=1.0)
    # 1F1B on the same model cut into p stages: min(m, p) micro-batches of v stages' worth
    assert max(sim.peak_inflight) <= v * min(m, p)


@pytest.mark.parametrize("p, v, m", [s for s in INTERLEAVED_SIZES if s[2] % s[0] == 0])
def test_interleaved_zb_is_never_slower_than_interleaved_1f1b(p, v, m):
    # the same chunks; interleaved 1F1B runs each B and W as one backward of b + w
    split = simulate(interleaved_zb(p, m, v), 1.0, 1.0, weight=1.0).step_time
    assert split <= simulate(interleaved(p, m, v), 1.0, 2.0).step_time
    assert split >= 3 * v * m + p - 1  # the least any schedule can take


def test_interleaved_zb_is_registered_with_any_chunk_and_micro_batch_count():
    spec = lookup("interleaved-zb")
    assert spec.multi_stage_per_rank and spec.split_backward and spec.stages_per_rank is None
    assert build("interleaved-zb", 9, 5, ranks=3) == interleaved_zb(3, 5, 3)
    with pytest.raises(ValueError, match="at least one chunk"):
        interleaved_zb(2, 4, 0)
