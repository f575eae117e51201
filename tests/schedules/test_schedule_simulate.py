"""The simulator: closed forms derived by hand, lower bounds, and an independent timing model."""

from __future__ import annotations

import math
import random

import pytest
from schedule_oracles import (
    RG,
    SA,
    B,
    F,
    longest_path_times,
    random_valid_schedule,
    replace_stage,
    step,
)

from schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    Simulation,
    build,
    gpipe,
    one_f_one_b,
    simulate,
)
from schedules.action import SENDS

NAMES = ["gpipe", "1f1b"]
SIZES = [(p, m) for p in range(1, 9) for m in (1, 2, 3, 5, 8, 13, 16)]
COSTS = [(1.0, 2.0), (1.0, 1.0), (0.75, 0.25), (3.0, 1.0)]


# -- uniform stages ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("f, b", COSTS)
def test_uniform_step_time_and_bubble(name, f, b):
    for p, m in SIZES:
        sim = simulate(build(name, p, m), f, b)
        assert sim.step_time == pytest.approx((m + p - 1) * (f + b)), (p, m)
        assert sim.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (p, m)
        assert sim.busy == pytest.approx([m * (f + b)] * p)
        assert max(sim.finish) == sim.step_time
        for s in range(p):
            assert sim.stage_bubble(s) == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("name", NAMES)
def test_uniform_stage_finish_times_staircase(name):
    # stage s's last backward waits for the gradient from s+1, so with uniform stages and no
    # transfer each stage finishes b after its successor
    f, b = 1.0, 2.0
    for p, m in SIZES:
        finish = simulate(build(name, p, m), f, b).finish
        for s in range(p - 1):
            assert finish[s] == pytest.approx(finish[s + 1] + b), (p, m, s)


@pytest.mark.parametrize("p, m", SIZES)
def test_peak_inflight(p, m):
    assert simulate(gpipe(p, m), 1.0, 2.0).peak_inflight == (m,) * p
    expected = tuple(min(m, p - s) for s in range(p))
    assert simulate(one_f_one_b(p, m), 1.0, 2.0).peak_inflight == expected
    # memory depends on the order only, not on the costs
    assert simulate(one_f_one_b(p, m), [1, 5, 2, 3, 1, 1, 4, 2][:p], 0.5, 0.3).peak_inflight == (
        expected
    )


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", [1, 4, 9])
def test_single_stage_runs_back_to_back(name, m):
    sim = simulate(build(name, 1, m), 1.5, 2.5, optimizer_step=0.5)
    assert sim.step_time == pytest.approx(m * 4.0 + 0.5)
    assert sim.busy == pytest.approx((m * 4.0,))
    # the optimizer step is counted as not-busy by definition of busy (compute only)
    assert sim.bubble_fraction == pytest.approx(0.5 / (m * 4.0 + 0.5))


def test_zero_costs_give_zero_time_and_zero_bubble():
    sim = simulate(one_f_one_b(4, 6), 0.0, 0.0)
    assert sim.step_time == 0.0
    assert sim.bubble_fraction == 0.0
    assert sim.stage_bubble(2) == 0.0


# -- transfer ---------------------------------------------------------------------------------


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("f, b, t", [(1.0, 2.0, 0.25), (1.0, 1.0, 3.0), (2.0, 0.5, 1.0)])
def test_gpipe_two_stages_with_transfer(m, f, b, t):
    # stage 1 ends its forwards at (m+1)f + t (its first activation arrives at f + t, then it is
    # compute bound), then runs m backwards; each gradient reaches stage 0 t later, so stage 0
    # finishes at (m+1)f + t + mb + (b + t)
    sim = simulate(gpipe(2, m), f, b, t)
    assert sim.finish[1] == pytest.approx((m + 1) * f + t + m * b)
    assert sim.finish[0] == pytest.approx((m + 1) * (f + b) + 2 * t)
    assert sim.step_time == pytest.approx((m + 1) * (f + b) + 2 * t)


