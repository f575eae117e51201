"""Virtual stages: the placement, the interleaved 1F1B generator, and how the validator and the
simulator treat several stages on one rank."""

from __future__ import annotations

import random

import pytest
from schedule_oracles import (
    COMM,
    RA,
    RG,
    SA,
    SG,
    B,
    F,
    longest_path_times,
    random_local_swaps,
    random_valid_schedule,
    rendezvous_stuck,
    replace_stage,
    step,
)

from schedules import (
    GENERATORS,
    Action,
    Schedule,
    ScheduleError,
    build,
    interleaved,
    one_f_one_b,
    simulate,
    validate,
)
from schedules.validate import check_complete, check_deadlock_free

# (ranks, chunks per rank, micro-batches): m a multiple of p, as Megatron requires
SIZES = [(p, v, m) for p in (1, 2, 3, 4) for v in (1, 2, 3, 4) for m in (p, 2 * p, 3 * p)]
SIZES += [(8, 2, 8), (8, 2, 16), (6, 3, 12), (5, 2, 15)]


def megatron_order(rank, p, v, m):
    """Independent statement of Megatron's interleaved order for one rank: a table of
    (chunk, micro-batch) forwards, group by group of p micro-batches, each group through all
    chunks; backwards walk the same table with chunks reversed. Warm-up, then F/B pairs."""
    table = [
        (c, g * p + k) for g in range(m // p) for c in range(v) for k in range(p)
    ]
    fwd = [(F, c * p + rank, i) for c, i in table]
    bwd = [(B, (v - 1 - c) * p + rank, i) for c, i in table]
    warm = min(2 * (p - rank - 1) + (v - 1) * p, m * v)
    order = fwd[:warm]
    for f, b in zip(fwd[warm:], bwd, strict=False):
        order += [f, b]
    return order + bwd[len(fwd) - warm :]


def tokens(schedule, rank):
    return [(a.kind, a.stage, a.microbatch) for a in schedule.compute(rank)]


# -- the representation ---------------------------------------------------------------------


def test_placement_defaults_to_one_stage_per_rank():
    s = one_f_one_b(4, 3)
    assert s.placement == (0, 1, 2, 3)
    assert s.ranks == 4 and s.one_stage_per_rank
    assert [s.stages_on(r) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert s.rank_of(2) == 2 and not s.local(1, 2)
    assert Schedule(s.name, 4, 3, s.actions, (0, 1, 2, 3)) == s  # explicit identity is the same


@pytest.mark.parametrize("p, v", [(1, 2), (2, 2), (3, 3), (4, 2)])
def test_interleaved_places_stage_c_times_p_plus_r_on_rank_r(p, v):
    s = interleaved(p, p, v)
    assert (s.stages, s.ranks, s.microbatches) == (p * v, p, p)
    assert s.placement == tuple(st % p for st in range(p * v))
    for r in range(p):
        assert s.stages_on(r) == tuple(c * p + r for c in range(v))
    assert not s.one_stage_per_rank or v == 1


def test_schedule_checks_its_placement():
    base = interleaved(2, 2, 2)
    with pytest.raises(ValueError, match="places 3 stages but has 4"):
        Schedule("x", 4, 2, base.actions, (0, 1, 0))
    with pytest.raises(ValueError, match="places no stage on rank 1"):
        Schedule("x", 4, 2, {0: (), 1: (), 2: ()}, (0, 2, 0, 2))
    with pytest.raises(ValueError, match="ranks 0..1"):
        Schedule("x", 4, 2, {0: base.actions[0]}, base.placement)


# -- the generator --------------------------------------------------------------------------


@pytest.mark.parametrize("p, v, m", SIZES)
def test_every_interleaved_schedule_validates_in_megatrons_order(p, v, m):
    s = build("interleaved", p * v, m, ranks=p)
    assert s == interleaved(p, m, v)
    validate(s)
    assert s.name == "interleaved"
    for r in range(p):
        assert tokens(s, r) == megatron_order(r, p, v, m), (p, v, m, r)
        assert s.actions[r][-v:] == tuple(step(c * p + r) for c in range(v))


@pytest.mark.parametrize("p, v, m", SIZES)
def test_messages_cross_ranks_only_and_both_ends_agree_on_their_order(p, v, m):
    s = interleaved(p, m, v)
    for r, ops in s.actions.items():
        for a in ops:
            if a.kind in COMM:
                assert s.rank_of(a.peer) != r, a  # no message between stages of one rank
    for r in range(p):
        for q in range(p):
            out = [(a.kind, a.stage, a.microbatch) for a in s.actions[r]
                   if a.kind in (SA, SG) and s.rank_of(a.peer) == q]
            back = [(a.matching().kind, a.peer, a.microbatch) for a in s.actions[q]
                    if a.kind in (RA, RG) and s.rank_of(a.peer) == r]
            assert out == back, (p, v, m, r, q)
    # every stage boundary between two ranks carries one activation and one gradient per mb
    sends = sum(1 for ops in s.actions.values() for a in ops if a.kind in (SA, SG))
    boundaries = sum(1 for st in range(p * v - 1) if not s.local(st, st + 1))
    assert sends == 2 * m * boundaries


def test_one_rank_with_several_chunks_hands_everything_over_in_memory():
    s = interleaved(1, 3, 4)
    assert not [a for a in s.actions[0] if a.kind in COMM]
    assert s.placement == (0, 0, 0, 0)
    validate(s)


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (3, 2, 3), (2, 3, 2), (1, 2, 1)])
def test_interleaved_finishes_under_exhaustive_rendezvous(p, v, m):
    assert rendezvous_stuck(interleaved(p, m, v)) == {}


