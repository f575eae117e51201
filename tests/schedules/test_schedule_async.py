"""Asynchronous schedules (PipeDream 1F1B, PipeDream-2BW): one steady-state list per train_step,
checked over several consecutive calls plus the flush; the weight-version lag; zero bubble."""

from __future__ import annotations

import pytest

from schedules import (
    Action,
    Kind,
    Schedule,
    ScheduleError,
    build,
    drain,
    for_call,
    measure_lag,
    peak_versions,
    simulate,
    steady_state,
    unroll,
    validate,
)

F, B, STEP = Kind.FORWARD, Kind.BACKWARD, Kind.STEP
CASES = [(p, m) for p in range(1, 7) for m in range(1, 9)]


# 2BW is defined only for m >= p-1 (every stage must finish a mini-batch's backwards before the
# next mini-batch's first forward needs the new version); smaller m is refused by build().
ASYNC_CASES = [("pipedream", p, m) for p, m in CASES] + [
    ("pipedream-2bw", p, m) for p, m in CASES if m >= p - 1
]


@pytest.mark.parametrize("name, p, m", ASYNC_CASES)
def test_validates_over_consecutive_calls_and_flush(name, p, m):
    schedule = build(name, p, m)
    validate(schedule)
    assert schedule.asynchronous and schedule.update_every == (1 if name == "pipedream" else m)
    for calls in range(1, 5):
        u = unroll(schedule, calls)
        for s in range(p):
            ops = u.actions[s]
            assert sorted(a.microbatch for a in ops if a.kind is F) == list(range(calls * m))
            assert sorted(a.microbatch for a in ops if a.kind is B) == list(range(calls * m))


@pytest.mark.parametrize("p, m", CASES)
def test_pipedream_is_1f1b_warm_up_then_strict_alternation_across_calls(p, m):
    schedule = build("pipedream", p, m)
    calls = 2 * p // m + 3
    u = unroll(schedule, calls, flush=False)
    for s in range(p):
        kinds = [a.kind for a in u.compute(s)]
        n, warm = calls * m, p - s
        assert kinds[:warm] == [F] * warm  # p-s forwards before the first backward
        assert kinds[warm:] == [B, F] * (n - warm) + [B]  # then strictly one and one
        steps = [a for a in u.actions[s] if a.kind is STEP]
        backwards = [a for a in u.actions[s] if a.kind is B]
        assert [a.microbatch for a in steps] == [a.microbatch for a in backwards]