@pytest.mark.parametrize("p", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 5])
def test_gpipe_per_link_transfers(p, m):
    # forward of micro-batch i on stage s ends at (s+1+i)f + sum(t[:s]); the last stage's last
    # forward ends at (m+p-1)f + sum(t); the backward wave then crosses back link by link
    f, b = 1.0, 1.5
    t = [0.1 * (k + 1) for k in range(p - 1)]
    sim = simulate(gpipe(p, m), f, b, t)
    for s in range(p):
        expected = (m + p - 1) * f + sum(t) + (m + p - 1 - s) * b + sum(t[s:])
        assert sim.finish[s] == pytest.approx(expected), s
    assert sim.step_time == pytest.approx((m + p - 1) * (f + b) + 2 * sum(t))


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 11])
@pytest.mark.parametrize("f, b, t", [(1.0, 2.0, 0.25), (1.0, 1.0, 3.0), (2.0, 0.5, 1.0)])
def test_1f1b_two_stages_with_transfer(m, f, b, t):
    # Stage 0 runs F0 F1 B0 F2 B1 ...; stage 1 runs F0 B0 F1 B1 .... Solving the recurrences by
    # hand: B(2k) on stage 0 ends at (2k+2)(f+b) + (2k+2)t and B(2k+1) at (2k+3)(f+b) + (2k+2)t:
    # every second micro-batch waits a full round trip, because stage 0 holds only two.
    sim = simulate(one_f_one_b(2, m), f, b, t)
    assert sim.step_time == pytest.approx((m + 1) * (f + b) + 2 * t * math.ceil(m / 2))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("p, m", [(2, 1), (3, 4), (4, 2), (5, 9), (8, 3)])
def test_transfer_costs_at_least_one_round_trip(name, p, m):
    f, b = 1.0, 2.0
    previous = simulate(build(name, p, m), f, b).step_time
    for t in (0.1, 0.5, 2.0):
        now = simulate(build(name, p, m), f, b, t).step_time
        assert now >= (m + p - 1) * (f + b) + 2 * (p - 1) * t - 1e-9
        assert now >= previous
        previous = now


# -- runtime overhead per action ----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("m", [1, 4, 9])
def test_overhead_is_paid_once_per_action_on_a_single_stage(name, m):
    # 2m computes and one step, back to back: each adds its overhead, none of it busy
    sim = simulate(build(name, 1, m), 1.5, 2.5, optimizer_step=0.5, overhead=0.25)
    assert sim.step_time == pytest.approx(m * 4.0 + 0.5 + (2 * m + 1) * 0.25)
    assert sim.busy == pytest.approx((m * 4.0,))


def test_overhead_on_two_stages_by_hand():
    # rank 0: F0 (+o), SEND_ACT0 (+o), waits for the gradient, B0 (+o), STEP (+o). rank 1 gets
    # the activation at f, then RECV (+o), F0 (+o), B0: the gradient leaves at 2f + b + 2o.
    f, b, s, o = 1.0, 2.0, 0.5, 0.1
    sim = simulate(gpipe(2, 1), f, b, 0.0, s, overhead=[o, 3 * o])
    assert sim.finish[1] == pytest.approx(2 * f + b + s + 5 * 3 * o)
    assert sim.finish[0] == pytest.approx(2 * f + 2 * b + s + 3 * o + 2 * 3 * o)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb-h1"])
def test_overhead_only_lengthens_the_step(name):
    schedule = build(name, 4, 4, ranks=2 if name == "interleaved" else None)
    weight = 0.5 if name == "zb-h1" else None
    base = simulate(schedule, 1.0, 1.0, weight=weight)
    previous = base.step_time
    for o in (0.01, 0.1, 0.5):
        sim = simulate(schedule, 1.0, 1.0, weight=weight, overhead=o)
        assert sim.busy == base.busy
        assert sim.step_time > previous
        previous = sim.step_time


