"""GPipe and 1F1B generators: complete, deadlock-free, and in the documented compute order."""

from __future__ import annotations

import pytest
from schedule_oracles import COMM, B, F, memory_bounded_order, rendezvous_stuck

from schedules import GENERATORS, Action, Kind, build, gpipe, one_f_one_b, validate

NAMES = ["gpipe", "1f1b"]
STAGES = range(1, 9)
MICROBATCHES = range(1, 17)


def compute_tokens(schedule, stage):
    return [(a.kind, a.microbatch) for a in schedule.compute(stage)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", STAGES)
def test_every_generated_schedule_validates(name, p):
    for m in MICROBATCHES:
        schedule = build(name, p, m)
        validate(schedule)
        assert (schedule.name, schedule.stages, schedule.microbatches) == (name, p, m)
        assert sorted(schedule.actions) == list(range(p))
        for s, ops in schedule.actions.items():
            assert all(a.stage == s for a in ops)
            assert ops[-1] == Action(Kind.STEP, s)
            # each stage forwards and backwards every micro-batch exactly once
            assert sorted(a.microbatch for a in ops if a.kind is F) == list(range(m))
            assert sorted(a.microbatch for a in ops if a.kind is B) == list(range(m))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p, m", [(p, m) for p in range(1, 5) for m in range(1, 5)])
def test_generated_schedules_finish_under_exhaustive_rendezvous(name, p, m):
    assert rendezvous_stuck(build(name, p, m)) == {}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", STAGES)
def test_both_ends_of_each_link_list_messages_in_the_same_order(name, p):
    for m in MICROBATCHES:
        schedule = build(name, p, m)
        for s in range(p - 1):
            upper = [
                ("act" if a.kind is Kind.SEND_ACT else "grad", a.microbatch)
                for a in schedule.actions[s]
                if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD)
            ]
            lower = [
                ("act" if a.kind is Kind.RECV_ACT else "grad", a.microbatch)
                for a in schedule.actions[s + 1]
                if a.kind in (Kind.RECV_ACT, Kind.SEND_GRAD)
            ]
            assert upper == lower, (name, p, m, s)
            assert len(upper) == 2 * m


def test_single_stage_has_no_communication():
    for name in NAMES:
        for m in MICROBATCHES:
            assert not [a for a in build(name, 1, m).actions[0] if a.kind in COMM]


@pytest.mark.parametrize("p", STAGES)
def test_gpipe_compute_order_is_all_forwards_then_all_backwards(p):
    for m in MICROBATCHES:
        schedule = gpipe(p, m)
        expected = [(F, i) for i in range(m)] + [(B, i) for i in range(m)]
        for s in range(p):
            assert compute_tokens(schedule, s) == expected


@pytest.mark.parametrize("p", STAGES)
def test_1f1b_compute_order_keeps_at_most_p_minus_s_in_flight(p):
    for m in MICROBATCHES:
        schedule = one_f_one_b(p, m)
        for s in range(p):
            assert compute_tokens(schedule, s) == memory_bounded_order(p - s, m), (p, m, s)


@pytest.mark.parametrize("p", STAGES)
def test_1f1b_warmup_then_alternation_then_drain(p):
    for m in MICROBATCHES:
        schedule = one_f_one_b(p, m)
        for s in range(p):
            w = min(p - 1 - s, m)
            kinds = [k for k, _ in compute_tokens(schedule, s)]
            # warm-up: w forwards; steady: (F, B) pairs; drain: w backwards
            assert kinds[:w] == [F] * w
            assert kinds[w : 2 * m - w] == [F, B] * (m - w)
            assert kinds[2 * m - w :] == [B] * w
            first_backward = kinds.index(B)
            assert first_backward == min(p - s, m)
            # the micro-batch order is ascending for forwards and for backwards
            toks = compute_tokens(schedule, s)
            assert [i for k, i in toks if k is F] == list(range(m))
            assert [i for k, i in toks if k is B] == list(range(m))


def test_1f1b_matches_gpipe_exactly_where_it_may_hold_every_micro_batch():
    # stage s of 1F1B holds up to p-s micro-batches: with m <= p-s it never has to interleave
    for p in STAGES:
        for m in range(1, 10):
            for s in range(p):
                same = compute_tokens(one_f_one_b(p, m), s) == compute_tokens(gpipe(p, m), s)
                assert same == (m <= p - s), (p, m, s)


@pytest.mark.parametrize("name", NAMES)
def test_build_dispatches_to_the_named_generator(name):
    direct = {"gpipe": gpipe, "1f1b": one_f_one_b}[name]
    assert GENERATORS[name] is direct
    for p, m in [(1, 1), (3, 2), (4, 7)]:
        assert build(name, p, m) == direct(p, m)


@pytest.mark.parametrize("bad", ["GPipe", "PipeDream", "", "1F1B", "Interleaved", "zb-v"])
def test_unknown_schedule_name_lists_the_choices(bad):
    with pytest.raises(ValueError) as info:
        build(bad, 2, 2)
    message = str(info.value)
    assert repr(bad) in message
    for name in NAMES:
        assert name in message


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "p, m, word",
    [
        (0, 4, "stage"),
        (-1, 4, "stage"),
        (4, 0, "micro-batch"),
        (4, -2, "micro-batch"),
        (0, 0, "stage"),
    ],
)
def test_nonpositive_sizes_are_rejected(name, p, m, word):
    with pytest.raises(ValueError, match=word):
        build(name, p, m)
    with pytest.raises(ValueError, match=word):
        GENERATORS[name](p, m)
