"""Split backwards (B = input gradient, W = weight gradient): the ZB-H1 and ZB-H2 generators,
the validator's W rules and the simulator's costs, bubbles and memory for them."""

from __future__ import annotations

import random

import pytest
from schedule_oracles import (
    COMM,
    RG,
    SA,
    B,
    F,
    W,
    longest_path_times,
    memory_bounded_order,
    random_local_swaps,
    random_valid_schedule,
    rendezvous_stuck,
    replace_stage,
    step,
)

from schedules import (
    GENERATORS,
    Action,
    ScheduleError,
    bubble_fraction,
    build,
    gpipe,
    one_f_one_b,
    simulate,
    validate,
    zero_bubble_h1,
    zero_bubble_h2,
)
from schedules.validate import check_complete, check_deadlock_free

NAMES = ["zb-h1", "zb-h2"]
STAGES = range(1, 9)
MICROBATCHES = range(1, 17)


def warmup_and_delay(name, p, s):
    """The published shapes: ZB-H1 keeps 1F1B's warm-up (p-s forwards before the first B)
    and delays stage s's W's by s; ZB-H2 warms up with 2(p-s)-1 and delays by 2s."""
    return (p - s, s) if name == "zb-h1" else (2 * (p - s) - 1, 2 * s)


# -- generators -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", STAGES)
def test_every_zero_bubble_schedule_validates(name, p):
    for m in MICROBATCHES:
        s = build(name, p, m)
        validate(s)
        assert (s.name, s.stages, s.microbatches, s.ranks) == (name, p, m, p)
        assert s.splits_backward
        for st, ops in s.actions.items():
            assert ops[-1] == step(st)
            for kind in (F, B, W):
                assert sorted(a.microbatch for a in ops if a.kind is kind) == list(range(m))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", STAGES)
def test_forwards_and_input_gradients_follow_the_memory_bounded_1f1b_order(name, p):
    # dropping the W's leaves "forward while fewer than k micro-batches are held, else backward
    # the oldest": k = p - s (1F1B's) for ZB-H1, 2(p-s)-1 for ZB-H2
    for m in MICROBATCHES:
        s = build(name, p, m)
        for st in range(p):
            k, _ = warmup_and_delay(name, p, st)
            fb = [(a.kind, a.microbatch) for a in s.compute(st) if a.kind is not W]
            assert fb == memory_bounded_order(k, m), (name, p, m, st)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", STAGES)
def test_each_w_runs_right_after_the_b_it_is_delayed_to(name, p):
    # W(j) comes right after B(j + d); those with j + d >= m come after the last B, in order
    for m in MICROBATCHES:
        s = build(name, p, m)
        for st in range(p):
            _, d = warmup_and_delay(name, p, st)
            ops = s.compute(st)
            at = {(a.kind, a.microbatch): k for k, a in enumerate(ops)}
            for j in range(m):
                if j + d < m:
                    assert at[(W, j)] == at[(B, j + d)] + 1, (name, p, m, st, j)
                else:
                    assert at[(W, j)] > at[(B, m - 1)]
            assert [a.microbatch for a in ops if a.kind is W] == list(range(m))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p, m", [(p, m) for p in range(1, 4) for m in range(1, 5)])
def test_zero_bubble_finishes_under_exhaustive_rendezvous(name, p, m):
    assert rendezvous_stuck(build(name, p, m)) == {}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p", STAGES)
def test_both_ends_of_each_link_list_messages_in_the_same_order(name, p):
    for m in (1, 3, p, 2 * p + 1):
        s = build(name, p, m)
        for st in range(p - 1):
            upper = [
                (a.kind.value[-3:], a.microbatch)
                for a in s.actions[st]
                if a.kind in COMM and a.peer == st + 1
            ]
            lower = [
                (a.kind.value[-3:], a.microbatch)
                for a in s.actions[st + 1]
                if a.kind in COMM and a.peer == st
            ]
            assert upper == lower and len(upper) == 2 * m


