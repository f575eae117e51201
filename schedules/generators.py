"""Schedule generators: one function per schedule, from (stages, micro-batches) to actions.

Communication is placed so that the schedule is deadlock-free even when every send blocks until
its receive is posted (the validator checks this): on each link, both ends list their messages in
the same order. The runtime may post a send earlier than listed (as soon as its tensor exists),
which can only remove waiting, never add a deadlock. GPipe and 1F1B place their messages by
hand; the interleaved and zero-bubble generators state only each rank's compute order and let
:func:`from_order` (:func:`schedules.messages.with_messages`) place the messages, as a new
synchronous generator should. Which generator a schedule name means, and what the rest of
pipetrain knows about it, is its entry in schedules/registry.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from schedules.action import Action, Kind, Schedule, check_chunks, check_sizes, step_tail
from schedules.messages import with_messages


def from_order(
    name: str,
    stages: int,
    microbatches: int,
    order: Callable[[int], list[Action]],
    placement: Sequence[int] | None = None,
) -> Schedule:
    """The schedule ``name`` whose rank r computes ``order(r)`` (its F, B and W actions in
    order); :func:`schedules.messages.with_messages` adds the sends, receives and the step. The
    interleaved and zero-bubble generators end here, and so can a new synchronous one."""
    where = tuple(range(stages)) if placement is None else tuple(placement)
    ranks = max(where, default=-1) + 1
    actions = with_messages(stages, where, {r: order(r) for r in range(ranks)})
    return Schedule(name, stages, microbatches, actions, where)


def _forward(stage: int, stages: int, mb: int) -> list[Action]:
    ops = []
    if stage > 0:
        ops.append(Action(Kind.RECV_ACT, stage, mb))
    ops.append(Action(Kind.FORWARD, stage, mb))
    if stage < stages - 1:
        ops.append(Action(Kind.SEND_ACT, stage, mb))
    return ops


def _backward(stage: int, stages: int, mb: int) -> list[Action]:
    ops = []
    if stage < stages - 1:
        ops.append(Action(Kind.RECV_GRAD, stage, mb))
    ops.append(Action(Kind.BACKWARD, stage, mb))
    if stage > 0:
        ops.append(Action(Kind.SEND_GRAD, stage, mb))
    return ops


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, then one optimizer step (holds m micro-batches)."""
    check_sizes(stages, microbatches)
    actions = {}
    for s in range(stages):
        ops = [a for i in range(microbatches) for a in _forward(s, stages, i)]
        ops += [a for i in range(microbatches) for a in _backward(s, stages, i)]
        ops += step_tail([s])
        actions[s] = tuple(ops)
    return Schedule("gpipe", stages, microbatches, actions)


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B with a flush (PipeDream-Flush): stage s warms up with min(m, p-1-s) forwards, then
    alternates one forward with one backward, then drains; it holds at most min(m, p-s)
    micro-batches' activations.

    In the steady phase stage s receives the gradient of micro-batch j before it sends the
    activation of micro-batch i: its successor sends that gradient before it receives that
    activation, so both ends of the link agree on the message order.
    """
    check_sizes(stages, microbatches)
    actions = {}
    for s in range(stages):
        warmup = min(stages - 1 - s, microbatches)
        ops = [a for i in range(warmup) for a in _forward(s, stages, i)]
        for j in range(microbatches - warmup):
            fwd = _forward(s, stages, warmup + j)
            bwd = _backward(s, stages, j)
            if s < stages - 1:
                # F(i), RECV_GRAD(j), SEND_ACT(i), B(j), SEND_GRAD(j)
                ops += fwd[:-1] + [bwd[0], fwd[-1]] + bwd[1:]
            else:
                ops += fwd + bwd
        for j in range(microbatches - warmup, microbatches):
            ops += _backward(s, stages, j)
        ops += step_tail([s])
        actions[s] = tuple(ops)
    return Schedule("1f1b", stages, microbatches, actions)


# -- interleaved 1F1B ---------------------------------------------------------------------------


def _interleaved_order(rank: int, ranks: int, microbatches: int, chunks: int) -> list[Action]:
    """Megatron-LM's order of one rank's forwards and backwards.

    The k-th forward of a rank runs micro-batch ``(k // (p*v)) * p + k % p`` through chunk
    ``(k // p) % v``: groups of p micro-batches go through chunk 0, then the same group through
    chunk 1, and so on. The k-th backward is the same with the chunks taken in reverse. The rank
    warms up with ``(p - rank - 1) * 2 + (v - 1) * p`` forwards (all of them if there are fewer),
    then alternates one forward with one backward, then drains the backwards.
    """
    p, v = ranks, chunks
    total = microbatches * v

    def item(kind: Kind, k: int) -> Action:
        chunk = (k // p) % v
        if kind is Kind.BACKWARD:
            chunk = v - 1 - chunk
        return Action(kind, chunk * p + rank, (k // (p * v)) * p + k % p)

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [item(Kind.FORWARD, k) for k in range(warmup)]
    for j in range(total - warmup):
        order += [item(Kind.FORWARD, warmup + j), item(Kind.BACKWARD, j)]
    order += [item(Kind.BACKWARD, j) for j in range(total - warmup, total)]
    return order


def interleaved(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM): each of p ranks holds v model
    chunks, stage ``c * p + r`` on rank r, so the pipeline has p*v stages and wraps from rank
    p-1 back to rank 0 between chunks.

    With per-chunk forward and backward times f and b, a rank idles (p-1)(f+b) per mini-batch,
    against 1F1B's (p-1)(v f + v b) for the same model cut into p stages: v times less bubble,
    paid for with v times more messages. Like Megatron, it needs the micro-batch count to be a
    multiple of the rank count, and it warms up with p-r-1 more forwards than the bubble needs:
    they hide a message round trip (with slow links the schedule stays near its zero-transfer
    time) at the cost of memory; rank r holds up to min(m v, 2(p-r-1) + (v-1)p + 1)
    micro-batch-chunks. With one chunk per rank this is 1F1B with that longer warm-up.
    """
    check_sizes(ranks, microbatches)
    check_chunks(chunks_per_rank)
    if microbatches % ranks:
        lower = microbatches // ranks * ranks
        fix = f"{lower} or {lower + ranks}" if lower else f"{ranks}"
        raise ValueError(
            "interleaved 1F1B needs the number of micro-batches to be a multiple of the number "
            f"of ranks (as in Megatron-LM): got microbatches={microbatches} with ranks={ranks}; "
            f"use {fix} micro-batches"
        )
    stages = ranks * chunks_per_rank
    return from_order(
        "interleaved", stages, microbatches,
        lambda r: _interleaved_order(r, ranks, microbatches, chunks_per_rank),
        placement=[s % ranks for s in range(stages)],
    )


def _looped_bfs_order(rank: int, ranks: int, microbatches: int, chunks: int) -> list[Action]:
    """Rank r's order under looped BFS: every micro-batch's forward through its first stage,
    then its next stage, ...; then the backwards, last stage first, micro-batches in order."""
    own = [c * ranks + rank for c in range(chunks)]
    order = [Action(Kind.FORWARD, s, i) for s in own for i in range(microbatches)]
    return order + [Action(Kind.BACKWARD, s, i) for s in reversed(own) for i in range(microbatches)]


def looped_bfs(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """Looped BFS (Lamy-Poirier, "Breadth-First Pipeline Parallelism", 2023; torch's
    ``ScheduleLoopedBFS``): v stages per rank placed as in interleaved 1F1B (stage ``c * p +
    r`` on rank r), each run breadth first: all m micro-batches through one local stage before
    the next, then the backwards the same way in reverse.

    Each stage's weights serve m micro-batches in a row (torch pairs it with FSDP for that:
    a sharded stage can gather once per pass, not once per micro-batch). Uniform, free transfers and
    m >= p give interleaved's bubble, (p-1)/(v m + p - 1); the price is GPipe's memory, every
    micro-batch's activations of every local stage (m v) before the first backward. Any
    micro-batch count runs (no multiple of p needed)."""
    check_sizes(ranks, microbatches)
    check_chunks(chunks_per_rank)
    stages = ranks * chunks_per_rank
    return from_order(
        "looped-bfs", stages, microbatches,
        lambda r: _looped_bfs_order(r, ranks, microbatches, chunks_per_rank),
        placement=[s % ranks for s in range(stages)],
    )


# -- zero bubble (Qi et al. 2023) ---------------------------------------------------------------


def _split_backward_order(stage: int, microbatches: int, warmup: int, delay: int) -> list[Action]:
    """A stage's compute order with the backward split into B and W.

    The stage forwards ``warmup`` micro-batches, then for each micro-batch j in turn: B(j), the
    W of micro-batch ``j - delay`` (none while j < delay), and the next forward if any is left;
    then the W's still owed. Delaying W keeps the B's, which the previous stage waits for, close
    together, and leaves the W's to fill what would otherwise be bubbles. A stage holds at most
    ``warmup`` micro-batches' full activations and ``warmup + delay`` micro-batches whose W is
    not done (both at most m).
    """
    m = microbatches
    warmup = min(warmup, m)
    order = [Action(Kind.FORWARD, stage, i) for i in range(warmup)]
    for j in range(m):
        order.append(Action(Kind.BACKWARD, stage, j))
        if j >= delay:
            order.append(Action(Kind.WEIGHT, stage, j - delay))
        if warmup + j < m:
            order.append(Action(Kind.FORWARD, stage, warmup + j))
    order += [Action(Kind.WEIGHT, stage, i) for i in range(max(m - delay, 0), m)]
    return order


def _split_backward(
    name: str,
    stages: int,
    microbatches: int,
    warmup: Callable[[int], int],
    delay: Callable[[int], int],
) -> Schedule:
    """The schedule whose stage s runs ``_split_backward_order`` with ``warmup(s)`` and
    ``delay(s)``, one stage per rank."""
    return from_order(
        name, stages, microbatches,
        lambda s: _split_backward_order(s, microbatches, warmup(s), delay(s)),
    )


def zero_bubble_h1(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's order of forwards
    and input-gradient backwards (B), with stage s delaying its weight-gradient passes (W) by s
    micro-batches.

    Stage s holds at most min(m, p-s) micro-batches' full activations, as in 1F1B, plus up to s
    whose W is pending (B frees all but what W needs). With uniform stages, free transfers,
    forward, input-gradient and weight times f, b, w and m >= p, every stage idles
    (p-1)(f+b-w) when w <= min(f, b) (in general (p-1) max(f, b, f+b-w)), against 1F1B's
    (p-1)(f+b+w): a third of it when f = b = w.
    """
    check_sizes(stages, microbatches)
    return _split_backward(
        "zb-h1", stages, microbatches, warmup=lambda s: stages - s, delay=lambda s: s
    )


def zero_bubble_h2(stages: int, microbatches: int) -> Schedule:
    """ZB-H2 (Qi et al. 2023): stage s warms up with 2(p-s)-1 forwards, filling the bubble
    before its first backward, and delays its W's by 2s micro-batches, so that in the drain the
    B's run back to back and the W's fill the rest.

    With uniform stages, free transfers, f = b = w and m >= 2p-1, every stage computes without
    a gap from its first forward (at s*f) to its last W: the stages' busy spans form a
    parallelogram, so the step takes m(f+b+w) + (p-1)f, the least any schedule can, and
    consecutive mini-batches could overlap with no bubble at all. The price is memory: stage s
    holds up to min(m, 2(p-s)-1) full activations and min(m, 2p-1) micro-batches whose W is
    pending.
    """
    check_sizes(stages, microbatches)
    return _split_backward(
        "zb-h2",
        stages,
        microbatches,
        warmup=lambda s: 2 * (stages - s) - 1,
        delay=lambda s: 2 * s,
    )