def test_optimizer_step_delays_each_stage_by_its_own_step():
    base = simulate(gpipe(3, 4), 1.0, 2.0, 0.5)
    opt = [0.25, 4.0, 1.0]
    sim = simulate(gpipe(3, 4), 1.0, 2.0, 0.5, optimizer_step=opt)
    assert sim.finish == pytest.approx([x + o for x, o in zip(base.finish, opt, strict=True)])
    assert sim.step_time == pytest.approx(max(sim.finish))
    assert sim.busy == base.busy


# -- heterogeneous stages ---------------------------------------------------------------------


def random_costs(p, rng):
    fwd = [rng.choice([0.5, 1.0, 1.5, 2.0, 3.0]) for _ in range(p)]
    bwd = [rng.choice([0.5, 1.0, 2.0, 4.0]) for _ in range(p)]
    link = [rng.choice([0.0, 0.125, 0.5, 1.0]) for _ in range(p - 1)]
    opt = [rng.choice([0.0, 0.25, 1.0]) for _ in range(p)]
    return fwd, bwd, link, opt


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("seed", range(12))
def test_heterogeneous_lower_bounds(name, seed):
    rng = random.Random(seed)
    p, m = rng.randint(1, 7), rng.randint(1, 12)
    fwd, bwd, link, opt = random_costs(p, rng)
    sim = simulate(build(name, p, m), fwd, bwd, link, opt)
    assert sim.busy == pytest.approx([m * (fwd[s] + bwd[s]) for s in range(p)])
    eps = 1e-9
    # one micro-batch must go all the way down and back up
    assert sim.step_time >= sum(fwd) + sum(bwd) + 2 * sum(link) + opt[0] - eps
    for s in range(p):
        # a stage cannot do more than its own work in less time
        assert sim.step_time >= sim.busy[s] + opt[s] - eps
        # stage s can start only once an activation has come down to it, and after its last
        # backward that gradient must still travel up to stage 0, which then steps
        fill = sum(fwd[:s]) + sum(link[:s])
        drain = sum(bwd[:s]) + sum(link[:s])
        assert sim.step_time >= fill + sim.busy[s] + drain + opt[0] - eps
        assert sim.finish[s] >= fill + sim.busy[s] + opt[s] - eps
    assert 0.0 <= sim.bubble_fraction < 1.0


def random_case(rng, fewest, most):
    """Stages in [fewest, most], 1 to 8 micro-batches, GPipe, 1F1B or a random valid list."""
    p, m = rng.randint(fewest, most), rng.randint(1, 8)
    kind = rng.choice(["gpipe", "1f1b", "random"])
    return p, m, random_valid_schedule(p, m, rng) if kind == "random" else build(kind, p, m)


def timeline_finish(schedule, fwd, bwd, link, opt):
    times = longest_path_times(schedule, fwd, bwd, link, opt)
    return [times[(s, len(schedule.actions[s]) - 1)] for s in range(schedule.stages)]


@pytest.mark.parametrize("seed", range(30))
def test_simulator_agrees_with_longest_path_model(seed):
    rng = random.Random(1000 + seed)
    p, m, schedule = random_case(rng, 1, 6)
    fwd, bwd, link, opt = random_costs(p, rng)
    sim = simulate(schedule, fwd, bwd, link, opt)
    expected = timeline_finish(schedule, fwd, bwd, link, opt)
    assert list(sim.finish) == pytest.approx(expected)
    assert sim.step_time == pytest.approx(max(expected))


