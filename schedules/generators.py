"""Schedule generators: one function per schedule name, from (stages, micro-batches) to actions.

Communication is placed so that the schedule is deadlock-free even when every send blocks until
its receive is posted (the validator checks this): on each link, both ends list their messages in
the same order. The runtime may post a send earlier than listed (as soon as its tensor exists),
which can only remove waiting, never add a deadlock.
"""

from __future__ import annotations

from collections.abc import Callable

from schedules.action import Action, Kind, Schedule


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


def _check(stages: int, microbatches: int) -> None:
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got stages={stages}")
    if microbatches < 1:
        raise ValueError(f"a mini-batch needs at least one micro-batch, got {microbatches}")


def gpipe(stages: int, microbatches: int) -> Schedule:
    """GPipe: all forwards, then all backwards, then one optimizer step (holds m micro-batches)."""
    _check(stages, microbatches)
    actions = {}
    for s in range(stages):
        ops = [a for i in range(microbatches) for a in _forward(s, stages, i)]
        ops += [a for i in range(microbatches) for a in _backward(s, stages, i)]
        ops.append(Action(Kind.STEP, s))
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
    _check(stages, microbatches)
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
        ops.append(Action(Kind.STEP, s))
        actions[s] = tuple(ops)
    return Schedule("1f1b", stages, microbatches, actions)


GENERATORS: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
}


def build(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule called ``name`` for ``stages`` stages and ``microbatches`` micro-batches."""
    try:
        generator = GENERATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {sorted(GENERATORS)}"
        ) from None
    return generator(stages, microbatches)