@pytest.mark.parametrize("name", NAMES)
def test_registered_under_their_published_names(name):
    direct = {"zb-h1": zero_bubble_h1, "zb-h2": zero_bubble_h2}[name]
    assert GENERATORS[name] is direct
    assert build(name, 4, 6) == direct(4, 6)
    with pytest.raises(ValueError, match="stage"):
        direct(0, 3)
    with pytest.raises(ValueError, match="micro-batch"):
        direct(3, 0)


# -- validator ------------------------------------------------------------------------------


def test_missing_w_is_named():
    base = zero_bubble_h1(3, 4)
    gone = Action(W, 1, 2)
    bad = replace_stage(base, 1, [a for a in base.actions[1] if a != gone])
    with pytest.raises(ScheduleError, match=r"stage 1 never does 1:W2 \(each micro-batch needs"):
        validate(bad)


def test_one_stray_w_makes_every_w_required():
    base = one_f_one_b(2, 2)
    ops = list(base.actions[1])
    ops.insert(ops.index(Action(B, 1, 0)) + 1, Action(W, 1, 0))
    with pytest.raises(ScheduleError, match="never does 0:W0"):
        validate(replace_stage(base, 1, ops))


@pytest.mark.parametrize("name", NAMES)
def test_w_before_its_b_is_refused(name):
    base = build(name, 3, 4)
    for st in range(3):
        ops = [a for a in base.actions[st] if a != Action(W, st, 1)]
        ops.insert(ops.index(Action(B, st, 1)), Action(W, st, 1))
        with pytest.raises(ScheduleError, match=f"stage {st} does {st}:W1 before {st}:B1"):
            validate(replace_stage(base, st, ops))


def test_duplicate_w_and_w_after_step_are_refused():
    base = zero_bubble_h2(2, 3)
    ops = list(base.actions[0])
    with pytest.raises(ScheduleError, match="lists 0:W1 twice"):
        validate(replace_stage(base, 0, [*ops[:-1], Action(W, 0, 1), ops[-1]]))
    late = [a for a in ops if a != Action(W, 0, 2)] + [Action(W, 0, 2)]
    with pytest.raises(ScheduleError, match="must end with exactly one STEP"):
        validate(replace_stage(base, 0, late))


def test_w_of_a_stage_on_another_rank_is_refused():
    base = zero_bubble_h1(2, 2)
    ops = list(base.actions[0])
    ops.insert(len(ops) - 1, Action(W, 1, 0))
    with pytest.raises(ScheduleError, match="another stage: 1:W0"):
        validate(replace_stage(base, 0, ops))


def test_deadlocked_zero_bubble_schedule_is_refused():
    base = zero_bubble_h1(2, 3)
    ops = list(base.actions[0])
    # stage 0 waits for gradient 0 before sending activation 1, which stage 1 needs first
    k = ops.index(Action(SA, 0, 1))
    ops.insert(ops.index(Action(F, 0, 1)) + 1, ops.pop(ops.index(Action(RG, 0, 0))))
    assert ops.index(Action(RG, 0, 0)) < k + 1
    bad = replace_stage(base, 0, ops)
    check_complete(bad)
    assert rendezvous_stuck(bad)
    with pytest.raises(ScheduleError, match="deadlocks"):
        validate(bad)


def test_local_permutations_of_w_schedules_deadlock_exactly_when_exhaustive_search_does():
    rng = random.Random(4242)
    outcomes = {"deadlock": 0, "fine": 0}
    for _ in range(200):
        p, m = rng.randint(2, 3), rng.randint(1, 3)
        source = rng.choice(["zb-h1", "zb-h2", "random"])
        s = random_valid_schedule(p, m, rng, weight=True) if source == "random" else build(
            source, p, m
        )
        r = rng.randrange(p)
        bad = replace_stage(s, r, random_local_swaps(s.actions[r], rng, rng.randint(1, 5)))
        check_complete(bad)
        stuck = rendezvous_stuck(bad)
        if stuck:
            outcomes["deadlock"] += 1
            with pytest.raises(ScheduleError):
                check_deadlock_free(bad)
        else:
            outcomes["fine"] += 1
            validate(bad)
    assert outcomes["deadlock"] >= 20 and outcomes["fine"] >= 20, outcomes


