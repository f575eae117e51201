"""Independent oracles for the schedule tests.

Nothing here reuses the algorithms of ``schedules`` (only its data types): the rendezvous
executor explores the global state graph, the timing model is a longest-path computation over
an explicit dependency graph, and random valid schedules are projections of a random global
execution trace.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterable, Mapping, Sequence

from schedules.action import Action, Kind, Schedule

F, B = Kind.FORWARD, Kind.BACKWARD
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
    actions = dict(schedule.actions)
    actions[stage] = tuple(ops)
    return Schedule(schedule.name, schedule.stages, schedule.microbatches, actions)


def local_constraints(ops: Sequence[Action]) -> set[tuple[Action, Action]]:
    """(x, y) pairs of one stage's actions where x must come before y (the documented rules)."""
    present = set(ops)
    pairs = set()
    for a in present:
        s, i = a.stage, a.microbatch
        rules = {
            RA: [F],
            F: [SA, B],
            RG: [B],
            B: [SG],
        }.get(a.kind, [])
        for kind in rules:
            other = Action(kind, s, i)
            if other in present:
                pairs.add((a, other))
        if a.kind is not STEP and step(s) in present:
            pairs.add((a, step(s)))
    return pairs


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


def rendezvous_terminal_states(actions: Mapping[int, Sequence[Action]]) -> set[tuple[int, ...]]:
    """Explore every interleaving of the stages with blocking sends and receives.

    A state is the tuple of per-stage cursors. A stage whose next action is local moves alone;
    a send and its receive move together when both are the next actions of their stages.
    Returns every reachable state with no move left.
    """
    stages = sorted(actions)
    lists = [list(actions[s]) for s in stages]
    index = {s: k for k, s in enumerate(stages)}

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
            j = index.get(want.stage)
            if j is not None and state[j] < len(lists[j]) and lists[j][state[j]] == want:
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
    """Stages left unfinished by the rendezvous execution: stage -> (position, next action)."""
    terminal = rendezvous_terminal_states(schedule.actions)
    assert len(terminal) == 1, f"rendezvous execution is not confluent: {terminal}"
    (state,) = terminal
    return {
        s: (cur, schedule.actions[s][cur])
        for s, cur in zip(sorted(schedule.actions), state, strict=True)
        if cur < len(schedule.actions[s])
    }


def random_valid_schedule(p: int, m: int, rng: random.Random, name: str = "random") -> Schedule:
    """Project a random global execution (compute, or a send with its receive) onto stages.

    The trace itself witnesses that the result runs to completion with rendezvous sends.
    """
    ops: dict[int, list[Action]] = {s: [] for s in range(p)}
    done: set[Action] = set()
    while True:
        events: list[tuple[Action, ...]] = []
        for s in range(p):
            for i in range(m):
                fwd, bwd = Action(F, s, i), Action(B, s, i)
                if fwd not in done and (s == 0 or Action(RA, s, i) in done):
                    events.append((fwd,))
                if fwd in done and bwd not in done and (s == p - 1 or Action(RG, s, i) in done):
                    events.append((bwd,))
                if s < p - 1 and fwd in done and Action(SA, s, i) not in done:
                    events.append((Action(SA, s, i), Action(RA, s + 1, i)))
                if s > 0 and bwd in done and Action(SG, s, i) not in done:
                    events.append((Action(SG, s, i), Action(RG, s - 1, i)))
        if not events:
            break
        for a in rng.choice(events):
            done.add(a)
            ops[a.stage].append(a)
    return Schedule(name, p, m, {s: (*ops[s], step(s)) for s in range(p)})


def longest_path_times(
    schedule: Schedule,
    fwd: Sequence[float],
    bwd: Sequence[float],
    link: Sequence[float],
    opt: Sequence[float],
) -> dict[tuple[int, int], float]:
    """Completion time of every (stage, position), by Kahn's algorithm on the dependency graph.

    Model (documented by the simulator): a stage runs its list in order; compute and STEP take
    their cost; a send is free and its message leaves when the compute that produced the tensor
    ends; a receive completes when that message has crossed the link.
    """
    cost = {F: fwd, B: bwd, STEP: opt}
    where = {a: (s, k) for s, ops in schedule.actions.items() for k, a in enumerate(ops)}
    Node = tuple[int, int]
    preds: dict[Node, list[tuple[Node, float]]] = {n: [] for n in where.values()}
    for s, k in list(preds):
        a = schedule.actions[s][k]
        if k > 0:
            preds[(s, k)].append(((s, k - 1), 0.0))
        if a.kind in (RA, RG):
            src_stage = s - 1 if a.kind is RA else s + 1
            source = Action(F if a.kind is RA else B, src_stage, a.microbatch)
            preds[(s, k)].append((where[source], link[min(s, src_stage)]))
    succ: dict[Node, list[Node]] = {n: [] for n in preds}
    indeg = {n: len(v) for n, v in preds.items()}
    for n, v in preds.items():
        for src, _ in v:
            succ[src].append(n)
    time: dict[Node, float] = {}
    queue = deque(n for n, d in indeg.items() if d == 0)
    while queue:
        n = queue.popleft()
        s, k = n
        a = schedule.actions[s][k]
        ready = max((time[src] + w for src, w in preds[n]), default=0.0)
        time[n] = ready + (cost[a.kind][s] if a.kind in cost else 0.0)
        for nxt in succ[n]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                queue.append(nxt)
    assert len(time) == len(preds), "dependency graph has a cycle"
    return time
