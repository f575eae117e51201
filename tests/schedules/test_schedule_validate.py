"""The validator rejects incomplete, misordered and deadlocking schedules, and nothing else."""

from __future__ import annotations

import random

import pytest
from schedule_oracles import (
    RA,
    RG,
    SA,
    SG,
    B,
    F,
    partner,
    random_linear_extension,
    random_local_swaps,
    random_valid_schedule,
    rendezvous_stuck,
    replace_stage,
    respects_local_order,
    step,
)

from schedules import Action, Schedule, ScheduleError, build, validate
from schedules.validate import check_complete, check_deadlock_free


def moved(ops, action, before):
    """``ops`` with ``action`` taken out and put back just before ``before``."""
    out = [a for a in ops if a != action]
    out.insert(out.index(before), action)
    return out


# -- deadlock ---------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [2, 3, 6])
def test_crossed_sends_on_a_link_deadlock_and_the_message_names_both_ends(m):
    base = build("1f1b", 2, m)
    # stage 0 of 1F1B: F0 SEND_ACT0 F1 RECV_GRAD0 SEND_ACT1 B0 ...; put SEND_ACT1 first, while
    # stage 1 still does SEND_GRAD0 before RECV_ACT1
    ops0 = moved(base.actions[0], Action(SA, 0, 1), Action(RG, 0, 0))
    ops1 = list(base.actions[1])
    assert ops1.index(Action(SG, 1, 0)) < ops1.index(Action(RA, 1, 1))
    bad = replace_stage(base, 0, ops0)
    check_complete(bad)  # locally fine: only the cross-stage order is broken
    with pytest.raises(ScheduleError) as info:
        validate(bad)
    message = str(info.value)
    assert "deadlock" in message
    assert f"stage 0 waits at 0:SEND_ACT1 (position {ops0.index(Action(SA, 0, 1))})" in message
    assert f"stage 1 waits at 1:SEND_GRAD0 (position {ops1.index(Action(SG, 1, 0))})" in message
    assert rendezvous_stuck(bad) == {
        0: (ops0.index(Action(SA, 0, 1)), Action(SA, 0, 1)),
        1: (ops1.index(Action(SG, 1, 0)), Action(SG, 1, 0)),
    }


def test_deadlock_in_the_middle_of_a_deep_pipeline_names_only_the_stuck_stages():
    base = build("1f1b", 5, 8)
    # stage 2 (warm-up 2): swap its first RECV_GRAD with the SEND_ACT that follows it
    ops = list(base.actions[2])
    k = ops.index(Action(RG, 2, 0))
    assert ops[k + 1] == Action(SA, 2, 2)
    ops[k], ops[k + 1] = ops[k + 1], ops[k]
    bad = replace_stage(base, 2, ops)
    stuck = rendezvous_stuck(bad)
    assert 2 in stuck and 3 in stuck
    with pytest.raises(ScheduleError) as info:
        check_deadlock_free(bad)
    message = str(info.value)
    for s in range(5):
        if s in stuck:
            pos, action = stuck[s]
            assert f"stage {s} waits at {action} (position {pos})" in message
        else:
            assert f"stage {s} waits" not in message


def test_receive_that_no_one_sends_first_is_a_deadlock():
    # both stages start by receiving: stage 1 waits for an activation that stage 0 only sends
    # after it has received a gradient
    ops0 = [Action(F, 0, 0), Action(RG, 0, 0), Action(SA, 0, 0), Action(B, 0, 0), step(0)]
    ops1 = [Action(RA, 1, 0), Action(F, 1, 0), Action(B, 1, 0), Action(SG, 1, 0), step(1)]
    bad = Schedule("x", 2, 1, {0: tuple(ops0), 1: tuple(ops1)})
    with pytest.raises(ScheduleError, match="stage 0 waits at 0:RECV_GRAD0"):
        validate(bad)