# -- simulator: costs -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_w_schedules_need_the_weight_cost(name):
    with pytest.raises(ValueError, match=rf"'{name}' splits the backward.*pass weight="):
        simulate(build(name, 3, 3), 1.0, 1.0)
    with pytest.raises(ValueError, match="weight needs 3 values"):
        simulate(build(name, 3, 3), 1.0, 1.0, weight=[1.0, 1.0])


@pytest.mark.parametrize("schedule", [one_f_one_b(3, 5), gpipe(4, 2)])
def test_weight_without_w_actions_is_part_of_the_whole_backward(schedule):
    split = simulate(schedule, 1.0, [0.5, 1.0, 1.5, 2.0][: schedule.stages], weight=0.75)
    whole = simulate(schedule, 1.0, [1.25, 1.75, 2.25, 2.75][: schedule.stages])
    assert split == whole


# -- simulator: the published bubbles -------------------------------------------------------

COSTS = [(1.0, 1.0, 1.0), (2.0, 2.0, 2.0), (1.0, 2.0, 1.0), (2.0, 1.0, 0.5), (1.0, 1.0, 0.25),
         (3.0, 2.0, 2.0), (1.0, 1.0, 2.0), (1.0, 3.0, 2.0), (0.5, 1.0, 3.0)]


@pytest.mark.parametrize("f, b, w", COSTS)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 6, 8])
def test_zb_h1_bubble_is_p_minus_1_times_f_plus_b_minus_w(f, b, w, p):
    # Qi et al. 2023: with uniform stages and m >= p, 1F1B idles (p-1)(T_F + T_B + T_W) per
    # stage and ZB-H1 (p-1)(T_F + T_B - T_W) (a third when T_F = T_B = T_W). The paper states
    # it for equal times; the simulator gives (p-1) max(f, b, f+b-w) in general, which is
    # (p-1)(f+b-w) whenever w <= min(f, b).
    for m in (p, p + 1, 2 * p, 3 * p + 2):
        zb = simulate(zero_bubble_h1(p, m), f, b, weight=w)
        plain = simulate(one_f_one_b(p, m), f, b, weight=w)  # its B does b + w
        assert zb.busy == pytest.approx([m * (f + b + w)] * p)
        bubble = (p - 1) * max(f, b, f + b - w)
        for st in range(p):
            assert zb.step_time - zb.busy[st] == pytest.approx(bubble), (p, m, st)
            assert plain.step_time - plain.busy[st] == pytest.approx((p - 1) * (f + b + w))
        if w <= min(f, b):
            assert bubble == pytest.approx((p - 1) * (f + b - w))
        if f == b == w:
            assert (zb.step_time - zb.busy[0]) * 3 == pytest.approx(
                plain.step_time - plain.busy[0]
            )


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_zb_h2_stages_never_idle_once_started(p, t):
    # With T_F = T_B = T_W = t and m >= 2p-1, stage s computes without a gap from s*t (its
    # first activation can arrive no sooner) for m*3t: the busy spans form a parallelogram, so
    # the only idle time is the start offset, the step is m*3t + (p-1)t (no schedule can do
    # better), and consecutive mini-batches could tile with zero bubble in steady state.
    for m in (2 * p - 1, 2 * p, 3 * p + 1):
        sim = simulate(zero_bubble_h2(p, m), t, t, weight=t)
        assert sim.step_time == pytest.approx(3 * m * t + (p - 1) * t)
        for st in range(p):
            spans = sorted(
                (x for x in sim.timeline if x.action.stage == st and x.action.kind in (F, B, W)),
                key=lambda x: x.start,
            )
            assert spans[0].start == pytest.approx(st * t)
            assert spans[-1].end == pytest.approx(st * t + 3 * m * t)
            for before, after in zip(spans, spans[1:], strict=False):
                assert after.start == pytest.approx(before.end), (p, m, st, after.action)


@pytest.mark.parametrize("seed", range(40))
def test_zb_h2_no_slower_than_zb_h1_no_slower_than_1f1b(seed):
    rng = random.Random(seed)
    p = rng.randint(1, 7)
    m = rng.randint(2 * p - 1, 4 * p)
    f, b, w = (rng.choice([0.25, 0.5, 1.0, 2.0, 3.0]) for _ in range(3))
    h2 = simulate(zero_bubble_h2(p, m), f, b, weight=w).step_time
    h1 = simulate(zero_bubble_h1(p, m), f, b, weight=w).step_time
    plain = simulate(one_f_one_b(p, m), f, b, weight=w).step_time
    assert (p - 1) * f + m * (f + b + w) - 1e-9 <= h2 <= h1 + 1e-9 <= plain + 2e-9