@pytest.mark.parametrize("seed", range(20))
def test_action_durations_agree_with_longest_path_model(seed):
    # each compute and step action its own time: the simulator and the independent model of
    # earliest times still agree action by action
    rng = random.Random(3000 + seed)
    p, m, schedule = random_case(rng, 1, 6)
    fwd, bwd, link, opt = random_costs(p, rng)
    durations = {
        a: rng.choice([0.0, 0.25, 1.0, 2.5, 4.0])
        for ops in schedule.actions.values() for a in ops
        if a.kind in (F, B, Kind.STEP) and rng.random() < 0.5
    }
    sim = simulate(schedule, fwd, bwd, link, opt, durations=durations)
    times = longest_path_times(schedule, fwd, bwd, link, opt, durations=durations)
    assert list(sim.finish) == pytest.approx(
        [times[(s, len(schedule.actions[s]) - 1)] for s in range(p)]
    )
    for span in sim.timeline:
        if span.action in durations:
            assert span.duration == pytest.approx(durations[span.action]), span.action


def test_action_durations_by_hand():
    # GPipe, 2 stages, 1 micro-batch, F=1, B=2: F0 F1 B1 B0 back to back takes 6; a forward
    # on stage 0 that takes 3 delays everything after it by 2, a backward on stage 1 that
    # takes nothing saves its 2
    schedule = gpipe(2, 1)
    assert simulate(schedule, 1.0, 2.0).step_time == 6.0
    assert simulate(schedule, 1.0, 2.0, durations={Action(F, 0, 0): 3.0}).step_time == 8.0
    assert simulate(schedule, 1.0, 2.0, durations={Action(B, 1, 0): 0.0}).step_time == 4.0


@pytest.mark.parametrize(
    "durations, what",
    [
        ({Action(F, 5, 0): 1.0}, "no compute or step action"),
        ({Action(SA, 0, 0): 1.0}, "no compute or step action"),
        ({Action(F, 0, 0): -1.0}, "at least 0"),
    ],
)
def test_durations_must_name_timed_actions_of_the_schedule(durations, what):
    with pytest.raises(ValueError, match=what):
        simulate(gpipe(2, 1), 1.0, 2.0, durations=durations)


def simulate_with_action_times(schedule, *costs):
    """Run the simulator; return it and the end time of each compute and step action, read
    from its timeline (whose spans must also last exactly their action's cost)."""
    sim = simulate(schedule, *costs)
    timed = (F, B, Kind.STEP)
    end = {span.action: span.end for span in sim.timeline if span.action.kind in timed}
    assert len(end) == sum(
        1 for ops in schedule.actions.values() for a in ops if a.kind in timed
    ), "the timeline must hold every compute and step action once"
    return sim, end


@pytest.mark.parametrize("seed", range(25))
def test_simulated_actions_respect_every_dependency_and_start_as_early_as_possible(seed):
    rng = random.Random(5000 + seed)
    p, m, schedule = random_case(rng, 2, 6)
    fwd, bwd, link, opt = random_costs(p, rng)
    sim, end = simulate_with_action_times(schedule, fwd, bwd, link, opt)
    cost = {F: fwd, B: bwd}

    def start(a):
        return end[a] - cost[a.kind][a.stage]

    eps = 1e-9
    for s in range(p):
        computes = schedule.compute(s)
        for prev, nxt in zip(computes, computes[1:], strict=False):
            assert start(nxt) >= end[prev] - eps  # one stage computes one thing at a time
        for i in range(m):
            assert start(Action(B, s, i)) >= end[Action(F, s, i)] - eps
            if s > 0:  # forward needs the activation from s-1, which needs the link
                assert start(Action(F, s, i)) >= end[Action(F, s - 1, i)] + link[s - 1] - eps
            if s < p - 1:  # backward needs the gradient from s+1
                assert start(Action(B, s, i)) >= end[Action(B, s + 1, i)] + link[s] - eps
        assert end[step(s)] == pytest.approx(sim.finish[s])

    # and no action waits longer than its dependencies require: identical to the earliest
    # times of the independent longest-path model
    times = longest_path_times(schedule, fwd, bwd, link, opt)
    for s, ops in schedule.actions.items():
        for k, a in enumerate(ops):
            if a.kind in (F, B) or a == step(s):
                assert end[a] == pytest.approx(times[(s, k)]), a