# -- completeness -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("skipped", [0, 2, 4])
def test_skipped_micro_batch_is_named(name, skipped):
    base = build(name, 3, 5)
    actions = {
        s: tuple(a for a in ops if a.microbatch != skipped) for s, ops in base.actions.items()
    }
    bad = Schedule(name, 3, 5, actions)
    with pytest.raises(ScheduleError, match=f"micro-batch {skipped} is skipped"):
        validate(bad)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedule_for_fewer_micro_batches_than_declared_is_incomplete(name):
    base = build(name, 4, 3)
    bad = Schedule(name, 4, 4, base.actions)
    with pytest.raises(ScheduleError, match="micro-batch 3 is skipped"):
        validate(bad)


def test_one_missing_action_on_one_stage_is_named():
    base = build("gpipe", 3, 3)
    gone = Action(SG, 2, 1)
    bad = replace_stage(base, 2, [a for a in base.actions[2] if a != gone])
    with pytest.raises(ScheduleError, match=f"stage 2 never does {gone}"):
        validate(bad)


LOCAL_RULES = [(RA, F), (F, SA), (F, B), (RG, B), (B, SG)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("first, then", LOCAL_RULES)
def test_each_local_ordering_rule_is_enforced_on_every_stage(name, first, then):
    p, m = 3, 4
    base = build(name, p, m)
    checked = 0
    for s in range(p):
        for i in range(m):
            x, y = Action(first, s, i), Action(then, s, i)
            if x not in base.actions[s] or y not in base.actions[s]:
                continue
            bad = replace_stage(base, s, moved(base.actions[s], y, before=x))
            with pytest.raises(ScheduleError) as info:
                check_complete(bad)
            assert str(info.value) == f"stage {s} does {y} before {x}"
            checked += 1
    assert checked >= m * (p - 1)


def test_forward_after_its_send():
    base = build("1f1b", 2, 2)
    bad = replace_stage(base, 0, moved(base.actions[0], Action(SA, 0, 1), before=Action(F, 0, 1)))
    with pytest.raises(ScheduleError, match="stage 0 does 0:SEND_ACT1 before 0:F1"):
        validate(bad)


@pytest.mark.parametrize("p", [1, 2])
def test_backward_before_forward(p):
    base = build("gpipe", p, 2)
    s = p - 1
    bad = replace_stage(base, s, moved(base.actions[s], Action(B, s, 0), Action(F, s, 0)))
    with pytest.raises(ScheduleError, match=f"stage {s} does {s}:B0 before {s}:F0"):
        validate(bad)


@pytest.mark.parametrize("dup", [Action(F, 1, 0), Action(RA, 1, 2), Action(SG, 1, 1)])
def test_duplicate_action_is_named(dup):
    base = build("gpipe", 2, 3)
    ops = list(base.actions[1])
    ops.insert(len(ops) - 1, dup)
    with pytest.raises(ScheduleError, match=f"stage 1 lists {dup} twice"):
        validate(replace_stage(base, 1, ops))


@pytest.mark.parametrize(
    "edit",
    [
        lambda ops: ops[:-1],  # no STEP
        lambda ops: [*ops, ops[-1]],  # two STEPs
        lambda ops: [ops[-1], *ops[:-1]],  # STEP first
        lambda ops: [*ops[:2], ops[-1], *ops[2:-1]],  # STEP in the middle
        lambda ops: [],  # nothing at all
    ],
)
def test_stage_must_end_with_exactly_one_step(edit):
    base = build("1f1b", 3, 2)
    bad = replace_stage(base, 1, edit(list(base.actions[1])))
    with pytest.raises(ScheduleError, match="stage 1 must end with exactly one STEP"):
        validate(bad)


def test_action_listed_under_the_wrong_stage():
    base = build("gpipe", 3, 2)
    intruder = Action(F, 2, 0)
    ops = [intruder if a == Action(F, 1, 0) else a for a in base.actions[1]]
    with pytest.raises(ScheduleError, match=f"stage 1 lists actions of another stage: {intruder}"):
        validate(replace_stage(base, 1, ops))


def test_stage_step_of_another_stage_is_rejected():
    base = build("gpipe", 2, 2)
    ops = [*base.actions[0][:-1], step(1)]
    with pytest.raises(ScheduleError, match="another stage"):
        validate(replace_stage(base, 0, ops))


@pytest.mark.parametrize(
    "stage, extra",
    [
        (0, Action(RA, 0, 0)),  # the first stage has nobody to receive activations from
        (0, Action(SG, 0, 0)),
        (2, Action(SA, 2, 0)),  # the last stage has nobody to send activations to
        (2, Action(RG, 2, 1)),
        (1, Action(F, 1, 3)),  # micro-batch index out of range
        (1, Action(B, 1, -1)),
    ],
)
def test_action_with_no_place_in_the_schedule(stage, extra):
    base = build("gpipe", 3, 3)
    ops = list(base.actions[stage])
    ops.insert(len(ops) - 1, extra)
    with pytest.raises(ScheduleError, match=f"stage {stage} lists {extra}, which has no place"):
        validate(replace_stage(base, stage, ops))


def test_schedule_must_list_every_stage():
    base = build("gpipe", 3, 2)
    with pytest.raises(ValueError, match="stages 0..2"):
        Schedule("x", 3, 2, {0: base.actions[0], 2: base.actions[2]})
    with pytest.raises(ValueError, match="stages 0..1"):
        Schedule("x", 2, 2, base.actions)


def test_schedule_error_is_a_value_error():
    assert issubclass(ScheduleError, ValueError)


# -- no false alarms and agreement with an exhaustive rendezvous executor ------------------------


@pytest.mark.parametrize("seed", range(40))
def test_random_valid_schedules_pass(seed):
    rng = random.Random(seed)
    p, m = rng.randint(1, 5), rng.randint(1, 5)
    schedule = random_valid_schedule(p, m, rng)
    validate(schedule)
    assert rendezvous_stuck(schedule) == {}


def perturbed(rng):
    """A small schedule whose stages keep their local order but may break the link order."""
    p, m = rng.randint(2, 4), rng.randint(1, 3 if rng.random() < 0.5 else 2)
    source = rng.choice(["gpipe", "1f1b", "random"])
    base = random_valid_schedule(p, m, rng) if source == "random" else build(source, p, m)
    actions = dict(base.actions)
    if rng.random() < 0.3:
        s = rng.randrange(p)
        actions[s] = tuple(random_linear_extension(actions[s], rng))
    else:
        for s in rng.sample(range(p), rng.randint(1, p)):
            actions[s] = tuple(random_local_swaps(actions[s], rng, rng.randint(1, 4)))
    return Schedule(base.name, p, m, actions)


def test_local_permutations_deadlock_exactly_when_exhaustive_search_gets_stuck():
    rng = random.Random(20240607)
    outcomes = {"deadlock": 0, "fine": 0}
    for _ in range(300):
        schedule = perturbed(rng)
        assert all(respects_local_order(ops) for ops in schedule.actions.values())
        check_complete(schedule)  # the permutations keep every local rule
        stuck = rendezvous_stuck(schedule)
        if stuck:
            outcomes["deadlock"] += 1
            with pytest.raises(ScheduleError) as info:
                check_deadlock_free(schedule)
            message = str(info.value)
            for s, (pos, action) in stuck.items():
                assert f"stage {s} waits at {action} (position {pos})" in message
            assert message.count("waits at") == len(stuck)
        else:
            outcomes["fine"] += 1
            check_deadlock_free(schedule)
            validate(schedule)
    # the property was exercised on both sides
    assert outcomes["deadlock"] >= 30 and outcomes["fine"] >= 30, outcomes


@pytest.mark.parametrize("kind", [SA, RA, SG, RG])
def test_matching_is_the_other_end_of_the_same_message(kind):
    a = Action(kind, 2, 5)
    other = a.matching()
    assert other == partner(a)
    assert other.matching() == a
    assert other.peer == a.stage and a.peer == other.stage
    assert abs(other.stage - a.stage) == 1 and other.microbatch == 5


@pytest.mark.parametrize("action", [Action(F, 1, 0), Action(B, 1, 0), step(1)])
def test_non_communication_actions_have_no_peer(action):
    assert action.peer is None
    with pytest.raises(ValueError, match="not a communication action"):
        action.matching()
