"""Asynchronous schedules: PipeDream's 1F1B and PipeDream-2BW, which never flush.

Representation. An asynchronous ``Schedule`` is the same per-rank action list as a synchronous
one, for ONE ``train_step`` call in the steady state: stage s of p runs, for i = 0..m-1,
``F(i)`` then ``B(i - w)`` with ``w = p - 1 - s``. Micro-batch numbers count from the call's
first micro-batch, so ``B(-k)`` is the backward of a micro-batch forwarded k micro-batches before
this call began (it is still in flight). Across calls the lists concatenate into one endless
1F1B stream: stage s keeps ``w`` micro-batches in flight between calls and never idles in the
steady state.

* ``for_call(schedule, c)`` is the list of the c-th call since the last flush: the steady list
  without the backwards of micro-batches that do not exist (the warm-up).
* ``drain(schedule, c)`` is the flush after c calls: the backwards still owed, nothing else.
* ``unroll(schedule, calls)`` writes ``calls`` calls and the drain as one list per rank with
  global micro-batch numbers; the validator and the simulator work on it.

Updates. A STEP names the micro-batch whose backward it follows. "pipedream" updates after every
backward (a micro-batch is an update unit); "pipedream-2bw" accumulates the gradients of a whole
mini-batch and updates after the backward of its last micro-batch (Narayanan et al. 2021).

Weight versions and lag. A stage's version is the number of updates it has applied. A forward
reads the version current at the first forward of its update unit (the micro-batch for
PipeDream; the mini-batch for 2BW, so a mini-batch sees one version); its backward must use the
same version (weight stashing) and its gradient is applied in a later update. The lag of a
micro-batch on a stage is the number of updates between its forward's version and its backward.
In the steady state it is ``p - 1 - s`` for PipeDream (the backwards of the w micro-batches in
flight each update once) and ``min(1, p - 1 - s)`` for 2BW (one update in between, if m >= p-1);
``schedule.lag`` holds these numbers and ``measure_lag`` counts them on the unrolled lists.
"""

from __future__ import annotations

from dataclasses import replace

from schedules.action import Action, Kind, Schedule, check_sizes


def _call_list(stage: int, stages: int, microbatches: int, update_every: int) -> list[Action]:
    """One call's steady-state list of ``stage``, messages placed as in synchronous 1F1B: on each
    link both ends list, per i, the gradient of i-w and then the activation of i."""
    w, last = stages - 1 - stage, stage == stages - 1
    ops: list[Action] = []
    for i in range(microbatches):
        j = i - w
        if stage > 0:
            ops.append(Action(Kind.RECV_ACT, stage, i))
        ops.append(Action(Kind.FORWARD, stage, i))
        if not last:
            ops += [Action(Kind.RECV_GRAD, stage, j), Action(Kind.SEND_ACT, stage, i)]
        ops.append(Action(Kind.BACKWARD, stage, j))
        if stage > 0:
            ops.append(Action(Kind.SEND_GRAD, stage, j))
        if (j + 1) % update_every == 0:
            ops.append(Action(Kind.STEP, stage, j))
    return ops


def pipedream(stages: int, microbatches: int) -> Schedule:
    """PipeDream's asynchronous 1F1B (Narayanan et al. 2019): stage s warms up with p-s
    forwards once, then alternates one forward and one backward across mini-batch boundaries;
    every backward is followed by an optimizer update. Lag of stage s: p-1-s updates."""
    check_sizes(stages, microbatches)
    actions = {s: tuple(_call_list(s, stages, microbatches, 1)) for s in range(stages)}
    lag = tuple(stages - 1 - s for s in range(stages))
    return Schedule("pipedream", stages, microbatches, actions, lag=lag, update_every=1)


def pipedream_2bw(stages: int, microbatches: int) -> Schedule:
    """PipeDream-2BW (Narayanan et al. 2021): the same 1F1B stream, but each stage accumulates
    a mini-batch's gradients and updates once per mini-batch, after the backward of its last
    micro-batch. A mini-batch's forwards all read one version, so a stage holds at most two
    (W(t+1) = W(t) - lr * grad(W(t-1))); this needs at least p-1 micro-batches."""
    check_sizes(stages, microbatches)
    if microbatches < stages - 1:
        raise ValueError(
            f"pipedream-2bw keeps at most two weight versions only with at least stages-1 "
            f"micro-batches per mini-batch: got microbatches={microbatches} for {stages} stages; "
            f"use chunks >= {stages - 1}"
        )
    actions = {s: tuple(_call_list(s, stages, microbatches, microbatches)) for s in range(stages)}
    lag = tuple(min(1, stages - 1 - s) for s in range(stages))
    return Schedule(
        "pipedream-2bw", stages, microbatches, actions, lag=lag, update_every=microbatches
    )