@pytest.mark.parametrize("m, fix", [(3, "use 2 or 4 micro-batches"), (5, "4 or 6"), (1, "use 2")])
def test_micro_batches_must_be_a_multiple_of_the_ranks(m, fix):
    with pytest.raises(ValueError, match="multiple of the number of ranks") as info:
        build("interleaved", 4, m, ranks=2)
    assert fix in str(info.value)


def test_build_interleaved_needs_ranks_that_divide_the_stages():
    with pytest.raises(ValueError, match="needs ranks="):
        build("interleaved", 8, 8)
    with pytest.raises(ValueError, match="not a positive multiple of ranks=3"):
        build("interleaved", 8, 6, ranks=3)
    with pytest.raises(ValueError, match="not a positive multiple"):
        build("interleaved", 2, 4, ranks=4)
    with pytest.raises(ValueError, match="at least one rank"):
        build("interleaved", 4, 4, ranks=0)
    with pytest.raises(ValueError, match="at least one chunk"):
        interleaved(2, 2, 0)
    with pytest.raises(ValueError, match="micro-batch"):
        interleaved(2, 0, 2)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1", "zb-h2"])
def test_one_stage_per_rank_schedules_take_ranks_equal_to_stages_only(name):
    assert build(name, 3, 4, ranks=3) == build(name, 3, 4)
    with pytest.raises(ValueError, match="one stage per rank"):
        build(name, 4, 4, ranks=2)


def test_generators_table_lists_interleaved_with_two_chunks_by_default():
    assert GENERATORS["interleaved"] is interleaved
    assert GENERATORS["interleaved"](2, 4) == interleaved(2, 4, 2)


# -- the validator on several stages per rank -------------------------------------------------


def test_message_between_stages_of_one_rank_has_no_place():
    base = interleaved(1, 2, 2)
    ops = list(base.actions[0])
    ops.insert(1, Action(SA, 0, 0))
    with pytest.raises(ScheduleError, match="rank 0 lists 0:SEND_ACT0, which has no place"):
        validate(replace_stage(base, 0, ops))


def test_in_memory_hand_off_must_keep_the_pipeline_order():
    base = interleaved(1, 2, 2)  # one rank, stages 0 and 1
    ops = list(base.actions[0])
    f0, f1 = ops.index(Action(F, 0, 0)), ops.index(Action(F, 1, 0))
    ops[f0], ops[f1] = ops[f1], ops[f0]
    with pytest.raises(ScheduleError, match="rank 0 does 1:F0 before 0:F0"):
        validate(replace_stage(base, 0, ops))
    ops = list(base.actions[0])
    b0, b1 = ops.index(Action(B, 0, 0)), ops.index(Action(B, 1, 0))
    ops[b0], ops[b1] = ops[b1], ops[b0]
    with pytest.raises(ScheduleError, match="rank 0 does 0:B0 before 1:B0"):
        validate(replace_stage(base, 0, ops))


