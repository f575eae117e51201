"""Zero-bubble schedules over several stages per rank, ordered by list scheduling.

:func:`list_scheduled` orders each rank's work by list scheduling on unit times (F = B = W):
at each tick every rank runs the most urgent action whose inputs are done, a backward before a
forward before a weight pass, the oldest micro-batch first, a forward only while the rank holds
fewer micro-batch-stages not yet freed by their W than 1F1B's first rank would (p micro-batches
of all its v stages: p v). The weight passes fill what would be bubbles. Two placements use it:

- :func:`zbv`, ZB-V: 2p stages folded into a V, rank r holding stages r and 2p-1-r, so the
  first and last stage share rank 0 and the loss's backward starts where the forward began
  (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; torch's
  ``ScheduleZBVZeroBubble``);
- :func:`interleaved_zb`: v stages per rank placed as interleaved 1F1B's, stage c p + r on
  rank r (torch's ``ScheduleInterleavedZeroBubble``).
"""

from __future__ import annotations

from collections import deque

from schedules.action import Action, Kind, Schedule, check_chunks, check_sizes, check_v
from schedules.generators import from_order
from schedules.messages import inputs

_URGENCY = {Kind.BACKWARD: 0, Kind.FORWARD: 1, Kind.WEIGHT: 2}


def v_placement(ranks: int) -> tuple[int, ...]:
    """Stage s's rank in a V over ``ranks`` ranks: s going down, 2p-1-s coming back up."""
    return tuple(s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks))


def _list_schedule(placement: tuple[int, ...], microbatches: int, limit: int) -> list[list[Action]]:
    """Each rank's compute order under unit-time list scheduling (see the module docstring).
    Each (stage, kind) runs its micro-batches in order, so only the head of each such queue
    can be the most urgent ready action of its rank."""
    stages, ranks = len(placement), max(placement) + 1
    queues = [
        [deque(Action(k, s, i) for i in range(microbatches)) for s in range(stages)
         if placement[s] == r for k in _URGENCY]
        for r in range(ranks)
    ]
    done: set[Action] = set()
    held = [0] * ranks
    orders: list[list[Action]] = [[] for _ in range(ranks)]
    while any(any(q) for q in queues):
        chosen = []
        for r in range(ranks):
            ready = [q for q in queues[r] if q and all(d in done for d in inputs(q[0], stages))
                     and (q[0].kind is not Kind.FORWARD or held[r] < limit)]
            if ready:
                chosen.append(min(ready, key=lambda q: _rank_key(q[0])).popleft())
        if not chosen:
            raise RuntimeError(f"list scheduling stalled under {limit} held per rank")
        for action in chosen:
            r = placement[action.stage]
            orders[r].append(action)
            held[r] += {Kind.FORWARD: 1, Kind.WEIGHT: -1}.get(action.kind, 0)
        done.update(chosen)
    return orders


def _rank_key(action: Action) -> tuple[int, int, int]:
    """Urgency: a backward before a forward before a weight pass, then the oldest micro-batch,
    then the stage nearer the loss."""
    return _URGENCY[action.kind], action.microbatch, -action.stage


def list_scheduled(name: str, placement: tuple[int, ...], microbatches: int) -> Schedule:
    """The schedule ``name`` with the backward split, its stages on ``placement``'s ranks,
    each rank's order by :func:`_list_schedule` under 1F1B's first-rank memory."""
    orders = _list_schedule(placement, microbatches, limit=len(placement))
    return from_order(name, len(placement), microbatches, orders.__getitem__, placement)


def zbv(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """ZB-V: two stages per rank in a V. With f = b = w and free transfers its step is the
    least any schedule can take, 6m + p - 1 times f, for m >= p and p <= 4 (within 2 f of it
    up to p = 6), at 1F1B's activation memory (tests/schedules/test_schedule_list_scheduling.py)."""
    check_sizes(ranks, microbatches)
    check_v("zbv", chunks_per_rank)
    return list_scheduled("zbv", v_placement(ranks), microbatches)


def interleaved_zb(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """Interleaved zero bubble: v stages per rank, stage c p + r on rank r, the backward split.
    Any micro-batch count runs."""
    check_sizes(ranks, microbatches)
    check_chunks(chunks_per_rank)
    stages = ranks * chunks_per_rank
    return list_scheduled("interleaved-zb", tuple(s % ranks for s in range(stages)), microbatches)
