"""Independent oracles for the schedule tests.

Nothing here reuses the algorithms of ``schedules`` (only its data types): the rendezvous
executor explores the global state graph, the timing model is a longest-path computation over
an explicit dependency graph, and random valid schedules are projections of a random global
execution trace. All of them also handle several stages per rank (a ``placement`` stage -> rank;
hand-offs on one rank are no messages) and split backwards (W after B).
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from schedules.action import STEP_KINDS, Action, Kind, Schedule

F, B, W = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT
SA, RA, SG, RG = Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD
STEP = Kind.STEP
COMM = frozenset({SA, RA, SG, RG})

# kind -> (offset of the peer stage, kind the peer must be executing to complete the message)
_PARTNER = {SA: (+1, RA), RA: (-1, SA), SG: (-1, RG), RG: (+1, SG)}


def partner(a: Action) -> Action:
    offset, kind = _PARTNER[a.kind]
    return Action(kind, a.stage + offset, a.microbatch)


def step(stage: int) -> Action:
    return Action(STEP, stage)


def replace_stage(schedule: Schedule, stage: int, ops: Iterable[Action]) -> Schedule:
    """``schedule`` with the list of rank ``stage`` (the stage, under the identity placement)
    replaced."""
    actions = dict(schedule.actions)
    actions[stage] = tuple(ops)
    return Schedule(
        schedule.name, schedule.stages, schedule.microbatches, actions, schedule.placement
    )


def local_constraints(ops: Sequence[Action]) -> set[tuple[Action, Action]]:
    """(x, y) pairs of one rank's actions where x must come before y (the documented rules):
    per stage and micro-batch, and between two stages of the rank when they are neighbours
    (then the rank's list holds their in-memory hand-off)."""
    present = set(ops)
    pairs = set()
    for a in present:
        s, i = a.stage, a.microbatch
        rules = {
            RA: [(F, s)],
            F: [(SA, s), (B, s), (F, s + 1)],
            RG: [(B, s)],
            B: [(SG, s), (W, s), (B, s - 1)],
        }.get(a.kind, [])
        for kind, where in rules:
            other = Action(kind, where, i)
            if other in present:
                pairs.add((a, other))
        if a.kind not in STEP_KINDS:
            pairs.update((a, x) for x in present if x.kind in STEP_KINDS)
        else:  # a rank's step: its REDUCEs, its AGREE, its STEPs, each in ascending stage order
            pairs.update((a, x) for x in present if x.kind in STEP_KINDS and _tail(x) > _tail(a))
    return pairs


_TAIL = {Kind.REDUCE: 0, Kind.AGREE: 1, STEP: 2}


def _tail(a: Action) -> tuple[int, int]:
    return _TAIL[a.kind], a.stage


def random_linear_extension(ops: Sequence[Action], rng: random.Random) -> list[Action]:
    """A uniformly chosen next action among those whose predecessors are placed, repeatedly."""
    pairs = local_constraints(ops)
    preds: dict[Action, set[Action]] = {a: set() for a in ops}
    for x, y in pairs:
        preds[y].add(x)
    placed: list[Action] = []
    done: set[Action] = set()
    remaining = list(ops)
    while remaining:
        ready = [a for a in remaining if preds[a] <= done]
        pick = rng.choice(ready)
        remaining.remove(pick)
        placed.append(pick)
        done.add(pick)
    return placed


def random_local_swaps(ops: Sequence[Action], rng: random.Random, swaps: int) -> list[Action]:
    """Swap adjacent actions ``swaps`` times where no local rule forbids it."""
    out = list(ops)
    pairs = local_constraints(ops)
    for _ in range(swaps):
        candidates = [k for k in range(len(out) - 1) if (out[k], out[k + 1]) not in pairs]
        if not candidates:
            break
        k = rng.choice(candidates)
        out[k], out[k + 1] = out[k + 1], out[k]
    return out


def respects_local_order(ops: Sequence[Action]) -> bool:
    pos = {a: k for k, a in enumerate(ops)}
    return all(pos[x] < pos[y] for x, y in local_constraints(ops))


def memory_bounded_order(limit: int, m: int) -> list[tuple[Kind, int]]:
    """Independent statement of 1F1B: forward while fewer than ``limit`` micro-batches are held
    (and forwards remain), otherwise backward the oldest one held."""
    order, nf, nb = [], 0, 0
    while nb < m:
        if nf < m and nf - nb < limit:
            order.append((F, nf))
            nf += 1
        else:
            order.append((B, nb))
            nb += 1
    return order


def rendezvous_terminal_states(
    actions: Mapping[int, Sequence[Action]], placement: Sequence[int] | None = None
) -> set[tuple[int, ...]]:
    """Explore every interleaving of the ranks with blocking sends and receives.

    A state is the tuple of per-rank cursors. A rank whose next action is local moves alone;
    a send and its receive move together when both are the next actions of their ranks.
    ``placement[stage]`` is a stage's rank (default: the stage itself).
    Returns every reachable state with no move left.
    """
    ranks = sorted(actions)
    lists = [list(actions[r]) for r in ranks]
    where = list(placement) if placement is not None else None

    def rank_index(stage: int) -> int | None:
        rank = stage if where is None else (where[stage] if 0 <= stage < len(where) else None)
        return ranks.index(rank) if rank in ranks else None

    def successors(state: tuple[int, ...]) -> list[tuple[int, ...]]:
        out = []
        for k, cur in enumerate(state):
            if cur == len(lists[k]):
                continue
            a = lists[k][cur]
            if a.kind not in COMM:
                nxt = list(state)
                nxt[k] += 1
                out.append(tuple(nxt))
                continue
            want = partner(a)
            j = rank_index(want.stage)
            if j is not None and j != k and state[j] < len(lists[j]) and lists[j][state[j]] == want:
                nxt = list(state)
                nxt[k] += 1
                nxt[j] += 1
                out.append(tuple(nxt))
        return out

    start = tuple(0 for _ in lists)
    seen = {start}
    frontier = [start]
    terminal = set()
    while frontier:
        state = frontier.pop()
        nxt = successors(state)
        if not nxt:
            terminal.add(state)
        for n in nxt:
            if n not in seen:
                seen.add(n)
                frontier.append(n)
    return terminal


def rendezvous_stuck(schedule: Schedule) -> dict[int, tuple[int, Action]]:
    """Ranks left unfinished by the rendezvous execution: rank -> (position, next action)."""
    terminal = rendezvous_terminal_states(schedule.actions, schedule.placement)
    assert len(terminal) == 1, f"rendezvous execution is not confluent: {terminal}"
    (state,) = terminal
    return {
        s: (cur, schedule.actions[s][cur])
        for s, cur in zip(sorted(schedule.actions), state, strict=True)
        if cur < len(schedule.actions[s])
    }


def random_valid_schedule(
    p: int,
    m: int,
    rng: random.Random,
    name: str = "random",
    placement: Sequence[int] | None = None,
    weight: bool = False,
) -> Schedule:
    """Project a random global execution (compute, or a send with its receive) onto ranks.

    ``placement[stage]`` is the stage's rank (default one stage per rank); between stages on
    one rank the consumer just needs the producer's compute done, with no message. With
    ``weight`` every stage also does a W per micro-batch after its B. The trace itself
    witnesses that the result runs to completion with rendezvous sends.
    """
    rank = list(placement) if placement is not None else list(range(p))
    ops: dict[int, list[Action]] = {r: [] for r in sorted(set(rank))}
    done: set[Action] = set()

    def arrived(kind: Kind, source: int, target: int, i: int) -> bool:
        """Whether what ``target`` needs from ``source`` for micro-batch i is there."""
        if rank[source] == rank[target]:
            return Action(F if kind is RA else B, source, i) in done
        return Action(kind, target, i) in done

    while True:
        events: list[tuple[Action, ...]] = []
        for s in range(p):
            for i in range(m):
                fwd, bwd, wgt = Action(F, s, i), Action(B, s, i), Action(W, s, i)
                if fwd not in done and (s == 0 or arrived(RA, s - 1, s, i)):
                    events.append((fwd,))
                if fwd in done and bwd not in done and (s == p - 1 or arrived(RG, s + 1, s, i)):
                    events.append((bwd,))
                if weight and bwd in done and wgt not in done:
                    events.append((wgt,))
                remote_next = s < p - 1 and rank[s] != rank[s + 1]
                if remote_next and fwd in done and Action(SA, s, i) not in done:
                    events.append((Action(SA, s, i), Action(RA, s + 1, i)))
                remote_prev = s > 0 and rank[s] != rank[s - 1]
                if remote_prev and bwd in done and Action(SG, s, i) not in done:
                    events.append((Action(SG, s, i), Action(RG, s - 1, i)))
        if not events:
            break
        for a in rng.choice(events):
            done.add(a)
            ops[rank[a.stage]].append(a)
    steps = {r: [step(s) for s in range(p) if rank[s] == r] for r in ops}
    return Schedule(name, p, m, {r: (*ops[r], *steps[r]) for r in ops}, tuple(rank))


def longest_path_times(
    schedule: Schedule,
    fwd: Sequence[float],
    bwd: Sequence[float],
    link: Sequence[float],
    opt: Sequence[float],
    wgt: Sequence[float] | None = None,
    durations: Mapping[Action, float] | None = None,
) -> dict[tuple[int, int], float]:
    """Completion time of every (rank, position), by Kahn's algorithm on the dependency graph.

    Model (documented by the simulator): a rank runs its list in order; compute and STEP take
    their stage's cost (W: ``wgt``) or, where ``durations`` names them, their own; a send is
    free and its message leaves when the compute that produced the tensor ends; a receive
    completes when that message has crossed the link. A compute that takes its input from a
    stage on its own rank waits for that compute (no link).
    """
    cost = {F: fwd, B: bwd, W: wgt or [0.0] * schedule.stages, STEP: opt}
    where = {a: (r, k) for r, ops in schedule.actions.items() for k, a in enumerate(ops)}
    rank = schedule.placement
    Node = tuple[int, int]
    preds: dict[Node, list[tuple[Node, float]]] = {n: [] for n in where.values()}
    for r, k in list(preds):
        a = schedule.actions[r][k]
        s, i = a.stage, a.microbatch
        if k > 0:
            preds[(r, k)].append(((r, k - 1), 0.0))
        if a.kind in (RA, RG):
            src_stage = s - 1 if a.kind is RA else s + 1
            source = Action(F if a.kind is RA else B, src_stage, i)
            preds[(r, k)].append((where[source], link[min(s, src_stage)]))
        if a.kind is F and s > 0 and rank[s - 1] == r:
            preds[(r, k)].append((where[Action(F, s - 1, i)], 0.0))
        if a.kind is B and s < schedule.stages - 1 and rank[s + 1] == r:
            preds[(r, k)].append((where[Action(B, s + 1, i)], 0.0))
    succ: dict[Node, list[Node]] = {n: [] for n in preds}
    indeg = {n: len(v) for n, v in preds.items()}
    for n, v in preds.items():
        for src, _ in v:
            succ[src].append(n)
    time: dict[Node, float] = {}
    queue = deque(n for n, d in indeg.items() if d == 0)
    while queue:
        n = queue.popleft()
        r, k = n
        a = schedule.actions[r][k]
        ready = max((time[src] + w for src, w in preds[n]), default=0.0)
        took = cost[a.kind][a.stage] if a.kind in cost else 0.0
        time[n] = ready + (durations or {}).get(a, took)
        for nxt in succ[n]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                queue.append(nxt)
    assert len(time) == len(preds), "dependency graph has a cycle"
    return time