@pytest.mark.parametrize(
    "edit",
    [
        lambda ops: ops[:-1],  # one STEP missing
        lambda ops: [*ops[:-2], ops[-1], ops[-2]],  # STEPs out of stage order
        lambda ops: [ops[-1], *ops[:-1]],  # a STEP first
    ],
)
def test_rank_ends_with_one_step_per_stage(edit):
    base = interleaved(2, 2, 2)
    message = r"rank 1 must end with one STEP for each of its stages \[1, 3\]"
    with pytest.raises(ScheduleError, match=message):
        validate(replace_stage(base, 1, edit(list(base.actions[1]))))


def test_deadlock_across_the_wrap_around_link_names_the_ranks():
    base = interleaved(2, 2, 2)
    # rank 1 sends stage 1's activations to rank 0 (stage 2): make rank 0 wait for a gradient
    # before it receives the activation that rank 1 is blocked sending
    ops = list(base.actions[0])
    recv = ops.index(Action(RA, 2, 0))
    grad = ops.index(Action(RG, 0, 0))
    moved = ops.pop(grad)
    ops.insert(recv, moved)
    bad = replace_stage(base, 0, ops)
    assert rendezvous_stuck(bad)
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 waits at 0:RECV_GRAD0"):
        validate(bad)


def test_random_virtual_schedules_pass_and_perturbed_ones_agree_with_exhaustive_search():
    rng = random.Random(77)
    outcomes = {"deadlock": 0, "fine": 0}
    for _ in range(150):
        p, v, m = rng.randint(2, 3), rng.randint(1, 3), rng.randint(1, 2)
        placement = [rng.randrange(p) for _ in range(p * v)]
        placement[:p] = range(p)  # every rank holds a stage
        rng.shuffle(placement)
        s = random_valid_schedule(p * v, m, rng, placement=placement, weight=rng.random() < 0.5)
        validate(s)
        assert rendezvous_stuck(s) == {}
        r = rng.randrange(s.ranks)
        # adjacent swaps that keep every local rule (the oracle's statement of them)
        bad = replace_stage(s, r, random_local_swaps(s.actions[r], rng, rng.randint(1, 6)))
        check_complete(bad)
        stuck = rendezvous_stuck(bad)
        if stuck:
            outcomes["deadlock"] += 1
            with pytest.raises(ScheduleError) as info:
                check_deadlock_free(bad)
            who = "stage" if bad.one_stage_per_rank else "rank"
            for rank, (pos, action) in stuck.items():
                assert f"{who} {rank} waits at {action} (position {pos})" in str(info.value)
            assert str(info.value).count("waits at") == len(stuck)
        else:
            outcomes["fine"] += 1
            validate(bad)
    assert outcomes["deadlock"] >= 10 and outcomes["fine"] >= 10, outcomes


# -- the simulator --------------------------------------------------------------------------


@pytest.mark.parametrize("p, v, m", SIZES)
@pytest.mark.parametrize("whole_f, whole_b", [(1.0, 2.0), (3.0, 3.0), (2.0, 0.5)])
def test_interleaved_bubble_is_v_times_smaller_than_1f1bs(p, v, m, whole_f, whole_b):
    # The same model cut into p stages of forward F and backward B per micro-batch, or into
    # p*v chunks of F/v and B/v. Uniform, free transfers:
    #   1F1B:        step = (m + p - 1)(F + B),      each rank idles (p-1)(F+B)
    #   interleaved: step = m(F + B) + (p-1)(F+B)/v, each rank idles (p-1)(F+B)/v
    # so the bubble fraction is (p-1)/(v m + p - 1) against 1F1B's (p-1)/(m + p - 1).
    f, b = whole_f / v, whole_b / v
    sim = simulate(interleaved(p, m, v), f, b)
    work = whole_f + whole_b
    assert sim.busy == pytest.approx([m * work] * p)
    assert sim.step_time == pytest.approx(m * work + (p - 1) * work / v)
    for r in range(p):
        assert sim.step_time - sim.busy[r] == pytest.approx((p - 1) * work / v)
    assert sim.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))
    plain = simulate(one_f_one_b(p, m), whole_f, whole_b)
    assert plain.step_time - plain.busy[0] == pytest.approx((p - 1) * work)


