"""V-Half and V-Min: V schedules with controllable memory (Qi et al., "Pipeline Parallelism
with Controllable Memory", NeurIPS 2024, arXiv 2405.15362), built from the paper's V-shape
building blocks.

Both fold 2p stages into a V over p ranks (rank r: stages r and 2p-1-r, as zbv) and split the
backward. Built the paper's way, not by list scheduling under a lower memory limit: a greedy
list scheduler capped below zbv's 2p micro-batch-stages per rank fills the cap with forwards
of the stage going down and stalls (every cap below 2p does once m >= 2p), whereas a building
block fixes how long each micro-batch's activations live, and that lifespan is what sets the
peak. The construction, on unit times (every F, B and W one slot):

1. Building block: micro-batch 0's four passes per rank, F down, F up, B up, B down, at the
   slots of :func:`_v_half_block` or :func:`_v_min_block`; micro-batch i repeats it 6 i
   slots later (a rank's six passes per micro-batch), and every W takes the first free slot
   after its B (oldest B first). The blocks' offsets keep a rank's four passes in distinct
   slots modulo 6, so repeated blocks never collide.
2. The peak: the most micro-batch-stages a rank holds in that plan (a forward stores one, its
   W frees it: ``simulate``'s ``peak_inflight``), about 1/2 (V-Half) or 1/3 (V-Min) of
   1F1B's.
3. Squeezing the warm-up and cool-down: in planned order, each F and B moves to the earliest
   free slot after its inputs where its rank, the Ws placed again, stays under that peak; the
   Ws then take the free slots as in 1. Nothing moves later, so the steady phase keeps the
   block's rhythm and the ends lose most of their idle slots. (The paper reorders the ends
   greedily too; this one keeps the bubbles at or under theirs, see the tests.)

Each rank's order of the squeezed slots goes to :func:`schedules.generators.from_order`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from schedules.action import Action, Kind, Schedule, check_sizes, check_v
from schedules.generators import from_order
from schedules.list_scheduling import v_placement
from schedules.messages import inputs

_INTERVAL = 6  # a rank's passes per micro-batch at unit times: F, B and W of each of its stages

Block = Callable[[int, int], tuple[int, int, int, int]]
"""(ranks, rank) -> the slots of micro-batch 0's F down, F up, B up and B down on that rank."""


def _v_min_block(ranks: int, rank: int) -> tuple[int, int, int, int]:
    """V-Min's block: forwards one slot apart down and up the V, the backwards right after;
    rank 0 holds a micro-batch for about 4p of every 6-slot interval's slots, a third of
    1F1B's lifespan. Two slots more before the backwards where 3 divides p avoid a collision."""
    p, gap = ranks, 2 if ranks % 3 == 0 else 0
    return rank, 2 * p - 1 - rank, 2 * p + gap + rank, 4 * p + gap - 1 - rank


def _v_half_block(ranks: int, rank: int) -> tuple[int, int, int, int]:
    """V-Half's block: forwards two slots apart going down, one coming up, backwards two apart
    going up and one coming down; a lifespan of about 6p slots, half of 1F1B's. Three slots
    more before the backwards where p is even avoid a collision."""
    p, gap = ranks, 3 if ranks % 2 == 0 else 0
    return 2 * rank, 3 * p - 2 - rank, 3 * p - 1 + gap + 2 * rank, 6 * p - 2 + gap - rank


def _repeated(block: Block, ranks: int, microbatches: int) -> dict[Action, int]:
    """The slot of every F and B when each micro-batch repeats the block 6 slots later."""
    slots = {}
    for r in range(ranks):
        up = 2 * ranks - 1 - r
        passes = ((Kind.FORWARD, r), (Kind.FORWARD, up), (Kind.BACKWARD, up), (Kind.BACKWARD, r))
        for (kind, stage), offset in zip(passes, block(ranks, r), strict=True):
            for i in range(microbatches):
                slots[Action(kind, stage, i)] = offset + _INTERVAL * i
    return slots


def _with_weights(slots: dict[Action, int]) -> dict[Action, int]:
    """One rank's F and B ``slots`` with each B's W in the first free slot after it, the
    oldest B's first."""
    taken = set(slots.values())
    backwards = deque(sorted((t, a) for a, t in slots.items() if a.kind is Kind.BACKWARD))
    placed, pending, t = dict(slots), deque[Action](), 0
    while backwards or pending:
        while backwards and backwards[0][0] < t:
            pending.append(backwards.popleft()[1])
        if pending and t not in taken:
            done = pending.popleft()
            placed[Action(Kind.WEIGHT, done.stage, done.microbatch)] = t
        t += 1
    return placed