# -- inputs -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, what",
    [
        ({"forward": [1.0, 1.0]}, "forward needs 3 values"),
        ({"backward": [1.0] * 4}, "backward needs 3 values"),
        ({"transfer": [0.1] * 3}, "transfer needs 2 values"),
        ({"optimizer_step": [0.0]}, "optimizer_step needs 3 values"),
        ({"overhead": [0.0] * 2}, "overhead needs 3 values"),
    ],
)
def test_per_stage_lists_must_have_the_right_length(kwargs, what):
    args = {"forward": 1.0, "backward": 1.0, **kwargs}
    with pytest.raises(ValueError, match=what):
        simulate(gpipe(3, 2), **args)


def test_list_and_scalar_costs_agree():
    a = simulate(one_f_one_b(4, 6), 1.0, 2.0, 0.5, 0.25)
    b = simulate(one_f_one_b(4, 6), [1, 1, 1, 1], (2, 2, 2, 2), [0.5] * 3, [0.25] * 4)
    assert a == b
    assert isinstance(a, Simulation)


def test_deadlocking_schedule_is_refused():
    base = one_f_one_b(2, 3)
    ops = list(base.actions[0])
    k = ops.index(Action(RG, 0, 0))
    ops[k], ops[k + 1] = ops[k + 1], ops[k]  # SEND_ACT1 before RECV_GRAD0
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(replace_stage(base, 0, ops), 1.0, 1.0)



def test_incomplete_schedule_is_refused():
    # declares 2 micro-batches but only does one: simulate() times it as if it were complete
    short = Schedule("gpipe", 2, 2, gpipe(2, 1).actions)
    with pytest.raises(ScheduleError):
        simulate(short, 1.0, 1.0)



def test_send_before_its_compute_is_refused_with_a_schedule_error():
    base = gpipe(2, 1)
    # SEND_ACT0 before F0: locally wrong, but the link order is consistent (no deadlock)
    ops0 = [Action(SA, 0, 0), Action(F, 0, 0), Action(RG, 0, 0), Action(B, 0, 0), step(0)]
    with pytest.raises(ScheduleError):
        simulate(replace_stage(base, 0, ops0), 1.0, 1.0)



def test_numpy_scalar_costs():
    np = pytest.importorskip("numpy")
    expected = simulate(gpipe(3, 4), 1.0, 2.0, 0.5).step_time
    sim = simulate(gpipe(3, 4), np.float32(1.0), np.int64(2), np.float64(0.5))
    assert sim.step_time == pytest.approx(expected)


def test_receive_of_micro_batch_zero_is_what_gates_stage_one():
    # a direct reading of the model: with a huge link, stage 1 cannot start before it
    sim = simulate(gpipe(2, 1), 1.0, 1.0, 100.0)
    assert sim.finish[1] == pytest.approx(1.0 + 100.0 + 1.0 + 1.0)
    assert sim.step_time == pytest.approx(1.0 + 100.0 + 2.0 + 100.0 + 1.0)


# -- ranks sharing cores (processor sharing) ----------------------------------------------------


def test_two_ranks_on_one_core_by_hand():
    # 1F1B, 2 stages, 2 micro-batches, f = b = 1, one core. Rank 1 starts when F0 ends (t=1);
    # from then on both ranks run (each at half speed) until rank 1 has nothing ready, and the
    # core is never idle: the step takes the whole work, 8 s, instead of 6 s unshared.
    sim = simulate(one_f_one_b(2, 2), 1.0, 1.0, cores=1)
    assert sim.step_time == pytest.approx(8.0)
    shared = {s.action: (s.start, s.end) for s in sim.timeline}
    assert shared[Action(F, 0, 0)] == pytest.approx((0.0, 1.0))  # alone: full speed
    assert shared[Action(F, 0, 1)] == pytest.approx((1.0, 3.0))  # beside rank 1's F0: half speed
    assert shared[Action(F, 1, 0)] == pytest.approx((1.0, 3.0))
    # busy is the stretched time, as the runtime measures it, so the timeline's bubble agrees
    assert sum(sim.busy) == pytest.approx(sum(s.duration for s in sim.timeline
                                              if s.action.kind in (Kind.FORWARD, Kind.BACKWARD)))