@pytest.mark.parametrize("p, m", CASES)
def test_lag_is_p_minus_1_minus_s_for_pipedream(p, m):
    schedule = build("pipedream", p, m)
    assert schedule.lag == tuple(p - 1 - s for s in range(p))
    lags = measure_lag(unroll(schedule, 2 * p // m + 3), 1)
    for s in range(p):
        assert max(lags[s].values()) == p - 1 - s
        # every micro-batch that entered after the warm-up sees exactly the lag
        assert all(v == p - 1 - s for g, v in lags[s].items() if p - 1 - s <= g < 2 * m)


@pytest.mark.parametrize("p, m", [(p, m) for p, m in CASES if m >= p - 1])
def test_2bw_has_lag_one_and_at_most_two_versions(p, m):
    schedule = build("pipedream-2bw", p, m)
    assert schedule.lag == tuple(min(1, p - 1 - s) for s in range(p))
    u = unroll(schedule, 5)
    lags = measure_lag(u, m)
    assert {s: max(v.values()) for s, v in lags.items()} == dict(enumerate(schedule.lag))
    assert all(v <= 2 for v in peak_versions(u, m).values())
    for s in range(p):  # one update per mini-batch, after its last micro-batch's backward
        steps = [a.microbatch for a in u.actions[s] if a.kind is STEP]
        assert steps == [c * m + m - 1 for c in range(5)]


def test_2bw_refuses_too_few_micro_batches():
    with pytest.raises(ValueError, match="chunks >= 3"):
        build("pipedream-2bw", 4, 2)


@pytest.mark.parametrize("p, m", CASES)
def test_stashing_needs_lag_plus_one_versions(p, m):
    schedule = build("pipedream", p, m)
    peaks = peak_versions(unroll(schedule, 2 * p // m + 3), 1)
    assert peaks == {s: p - s for s in range(p)}


@pytest.mark.parametrize("name", ["pipedream", "pipedream-2bw"])
@pytest.mark.parametrize("p, m", [(p, m) for p, m in CASES if m >= p])
def test_steady_state_bubble_is_zero(name, p, m):
    schedule = build(name, p, m)
    call_time, bubble = steady_state(schedule, forward=1.0, backward=2.0)
    assert call_time == pytest.approx(3.0 * m)
    assert bubble == pytest.approx(0.0, abs=1e-12)
    sync = simulate(build("1f1b", p, m), forward=1.0, backward=2.0)
    assert call_time <= sync.step_time
    if p > 1:
        assert sync.bubble_fraction > 0


def test_steady_state_bubble_with_uneven_stages_is_the_slowest_stage():
    schedule = build("pipedream", 3, 6)
    call_time, bubble = steady_state(schedule, forward=[1, 2, 1], backward=[2, 4, 2])
    assert call_time == pytest.approx(6 * 6)
    assert bubble == pytest.approx(1 - (3 + 6 + 3) / (3 * 6))


def test_one_call_then_flush_is_1f1b_with_an_update_after_every_backward():
    for p, m in [(4, 8), (3, 2), (1, 4)]:
        u = unroll(build("pipedream", p, m), 1)
        sync = build("1f1b", p, m)
        for s in range(p):
            assert u.compute(s) == sync.compute(s)
        assert simulate(build("pipedream", p, m), 1.0, 2.0).step_time == pytest.approx(
            simulate(sync, 1.0, 2.0).step_time
        )


def test_first_call_and_drain_are_filtered_steady_lists():
    schedule = build("pipedream", 4, 3)
    first = for_call(schedule, 0)
    assert all(a.microbatch >= 0 for ops in first.actions.values() for a in ops)
    assert for_call(schedule, 2) == schedule  # the warm-up is over
    flush = drain(schedule, 5)
    assert [a for a in flush.actions[0] if a.kind is B] == [
        Action(B, 0, i) for i in (-3, -2, -1)
    ]
    assert all(a.kind not in (F, Kind.SEND_ACT, Kind.RECV_ACT) for a in flush.actions[1])
    # with fewer micro-batches than in flight, the drain spans several calls' worth
    assert [a.microbatch for a in drain(build("pipedream", 4, 1), 9).actions[0]
            if a.kind is B] == [-3, -2, -1]


def test_validator_catches_a_wrong_lag_and_a_misplaced_update():
    good = build("pipedream", 3, 4)
    wrong_lag = Schedule(
        good.name, 3, 4, good.actions, lag=(1, 1, 0), update_every=1
    )
    with pytest.raises(ScheduleError, match="lag"):
        validate(wrong_lag)
    ops = list(good.actions[0])
    at = next(i for i, a in enumerate(ops) if a.kind is STEP)
    ops.insert(at - 2, ops.pop(at))  # the update before its backward
    moved = Schedule(good.name, 3, 4, {**good.actions, 0: tuple(ops)}, lag=good.lag,
                     update_every=1)
    with pytest.raises(ScheduleError, match="STEP"):
        validate(moved)
    crossed = list(good.actions[1])
    i = next(k for k, a in enumerate(crossed) if a.kind is Kind.SEND_GRAD)
    j = next(k for k, a in enumerate(crossed) if a.kind is Kind.RECV_ACT and k > i)
    crossed[i], crossed[j] = crossed[j], crossed[i]
    bad = Schedule(good.name, 3, 4, {**good.actions, 1: tuple(crossed)}, lag=good.lag,
                   update_every=1)
    with pytest.raises(ScheduleError):
        validate(bad)
