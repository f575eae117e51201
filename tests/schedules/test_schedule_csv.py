"""Action lists as CSV in torch's format: every registered synchronous schedule round-trips in
both forms, torch's own lists load, and a list that cannot run is refused with its rank and
action."""

from __future__ import annotations

from dataclasses import replace

import pytest

from schedules import ScheduleError, build, from_csv, lookup, names, to_csv

SYNCHRONOUS = names(asynchronous=False)


def _built(name: str):
    spec = lookup(name)
    if not spec.multi_stage_per_rank:
        return build(name, 4, 6)
    return build(name, 4, 6, ranks=2)


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_every_schedule_round_trips_in_both_forms(name):
    schedule = _built(name)
    listed = from_csv(to_csv(schedule, communication=True), name)
    # communication written out: the very lists, overlapped pairs written apart
    assert listed == replace(schedule, overlaps=frozenset())
    computed = from_csv(to_csv(schedule), name)  # compute only: messages placed anew
    assert computed.placement == schedule.placement
    assert computed.overlaps == schedule.overlaps
    for rank in range(schedule.ranks):
        assert computed.compute(rank) == schedule.compute(rank)


def test_torch_cells_read_as_torch_writes_them():
    text = "0F0,0F1,0I0,,0W0,0UNSHARD,0I1,0W1\n1F0,1I0,1W0,1F1,1I1,1W1\n"
    schedule = from_csv(text, "mine")
    assert schedule.name == "mine" and schedule.stages == 2 and schedule.microbatches == 2
    assert schedule.splits_backward
    assert to_csv(schedule).splitlines()[1] == "1F0,1I0,1W0,1F1,1I1,1W1"


@pytest.mark.parametrize("text, reason", [
    ("0F0,0B0\n1B0,1F0\n", "cannot run: .*stuck at 0:B0, 1:B0"),
    ("0F0,0F1,0B0\n1F0,1B0,1F1,1B1\n", r"never does .*micro-batch 1"),
    ("0F0,0B0\n0F0\n", "stage 0 is computed on rank 0 and on rank 1"),
    ("0F0,0X0\n", r"rank 0, cell 1: '0X0' is no action"),
    ("0F0,0B0,0W0\n", "lists 0:W0 twice"),  # a whole backward of a split list has its W
    ("0F0,1F0,(1B0;0F1)OVERLAP_F_B,1F1,0B0,1B1,0B1\n", "a pair is a forward, then a backward"),
    ("0F0,(0F1)OVERLAP_F_B\n", r"overlaps no two actions"),
    ("0F0,0SEND_F0,0RECV_B0,0B0\n1F0,1RECV_F0,1B0,1SEND_B0\n", "stage 1 does 1:F0 before 1:RECV"),
    ("0F0,0RECV_B0,0SEND_F0,0B0\n1RECV_F0,1F0,1B0,1SEND_B0\n",
     r"deadlocks: stage 0 waits at 0:RECV_GRAD0 \(position 1\)"),
    ("", "lists no action"),
])
def test_a_list_that_cannot_run_is_refused_with_the_reason(text, reason):
    with pytest.raises(ScheduleError, match=reason):
        from_csv(text)
