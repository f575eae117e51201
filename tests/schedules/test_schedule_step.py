"""The step as actions (REDUCE per stage, AGREE per rank, STEP per stage) and the early weight
pass (one W per stage, its last backward's): what the generators write, what the validator
accepts and refuses, and what the simulator makes of them."""

from __future__ import annotations

from dataclasses import replace

import pytest
from schedule_oracles import B, replace_stage

from schedules import (
    Action,
    Kind,
    ScheduleError,
    build,
    lookup,
    names,
    simulate,
    validate,
    with_early_weights,
)
from schedules.action import STEP_KINDS, step_tail

R, A, S, W = Kind.REDUCE, Kind.AGREE, Kind.STEP, Kind.WEIGHT
SYNCHRONOUS = [n for n in names() if not n.startswith("pipedream")]


def _build(name: str, stages: int = 4, microbatches: int = 4):
    ranks = 2 if lookup(name).multi_stage_per_rank else None
    return build(name, stages, microbatches, ranks=ranks)


def _steps_only(schedule):
    """``schedule`` as an older hand-written list has it: the STEPs alone close each list."""
    actions = {
        r: tuple(a for a in ops if a.kind not in (R, A)) for r, ops in schedule.actions.items()
    }
    return replace(schedule, actions=actions)


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_every_synchronous_list_ends_with_its_step(name):
    schedule = _build(name)
    for rank, ops in schedule.actions.items():
        own = schedule.stages_on(rank)
        tail = [Action(R, s) for s in own] + [Action(A, own[0])] + [Action(S, s) for s in own]
        assert list(ops[-len(tail):]) == tail == step_tail(own)
        assert not [a for a in ops[: -len(tail)] if a.kind in STEP_KINDS]


def test_asynchronous_lists_keep_their_steps_alone():
    for name in ("pipedream", "pipedream-2bw"):
        kinds = {a.kind for ops in build(name, 3, 4).actions.values() for a in ops}
        assert S in kinds and not kinds & {R, A}


@pytest.mark.parametrize("name", SYNCHRONOUS)
def test_an_older_list_closed_by_its_steps_alone_still_validates_and_times_the_same(name):
    schedule = _build(name)
    older = _steps_only(schedule)
    validate(older)
    w = 0.5 if schedule.splits_backward else None
    now, before = (simulate(s, 1.0, 2.0, 0.1, 0.3, weight=w, overhead=0.05)
                   for s in (schedule, older))
    assert now.step_time == before.step_time and now.finish == before.finish
    assert now.busy == before.busy and now.peak_inflight == before.peak_inflight


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda ops: [*ops[:-3], ops[-2], ops[-3], ops[-1]], "AGREE before REDUCE"),
        (lambda ops: [*ops[:-3], ops[-3], ops[-1], ops[-2]], "STEP before AGREE"),
        (lambda ops: [*ops[:-3], ops[-2], ops[-1]], "no REDUCE"),
        (lambda ops: [*ops[:-3], ops[-3], ops[-1]], "no AGREE"),
        (lambda ops: [*ops[:-3], ops[-3], ops[-2]], "no STEP"),
        (lambda ops: [ops[-3], *ops[:-3], ops[-2], ops[-1]], "REDUCE first"),
        (lambda ops: [*ops[:-3], ops[-3], ops[-3], ops[-2], ops[-1]], "two REDUCEs"),
        (lambda ops: [*ops[:-4], ops[-3], ops[-2], ops[-4], ops[-1]], "work after AGREE"),
    ],
)
def test_a_step_out_of_order_is_refused(edit, why):
    base = build("1f1b", 3, 2)
    bad = replace_stage(base, 1, edit(list(base.actions[1])))
    with pytest.raises(ScheduleError, match="stage 1 must end with exactly one STEP, after its "
                                            "step's 1:REDUCE, 1:AGREE"):
        validate(bad)


def test_a_rank_agrees_once_named_by_its_lowest_stage():
    base = _build("interleaved")
    ops = list(base.actions[1])  # stages 1 and 3
    assert ops[-5:] == [Action(R, 1), Action(R, 3), Action(A, 1), Action(S, 1), Action(S, 3)]
    for bad in (
        [*ops[:-5], Action(R, 1), Action(R, 3), Action(A, 3), Action(S, 1), Action(S, 3)],
        [*ops[:-5], Action(R, 3), Action(R, 1), Action(A, 1), Action(S, 1), Action(S, 3)],
        [*ops[:-5], Action(R, 1), Action(A, 1), Action(R, 3), Action(S, 1), Action(S, 3)],
    ):
        with pytest.raises(ScheduleError, match=r"rank 1 must end with one STEP for each of its "
                                                r"stages \[1, 3\] in that order"):
            validate(replace_stage(base, 1, bad))


