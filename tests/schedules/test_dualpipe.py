"""DualPipeV: the lists torch's ScheduleDualPipeV computes, with its overlapped pairs; valid at
every size it takes; its step and activation memory when F = B = W."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedules import (
    Action,
    Kind,
    ScheduleError,
    build,
    dualpipev,
    from_csv,
    overlapped,
    simulate,
    validate,
)

SIZES = [(p, m) for p in range(1, 7) for m in range(2 * p, 4 * p + 3)]


@pytest.mark.parametrize("ranks, microbatches", SIZES)
def test_valid_at_every_size_it_takes(ranks, microbatches):
    schedule = dualpipev(ranks, microbatches)
    validate(schedule)
    assert schedule.splits_backward and schedule.overlaps
    assert schedule.placement == (*range(ranks), *reversed(range(ranks)))


def _torch_lists(ranks: int, microbatches: int) -> list[list]:
    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    if not hasattr(schedules, "ScheduleDualPipeV"):
        pytest.skip("this torch has no ScheduleDualPipeV to compare with")
    from types import SimpleNamespace

    # the per-rank lists torch computes, without building its stages
    state = SimpleNamespace(pp_group_size=ranks, _n_microbatches=microbatches)
    order = schedules.ScheduleDualPipeV._calculate_single_rank_operations
    return [[a for a in order(state, r) if a is not None] for r in range(ranks)]


@pytest.mark.parametrize("ranks, microbatches", [(1, 2), (2, 4), (2, 7), (3, 6), (4, 9),
                                                 (5, 12), (6, 12)])
def test_torch_lists_read_as_the_same_schedule(ranks, microbatches):
    """torch's own lists, written as torch writes its cells (its whole backwards "B" beside
    split ones, its OVERLAP_F_B pairs), read into the schedule pipetrain builds."""
    text = "".join(",".join(map(str, row)) + "\n" for row in _torch_lists(ranks, microbatches))
    assert "OVERLAP_F_B" in text or ranks == 1
    read = from_csv(text, "dualpipev")
    mine = dualpipev(ranks, microbatches)
    assert read.overlaps == mine.overlaps
    assert all(read.compute(r) == mine.compute(r) for r in range(ranks))


@pytest.mark.parametrize("ranks", range(1, 7))
def test_zero_bubble_step_with_one_more_microbatch_held_than_zbv(ranks):
    """With F = B = W and free messages the step is 6m + p - 1, ZB-V's least possible, for
    every m >= 2p tried; each rank holds 2p + 1 stage-micro-batches' activations (p + 1/2 of
    1F1B's first rank's whole-stage ones: a stage is half a 1F1B stage), ZB-V's 2p plus one."""
    for microbatches in (2 * ranks, 3 * ranks + 1, 4 * ranks):
        run = simulate(dualpipev(ranks, microbatches), 1.0, 1.0, weight=1.0)
        assert run.step_time == 6 * microbatches + ranks - 1
        assert run.peak_inflight == (2 * ranks + 1,) * ranks
        zbv = simulate(build("zbv", 2 * ranks, microbatches, ranks=ranks), 1.0, 1.0, weight=1.0)
        assert max(zbv.peak_inflight) == 2 * ranks


def test_too_few_microbatches_or_not_a_v_is_refused():
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        dualpipev(3, 5)
    with pytest.raises(ValueError, match="two stages per rank"):
        dualpipev(2, 8, chunks_per_rank=3)
    with pytest.raises(ValueError, match="at least as many micro-batches"):
        build("dualpipev", 4, 3, ranks=2)


def test_a_pair_that_is_not_one_is_refused():
    schedule = dualpipev(2, 4)
    forward, backward = sorted(schedule.overlaps, key=str)[0]
    apart = Action(Kind.FORWARD, forward.stage, forward.microbatch - 1)
    with pytest.raises(ValueError, match="computes something between them"):
        overlapped(schedule, [(apart, backward)])
    with pytest.raises(ValueError, match="a forward, then a backward"):
        overlapped(schedule, [(backward, forward)])
    other = Action(Kind.BACKWARD, 1, 0)  # rank 1's stage
    with pytest.raises(ScheduleError, match="two stages of one rank"):
        validate(replace(schedule, overlaps=frozenset({(forward, other)})))