def _peak(forwards: list[int], backwards: list[int]) -> int:
    """The most micro-batch-stages one rank holds at once with its F and B at these slots and
    the Ws placed as :func:`_with_weights` places them (F stores, W frees): the k-th B's W
    takes the first free slot after both that B and the (k-1)-th W. On slot numbers alone, as
    the squeeze asks it for every slot it tries."""
    taken = set(forwards)
    taken.update(backwards)
    weights, last = [], -1
    for b in sorted(backwards):
        t = max(b, last) + 1
        while t in taken:
            t += 1
        weights.append(t)
        last = t
    if not forwards:
        return 0
    stored = np.arange(1, len(forwards) + 1) - np.searchsorted(weights, sorted(forwards))
    return int(stored.max())


def _passes(rank: dict[Action, int], kind: Kind) -> dict[Action, int]:
    """One rank's passes of ``kind`` and their slots."""
    return {a: t for a, t in rank.items() if a.kind is kind}


def _waits(action: Action, stages: int) -> list[Action]:
    """What ``action`` waits for: its inputs and its stage's same pass of the micro-batch
    before (each stage keeps its micro-batches in order)."""
    before = [Action(action.kind, action.stage, action.microbatch - 1)] if action.microbatch else []
    return inputs(action, stages) + before


def _squeezed(slots: dict[Action, int], placement: tuple[int, ...]) -> list[dict[Action, int]]:
    """Each rank's F, B and W slots after moving every F and B, in planned order, to the
    earliest free slot after what it waits for that keeps its rank under the plan's peak."""
    ranks, stages = max(placement) + 1, len(placement)
    own = [{a: t for a, t in slots.items() if placement[a.stage] == r} for r in range(ranks)]
    kinds = [{kind: _passes(rank, kind) for kind in (Kind.FORWARD, Kind.BACKWARD)}
             for rank in own]
    limit = max(_peak(list(k[Kind.FORWARD].values()), list(k[Kind.BACKWARD].values()))
                for k in kinds)
    slots = dict(slots)
    for action in sorted(slots, key=lambda a: (slots[a], placement[a.stage])):
        rank, planned = own[placement[action.stage]], slots[action]
        passes = kinds[placement[action.stage]]
        start = max((slots[d] + 1 for d in _waits(action, stages)), default=0)
        if start >= planned:
            continue
        taken = set(rank.values())
        tries = [t for t in range(start, planned) if t not in taken]
        if not tries:
            continue
        forwards = [t for a, t in passes[Kind.FORWARD].items() if a is not action]
        backwards = [t for a, t in passes[Kind.BACKWARD].items() if a is not action]
        moved = forwards if action.kind is Kind.FORWARD else backwards
        for t in tries:
            moved.append(t)
            if _peak(forwards, backwards) <= limit:
                slots[action] = rank[action] = passes[action.kind][action] = t
                break
            moved.pop()
    return [_with_weights(rank) for rank in own]


def _v_schedule(name: str, block: Block, ranks: int, microbatches: int) -> Schedule:
    """The V schedule ``name`` built from ``block`` (the module docstring's steps)."""
    placement = v_placement(ranks)
    timed = _squeezed(_repeated(block, ranks, microbatches), placement)
    orders = [sorted(rank, key=rank.__getitem__) for rank in timed]
    return from_order(name, 2 * ranks, microbatches, orders.__getitem__, placement)


def v_half(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """V-Half: a rank holds at most 2 floor((p+2)/2) micro-batch-stages (about half of 1F1B's
    2p, counted in stages half as deep), for a bubble at most half of 1F1B's when F = B = W.
    Any micro-batch count runs."""
    check_sizes(ranks, microbatches)
    check_v("v-half", chunks_per_rank)
    return _v_schedule("v-half", _v_half_block, ranks, microbatches)


def v_min(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """V-Min: a rank holds at most 2 floor((p+4)/3) micro-batch-stages (about a third of
    1F1B's), for a bubble at most two thirds of 1F1B's when F = B = W. Any micro-batch count
    runs."""
    check_sizes(ranks, microbatches)
    check_v("v-min", chunks_per_rank)
    return _v_schedule("v-min", _v_min_block, ranks, microbatches)