# -- simulator: memory ----------------------------------------------------------------------


@pytest.mark.parametrize("p", STAGES)
def test_zb_h1_holds_1f1bs_full_activations_and_p_pending_ws(p):
    # B frees all but what W needs: peak_full (forwarded, not yet B'd) is 1F1B's min(m, p-s)
    # on every stage; peak_inflight (not yet W'd) is min(m, p) on every stage, which is
    # 1F1B's peak on the first stage, the one holding the most: the same peak memory.
    for m in MICROBATCHES:
        zb = simulate(zero_bubble_h1(p, m), 1.0, 1.0, weight=1.0)
        plain = simulate(one_f_one_b(p, m), 1.0, 2.0)
        assert zb.peak_full == plain.peak_inflight == tuple(min(m, p - s) for s in range(p))
        assert zb.peak_inflight == (min(m, p),) * p
        assert max(zb.peak_inflight) == max(plain.peak_inflight)


@pytest.mark.parametrize("p", STAGES)
def test_zb_h2_holds_about_twice_as_much(p):
    for m in MICROBATCHES:
        zb = simulate(zero_bubble_h2(p, m), 1.0, 1.0, weight=1.0)
        assert zb.peak_full == tuple(min(m, 2 * (p - s) - 1) for s in range(p))
        assert zb.peak_inflight == (min(m, 2 * p - 1),) * p
    m = 4 * p
    plain = simulate(one_f_one_b(p, m), 1.0, 2.0)
    zb = simulate(zero_bubble_h2(p, m), 1.0, 1.0, weight=1.0)
    assert max(zb.peak_full) == 2 * max(plain.peak_inflight) - 1  # 2p-1 against p


def test_memory_counts_follow_the_order_not_the_costs():
    a = simulate(zero_bubble_h2(4, 9), 1.0, 1.0, weight=1.0)
    b = simulate(zero_bubble_h2(4, 9), [3, 1, 2, 1], 0.5, 0.25, weight=[2, 0, 1, 5])
    assert (a.peak_inflight, a.peak_full) == (b.peak_inflight, b.peak_full)


# -- simulator: agreement with the independent timing model ----------------------------------


@pytest.mark.parametrize("seed", range(25))
def test_simulator_agrees_with_longest_path_on_w_schedules(seed):
    rng = random.Random(3000 + seed)
    p, m = rng.randint(1, 6), rng.randint(1, 8)
    kind = rng.choice(["zb-h1", "zb-h2", "random"])
    s = random_valid_schedule(p, m, rng, weight=True) if kind == "random" else build(kind, p, m)
    fwd = [rng.choice([0.5, 1.0, 2.0]) for _ in range(p)]
    bwd = [rng.choice([0.5, 1.0, 3.0]) for _ in range(p)]
    wgt = [rng.choice([0.0, 0.5, 1.0, 2.0]) for _ in range(p)]
    link = [rng.choice([0.0, 0.25, 1.0]) for _ in range(p - 1)]
    opt = [rng.choice([0.0, 0.5]) for _ in range(p)]
    sim = simulate(s, fwd, bwd, link, opt, weight=wgt)
    times = longest_path_times(s, fwd, bwd, link, opt, wgt)
    ends = {span.action: span.end for span in sim.timeline if span.action.kind in (F, B, W)}
    for r, ops in s.actions.items():
        for k, a in enumerate(ops):
            if a.kind in (F, B, W):
                assert ends[a] == pytest.approx(times[(r, k)]), a
        assert sim.finish[r] == pytest.approx(times[(r, len(ops) - 1)])
    assert sim.busy == pytest.approx([m * (fwd[r] + bwd[r] + wgt[r]) for r in range(p)])
    assert bubble_fraction(sim.timeline) == pytest.approx(sim.bubble_fraction)