@pytest.mark.parametrize("seed", range(20))
def test_one_core_is_never_idle_without_transfers(seed):
    # with no transfer and no overhead some rank can always run (the schedule cannot
    # deadlock), so one shared core finishes after exactly all the work
    rng = random.Random(7000 + seed)
    p, m, schedule = random_case(rng, 2, 6)
    fwd, bwd, _, opt = random_costs(p, rng)
    sim = simulate(schedule, fwd, bwd, 0.0, opt, cores=1)
    assert sim.step_time == pytest.approx(m * (sum(fwd) + sum(bwd)) + sum(opt))


@pytest.mark.parametrize("seed", range(20))
def test_enough_cores_change_nothing_and_fewer_cost_time(seed):
    rng = random.Random(8000 + seed)
    p, m = rng.randint(2, 6), rng.randint(1, 8)
    schedule = build(rng.choice(["gpipe", "1f1b"]), p, m)
    fwd, bwd, link, opt = random_costs(p, rng)
    alone = simulate(schedule, fwd, bwd, link, opt)
    assert simulate(schedule, fwd, bwd, link, opt, cores=p).finish == pytest.approx(alone.finish)
    shared = simulate(schedule, fwd, bwd, link, opt, cores=1)
    assert shared.step_time >= alone.step_time - 1e-9
    assert shared.step_time >= m * (sum(fwd) + sum(bwd)) - 1e-9  # one core does it all


def test_cores_must_be_positive():
    with pytest.raises(ValueError, match="cores must be at least 1"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores=0)
    with pytest.raises(ValueError, match="cores must be at least 1"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores={(0, 1): 0})
    with pytest.raises(ValueError, match="in two groups"):
        simulate(gpipe(3, 2), 1.0, 1.0, cores={(0, 1): 1, (1, 2): 1})
    with pytest.raises(ValueError, match="not one of ranks 0..1"):
        simulate(gpipe(2, 2), 1.0, 1.0, cores={(0, 2): 1})


def test_pinned_groups_share_only_within_themselves():
    # GPipe, 4 stages, 2 micro-batches, f = b = 1: only neighbours ever run at once. Pinned
    # round robin to two cores (ranks 0 and 2 on one, 1 and 3 on the other) no two of them
    # share a core, and the step takes its unshared 10 s; pinned in blocks (0 and 1 together)
    # neighbours share, and it takes longer.
    schedule = gpipe(4, 2)
    alone = simulate(schedule, 1.0, 1.0)
    assert alone.step_time == pytest.approx(10.0)
    apart = simulate(schedule, 1.0, 1.0, cores={(0, 2): 1, (1, 3): 1})
    assert apart.finish == pytest.approx(alone.finish)
    together = simulate(schedule, 1.0, 1.0, cores={(0, 1): 1, (2, 3): 1})
    assert together.step_time > alone.step_time + 0.5
    # F0.1 and F1.0 share rank 0 and 1's core from t = 1: each at half speed
    assert {s.action: s.end for s in together.timeline}[Action(F, 1, 0)] == pytest.approx(3.0)


@pytest.mark.parametrize("seed", range(20))
def test_groups_of_all_or_of_one_are_the_plain_cases(seed):
    rng = random.Random(8500 + seed)
    p, m, schedule = random_case(rng, 2, 6)
    fwd, bwd, link, opt = random_costs(p, rng)
    copy = rng.choice([0.0, 0.5])
    n = rng.randint(1, p)
    everyone = simulate(schedule, fwd, bwd, link, opt, copy=copy, cores={tuple(range(p)): n})
    assert everyone.finish == pytest.approx(
        simulate(schedule, fwd, bwd, link, opt, copy=copy, cores=n).finish
    )
    # a core of its own per rank is no sharing (without copies, which would share it)
    each = simulate(schedule, fwd, bwd, link, opt, cores={(r,): 1 for r in range(p)})
    assert each.finish == pytest.approx(simulate(schedule, fwd, bwd, link, opt).finish)