def test_reduce_and_agree_take_their_costs_and_default_to_none():
    one = build("gpipe", 1, 2)  # F0 F1 B0 B1 REDUCE AGREE STEP on one rank
    assert simulate(one, 1.0, 2.0, optimizer_step=0.5).step_time == 6.5
    timed = simulate(one, 1.0, 2.0, optimizer_step=0.5, reduce=0.25, agree=0.125, overhead=0.5)
    # overhead after each of the 5 actions that take it (computes and STEP), none after
    # REDUCE and AGREE, which take their own costs
    assert timed.step_time == 6.5 + 5 * 0.5 + 0.25 + 0.125
    spans = {s.action.kind: s for s in timed.timeline if s.action.kind in STEP_KINDS}
    assert spans[R].duration == 0.25 and spans[A].duration == 0.125
    assert spans[R].end <= spans[A].start and spans[A].end <= spans[S].start
    assert timed.busy == (6.0,), "the step's actions are no compute"
    drawn = simulate(one, 1.0, 2.0, durations={Action(A, 0): 1.0})
    assert drawn.step_time == 7.0


def test_reduce_costs_are_per_stage():
    schedule = build("1f1b", 2, 2)
    plain = simulate(schedule, 1.0, 1.0)
    timed = simulate(schedule, 1.0, 1.0, reduce=[0.5, 2.0])
    assert timed.finish == (plain.finish[0] + 0.5, plain.finish[1] + 2.0)


# -- the early weight pass ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved"])
def test_early_weights_follow_the_last_backwards_send(name):
    base = _build(name)
    chosen = [s for s in range(1, base.stages) if not base.local(s, s - 1)]
    early = with_early_weights(base, chosen)
    validate(early)
    assert not early.splits_backward and not base.splits_backward
    last = {s: [a for a in base.actions[base.rank_of(s)] if a.kind is B and a.stage == s][-1]
            for s in chosen}
    assert early.early_weights == {s: b.microbatch for s, b in last.items()}
    for s, b in last.items():
        ops = list(early.actions[early.rank_of(s)])
        send = Action(Kind.SEND_GRAD, s, b.microbatch)
        assert ops[ops.index(send) + 1] == Action(W, s, b.microbatch)
        assert [a for a in ops if a.kind is not W] == list(base.actions[base.rank_of(s)])


def test_an_early_weight_pass_takes_the_weight_half_off_the_drain():
    # 2 stages, 1 micro-batch, F=1, B=2, W=1: stage 1's B sends after 2 (not 3), stage 0's
    # B runs 4..7, stage 1's W 4..5; the step ends at 7 instead of 8
    base = build("gpipe", 2, 1)
    early = with_early_weights(base, [1])
    assert simulate(base, 1.0, 2.0, weight=1.0).step_time == 8.0
    run = simulate(early, 1.0, 2.0, weight=1.0)
    assert run.step_time == 7.0
    spans = {s.action: s for s in run.timeline}
    assert (spans[Action(B, 1, 0)].start, spans[Action(B, 1, 0)].end) == (2.0, 4.0)
    assert (spans[Action(W, 1, 0)].start, spans[Action(W, 1, 0)].end) == (4.0, 5.0)
    assert run.busy == (4.0, 4.0)  # the same work: F + B + W on each stage
    assert simulate(early, 1.0, 2.0).step_time == simulate(base, 1.0, 2.0).step_time


def test_a_weight_pass_other_than_the_last_backwards_makes_every_w_required():
    base = build("1f1b", 2, 3)
    ops = list(base.actions[1])
    ops.insert(ops.index(Action(B, 1, 0)) + 1, Action(W, 1, 0))  # not the last backward's
    with pytest.raises(ScheduleError, match="never does 0:W0"):
        validate(replace_stage(base, 1, ops))
    early = list(with_early_weights(base, [1]).actions[1])
    twice = [*early[:-3], Action(W, 1, 0), *early[-3:]]
    with pytest.raises(ScheduleError, match="never does 0:W0"):
        validate(replace_stage(base, 1, twice))
    before = [a for a in early if a.kind is not W]
    before.insert(before.index(Action(B, 1, 2)), Action(W, 1, 2))
    with pytest.raises(ScheduleError, match="does 1:W2 before 1:B2"):
        validate(replace_stage(base, 1, before))


def test_early_weights_are_refused_where_the_schedule_places_w_or_never_flushes():
    for name in ("zb-h1", "pipedream"):
        with pytest.raises(ValueError, match="cannot take early weight passes"):
            with_early_weights(build(name, 3, 4), [1])


def test_the_first_stage_or_a_local_neighbour_takes_its_w_after_its_b():
    base = build("gpipe", 2, 2)
    early = with_early_weights(base, [0])  # no SEND_GRAD on the first stage
    ops = list(early.actions[0])
    assert ops[ops.index(Action(B, 0, 1)) + 1] == Action(W, 0, 1)
    validate(early)