@pytest.mark.parametrize("p, v, m", SIZES)
def test_interleaved_memory_is_the_warm_up_plus_one(p, v, m):
    sim = simulate(interleaved(p, m, v), 1.0, 2.0)
    expected = tuple(min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p))
    assert sim.peak_inflight == expected
    assert sim.peak_full == expected  # no W: B frees everything


@pytest.mark.parametrize("v", [1, 2, 4])
def test_one_rank_ignores_transfer_costs(v):
    # one rank holds every chunk: no message, so no transfer, whatever the links cost
    quiet = simulate(interleaved(1, 3, v), 1.0, 2.0)
    loud = simulate(interleaved(1, 3, v), 1.0, 2.0, transfer=100.0)
    assert quiet.step_time == loud.step_time == pytest.approx(3 * v * 3.0)


@pytest.mark.parametrize("p, v, m", [(2, 2, 4), (4, 2, 8), (3, 3, 6), (4, 1, 8)])
def test_transfers_cost_at_least_one_round_trip_through_every_rank_boundary(p, v, m):
    f, b = 1.0 / v, 2.0 / v
    previous = simulate(interleaved(p, m, v), f, b).step_time
    for t in (0.05, 0.25, 1.0):
        now = simulate(interleaved(p, m, v), f, b, transfer=t).step_time
        # micro-batch 0 crosses all p*v - 1 boundaries (each between two ranks) down and up
        assert now >= p * v * (f + b) + 2 * (p * v - 1) * t - 1e-9
        assert now >= previous
        previous = now


@pytest.mark.parametrize("seed", range(20))
def test_simulator_agrees_with_longest_path_on_virtual_schedules(seed):
    rng = random.Random(900 + seed)
    if rng.random() < 0.5:
        p, v = rng.randint(1, 4), rng.randint(1, 3)
        s = interleaved(p, p * rng.randint(1, 3), v)
    else:
        p, v = rng.randint(1, 3), rng.randint(1, 3)
        placement = [rng.randrange(p) for _ in range(p * v)]
        placement[:p] = range(p)
        rng.shuffle(placement)
        s = random_valid_schedule(p * v, rng.randint(1, 4), rng, placement=placement)
    n = s.stages
    fwd = [rng.choice([0.5, 1.0, 2.0]) for _ in range(n)]
    bwd = [rng.choice([0.5, 1.0, 3.0]) for _ in range(n)]
    link = [rng.choice([0.0, 0.25, 1.0]) for _ in range(n - 1)]
    opt = [rng.choice([0.0, 0.5]) for _ in range(n)]
    sim = simulate(s, fwd, bwd, link, opt)
    times = longest_path_times(s, fwd, bwd, link, opt)
    finish = [times[(r, len(s.actions[r]) - 1)] for r in range(s.ranks)]
    assert list(sim.finish) == pytest.approx(finish)
    ends = {(span.lane, span.action): span.end for span in sim.timeline}
    for r, ops in s.actions.items():
        for k, a in enumerate(ops):
            if a.kind in (F, B):
                assert ends[(r, a)] == pytest.approx(times[(r, k)]), a
    assert {span.lane for span in sim.timeline} == set(range(s.ranks))


def test_simulated_spans_carry_their_rank():
    sim = simulate(interleaved(2, 2, 2), 1.0, 1.0)
    for span in sim.timeline:
        assert span.rank == span.action.stage % 2
    assert simulate(one_f_one_b(2, 2), 1.0, 1.0).timeline[0].rank is None  # as before
    assert {SG, RG} & {span.action.kind for span in sim.timeline}  # receive waits are spans