def test_ranks_entering_late_by_hand():
    # GPipe, 2 stages, 1 micro-batch, f = b = 1. Rank 1 entering at 5 s finds F0's output
    # there: F1 5-6, B1 6-7, B0 7-8. Rank 0 entering at 2 s delays everything by 2 s.
    late = simulate(gpipe(2, 1), 1.0, 1.0, start=[0.0, 5.0])
    assert late.step_time == pytest.approx(8.0)
    assert {s.action: s.start for s in late.timeline}[Action(F, 1, 0)] == pytest.approx(5.0)
    assert simulate(gpipe(2, 1), 1.0, 1.0, start=[2.0, 0.0]).step_time == pytest.approx(6.0)
    # a receive waits from the rank's entry, not from 0
    waits = {s.action: s.start for s in simulate(gpipe(2, 1), 1.0, 1.0, start=[0, 0.5]).timeline}
    assert waits[Action(Kind.RECV_ACT, 1, 0)] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="start times must be at least 0"):
        simulate(gpipe(2, 1), 1.0, 1.0, start=[-1.0, 0.0])


# -- messages that cost processor time (copies) --------------------------------------------------


def test_copies_by_hand():
    # GPipe, 2 stages, 1 micro-batch, f = b = 1, each end of a message copies for 0.5 s.
    # Unshared, or on two cores, a copy is a 0.5 s delay: 1 + .5 + 1 + 1 + .5 + 1 = 5 s.
    for cores in (None, 2):
        assert simulate(gpipe(2, 1), 1.0, 1.0, copy=0.5, cores=cores).step_time == pytest.approx(5)
    # On one core the two copies of a message share it (each at half speed, 1 s), and the
    # core does all the work one piece after another: 4 s of compute + 2 messages x 2 x 0.5.
    sim = simulate(gpipe(2, 1), 1.0, 1.0, copy=0.5, cores=1)
    assert sim.step_time == pytest.approx(6.0)
    assert {s.action: s.start for s in sim.timeline}[Action(F, 1, 0)] == pytest.approx(2.0)


@pytest.mark.parametrize("seed", range(20))
def test_copies_without_cores_are_transfer_time(seed):
    rng = random.Random(9000 + seed)
    p, m, schedule = random_case(rng, 2, 6)
    fwd, bwd, link, opt = random_costs(p, rng)
    copy = [rng.choice([0.0, 0.25, 0.5]) for _ in range(p - 1)]
    delayed = [a + b for a, b in zip(link, copy, strict=True)]
    sim = simulate(schedule, fwd, bwd, link, opt, copy=copy)
    assert sim.finish == pytest.approx(simulate(schedule, fwd, bwd, delayed, opt).finish)


@pytest.mark.parametrize("seed", range(20))
def test_one_core_does_compute_and_copies_one_after_another(seed):
    # with copies but no transfer latency some thread can always run, so one core finishes
    # after all the work: compute, steps, and two copies per message
    rng = random.Random(9500 + seed)
    p, m, schedule = random_case(rng, 2, 6)
    fwd, bwd, _, opt = random_costs(p, rng)
    copy = [rng.choice([0.25, 0.5, 1.0]) for _ in range(p - 1)]
    sends = [a for ops in schedule.actions.values() for a in ops if a.kind in SENDS]
    copies = sum(2 * copy[min(a.stage, a.peer)] for a in sends)
    sim = simulate(schedule, fwd, bwd, 0.0, opt, copy=copy, cores=1)
    assert sim.step_time == pytest.approx(m * (sum(fwd) + sum(bwd)) + sum(opt) + copies)
    assert copies > 0
