"""Place the messages of a schedule given only each rank's order of compute.

Hand-writing where every SEND and RECV goes is what keeps GPipe and 1F1B deadlock-free, but it
does not scale to interleaved or zero-bubble orders. Instead, ``with_messages`` runs the compute
orders once, in lock-step rounds (every rank does at most one compute per round, as if all
computes took the same time), and writes down one global trace. Whenever a compute needs a
tensor from another rank, the send and its receive enter the trace together, just before that
compute. Each rank's list is its projection of the trace, so:

* the trace itself is a run in which every send meets its receive (rendezvous), so the lists
  cannot deadlock even with blocking sends (the validator checks it again);
* each receive sits right before the compute that needs it (the runtime prefetches receives, and
  the simulator's timing is that of the compute dependencies alone);
* on every pair of ranks both ends list their messages in the same order.

A send may be listed some actions after the compute that produced its tensor; the runtime posts
it when that compute ends anyway. Hand-offs between stages on the same rank get no message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from schedules.action import Action, Kind, step_tail

F, B = Kind.FORWARD, Kind.BACKWARD


def inputs(a: Action, stages: int) -> list[Action]:
    """The computes whose results ``a`` consumes (on any rank): the previous stage's F for an F,
    the same stage's F and the next stage's B for a B, the same stage's B for a W."""
    s, i = a.stage, a.microbatch
    if a.kind is F:
        return [Action(F, s - 1, i)] if s > 0 else []
    if a.kind is B:
        upstream = [Action(B, s + 1, i)] if s < stages - 1 else []
        return [Action(F, s, i), *upstream]
    return [Action(B, s, i)]


def _message(source: Action, consumer: Action) -> tuple[Action, Action]:
    """The (send, receive) pair that carries ``source``'s tensor to ``consumer``'s stage."""
    i = source.microbatch
    if source.kind is F:
        return Action(Kind.SEND_ACT, source.stage, i), Action(Kind.RECV_ACT, consumer.stage, i)
    return Action(Kind.SEND_GRAD, source.stage, i), Action(Kind.RECV_GRAD, consumer.stage, i)


def with_messages(
    stages: int,
    placement: Sequence[int],
    compute: Mapping[int, Sequence[Action]],
) -> dict[int, tuple[Action, ...]]:
    """Each rank's compute order with its sends, receives and closing step (REDUCE, AGREE,
    STEP: :func:`schedules.action.step_tail`) filled in.

    ``compute[r]`` is rank r's F/B/W actions in order. Raises ValueError if the orders can
    never finish (a compute waits on one that its own rank only reaches later).
    """
    lists: dict[int, list[Action]] = {r: [] for r in compute}
    cursor = dict.fromkeys(compute, 0)
    finished: set[Action] = set()
    remaining = sum(len(ops) for ops in compute.values())
    while remaining:
        ready = []
        for r, ops in compute.items():
            if cursor[r] < len(ops) and all(x in finished for x in inputs(ops[cursor[r]], stages)):
                ready.append(ops[cursor[r]])
        if not ready:
            heads = [ops[cursor[r]] for r, ops in compute.items() if cursor[r] < len(ops)]
            stuck = ", ".join(map(str, heads))
            raise ValueError(f"compute orders can never finish; stuck at {stuck}")
        for a in ready:  # one round: results become usable in the next round
            rank = placement[a.stage]
            for source in inputs(a, stages):
                if placement[source.stage] != rank:
                    send, recv = _message(source, a)
                    lists[placement[source.stage]].append(send)
                    lists[rank].append(recv)
            lists[rank].append(a)
            cursor[rank] += 1
            remaining -= 1
        finished.update(ready)
    for r in lists:
        lists[r] += step_tail([s for s, where in enumerate(placement) if where == r])
    return {r: tuple(ops) for r, ops in lists.items()}