def _keep(schedule: Schedule, keep) -> Schedule:  # type: ignore[no-untyped-def]
    actions = {r: tuple(a for a in ops if keep(a)) for r, ops in schedule.actions.items()}
    return replace(schedule, actions=actions)


def for_call(schedule: Schedule, call: int) -> Schedule:
    """The list of the ``call``-th train_step since the last flush (0 is the first, which warms
    up): the steady list without backwards (and their messages and STEPs) of micro-batches
    that were never fed."""
    start = call * schedule.microbatches
    return _keep(schedule, lambda a: a.microbatch + start >= 0)


def drain(schedule: Schedule, calls: int) -> Schedule:
    """The flush after ``calls`` train_steps since the last one: the backwards (and their
    messages and updates) of every micro-batch still in flight, in the order the following
    calls would run them (more than one call's worth when a stage holds more than m)."""
    m, start = schedule.microbatches, calls * schedule.microbatches
    actions: dict[int, tuple[Action, ...]] = {}
    for r, ops in schedule.actions.items():
        kept: list[Action] = []
        for k in range(-(-schedule.stages // m) + 1):
            kept += [a for a in _shift(ops, k * m) if a.microbatch < 0 <= a.microbatch + start]
        actions[r] = tuple(kept)
    return replace(schedule, actions=actions)


def _shift(ops: tuple[Action, ...], by: int) -> list[Action]:
    return [Action(a.kind, a.stage, a.microbatch + by) for a in ops]


def unroll(schedule: Schedule, calls: int, flush: bool = True) -> Schedule:
    """``calls`` train_steps (and the flush, unless ``flush=False``) as one list per rank with
    global micro-batch numbers: a schedule of ``calls * m`` micro-batches whose STEPs sit where
    the updates happen. It is synchronous in form (empty ``lag``)."""
    m = schedule.microbatches
    actions: dict[int, list[Action]] = {r: [] for r in schedule.actions}
    for c in range(calls):
        for r, ops in for_call(schedule, c).actions.items():
            actions[r] += _shift(ops, c * m)
    if flush:
        for r, ops in drain(schedule, calls).actions.items():
            actions[r] += _shift(ops, calls * m)
    return replace(
        schedule,
        name=f"{schedule.name} x{calls}" + (" + flush" if flush else ""),
        microbatches=calls * m,
        actions={r: tuple(ops) for r, ops in actions.items()},
        lag=(),
        update_every=0,
    )


def measure_lag(unrolled: Schedule, update_every: int) -> dict[int, dict[int, int]]:
    """Per stage, per global micro-batch: the updates between the version its forward reads
    (the one current at the first forward of its update unit) and its backward."""
    lags: dict[int, dict[int, int]] = {}
    for r, ops in unrolled.actions.items():
        version = 0
        pinned: dict[int, int] = {}
        read: dict[int, int] = {}
        lags[r] = {}
        for a in ops:
            if a.kind is Kind.STEP:
                version += 1
            elif a.kind is Kind.FORWARD:
                read[a.microbatch] = pinned.setdefault(a.microbatch // update_every, version)
            elif a.kind is Kind.BACKWARD:
                lags[r][a.microbatch] = version - read[a.microbatch]
    return lags


def peak_versions(unrolled: Schedule, update_every: int) -> dict[int, int]:
    """Per stage, the most distinct weight versions that micro-batches in flight read at once
    (what weight stashing must keep, the live weights included when in use)."""
    peaks: dict[int, int] = {}
    for r, ops in unrolled.actions.items():
        version, peak = 0, 0
        pinned: dict[int, int] = {}
        flight: dict[int, int] = {}
        for a in ops:
            if a.kind is Kind.STEP:
                version += 1
            elif a.kind is Kind.FORWARD:
                flight[a.microbatch] = pinned.setdefault(a.microbatch // update_every, version)
                peak = max(peak, len(set(flight.values())))
            elif a.kind is Kind.BACKWARD:
                flight.pop(a.microbatch)
        peaks[r] = peak
    return peaks
