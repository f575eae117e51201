"""The one representation of a pipeline schedule: per rank, an ordered list of actions.

The generators build it, the validator checks it, the simulator times it and the runtime executes
it. Nothing else encodes the order of work.

Stages and ranks. The model is cut into ``stages`` consecutive pieces; stage s feeds stage s+1.
A schedule places every stage on a rank (a device/process): ``placement[s]`` is the rank of
stage s. By default the placement is the identity (rank s runs stage s), and then "rank" and
"stage" are the same number everywhere. Interleaved schedules put several stages (virtual
stages, model chunks) on one rank; ``actions`` is keyed by rank and lists the work of all its
stages in the order the rank does it.

Messages. Only hand-offs between stages on *different* ranks are messages: stage s sends its
activation to s+1 (SEND_ACT on s's rank, RECV_ACT on s+1's) and s+1 sends the gradient back
(SEND_GRAD, RECV_GRAD). When s and s+1 share a rank the lists hold no SEND/RECV for that
boundary at all: the rank's list has F(s, i) before F(s+1, i) and B(s+1, i) before B(s, i), and
the executor hands the tensor over in memory.

Backward split. A schedule either does each stage's whole backward in one B action, or splits it
(zero-bubble schedules): B then computes only the gradient of the stage's input (what the
previous stage waits for) and a later W action computes the weight gradients. A schedule with
any W has one W per stage and micro-batch, after that micro-batch's B on that stage; the runtime
may also list one early W per stage, for its last backward only (``schedules/early.py``): that B
sends its input gradients before the W computes the weight gradients.

The step. A synchronous rank's list ends with its step, all of it as actions (:func:`step_tail`):
REDUCE(s) for each of its stages (the gradients summed across replicas and stages sharing a
weight), one AGREE (every rank's agreement on the step: non-finite check, clip norm), then
STEP(s) for each of its stages (the optimizer update, or none where AGREE decided to skip).
Older hand-written lists end with the STEPs alone, which still validate and run.

Overlapped pairs. A schedule may name pairs of one rank's compute, a forward of one stage and
a backward of another, that form one unit of work (DualPipe's F/B overlap, torch's
OVERLAP_F_B): listed next to each other, the receives either half needs before the pair and
its sends after it, so a runtime may run the two halves at once (``schedules/overlap.py``).
Run in order they are two ordinary actions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from functools import cached_property
from typing import NamedTuple


class Kind(str, Enum):
    """What an action does. Communication kinds name the tensor that crosses the link."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward, or only the input gradient when the schedule has W
    WEIGHT = "W"  # the weight gradients of a micro-batch whose B is done (split backward only)
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    REDUCE = "REDUCE"  # stage s's gradients summed across its replicas and tie groups
    AGREE = "AGREE"  # once per rank (its lowest stage): every rank's agreement on the step
    STEP = "STEP"  # the optimizer update of one stage


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT})
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
STEP_KINDS = frozenset({Kind.REDUCE, Kind.AGREE, Kind.STEP})  # no micro-batch: the step's
TIMED = COMPUTE | STEP_KINDS  # the actions that take a cost of their own


def step_tail(stages: Sequence[int]) -> list[Action]:
    """The end of a synchronous rank's list holding ``stages`` (ascending): each stage's REDUCE,
    the rank's AGREE (named by its lowest stage), then each stage's STEP. The one place that
    writes it."""
    return (
        [Action(Kind.REDUCE, s) for s in stages]
        + [Action(Kind.AGREE, stages[0])]
        + [Action(Kind.STEP, s) for s in stages]
    )


def check_sizes(stages: int, microbatches: int) -> None:
    """Every generator's first check: at least one stage and one micro-batch."""
    if stages < 1:
        raise ValueError(f"a pipeline needs at least one stage, got stages={stages}")
    if microbatches < 1:
        raise ValueError(f"a mini-batch needs at least one micro-batch, got {microbatches}")


def check_chunks(chunks_per_rank: int) -> None:
    """A multi-stage generator's check: at least one stage (chunk) per rank."""
    if chunks_per_rank < 1:
        raise ValueError(
            f"each rank needs at least one chunk, got chunks_per_rank={chunks_per_rank}"
        )


def check_v(name: str, chunks_per_rank: int) -> None:
    """A V schedule's check: the model folds into a V, two stages on every rank."""
    if chunks_per_rank != 2:
        raise ValueError(
            f"{name} folds the model into a V: two stages per rank, got chunks_per_rank="
            f"{chunks_per_rank}; give len(balance) = 2 x ranks"
        )


def with_step_tail(schedule: Schedule) -> Schedule:
    """``schedule`` with every synchronous list closed by its whole step (:func:`step_tail`):
    an older hand-written list that ends with its STEPs alone gets its REDUCEs and AGREE
    before them, which the runtime needs (the same schedule otherwise)."""
    if schedule.asynchronous:
        return schedule
    actions = dict(schedule.actions)
    for rank, ops in schedule.actions.items():
        own = schedule.stages_on(rank)
        if any(a.kind in (Kind.REDUCE, Kind.AGREE) for a in ops):
            continue
        if list(ops[len(ops) - len(own) :]) == [Action(Kind.STEP, s) for s in own]:
            actions[rank] = (*ops[: len(ops) - len(own)], *step_tail(own))
    return replace(schedule, actions=actions)


_MATCHING = {
    Kind.SEND_ACT: Kind.RECV_ACT,
    Kind.RECV_ACT: Kind.SEND_ACT,
    Kind.SEND_GRAD: Kind.RECV_GRAD,
    Kind.RECV_GRAD: Kind.SEND_GRAD,
}


class Action(NamedTuple):
    """One unit of work of one stage on one micro-batch (``microbatch`` is -1 for the step's
    REDUCE, AGREE and synchronous STEP). A named tuple: a search builds, hashes and compares
    millions of them, which a tuple does in C (it equals the plain tuple of its fields)."""

    kind: Kind
    stage: int
    microbatch: int = -1

    @property
    def peer(self) -> int | None:
        """The *stage* at the other end of a communication action, else None. The rank to
        talk to is ``schedule.rank_of(action.peer)`` (the same number under the identity
        placement)."""
        if self.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
            return self.stage + 1
        if self.kind in (Kind.RECV_ACT, Kind.SEND_GRAD):
            return self.stage - 1
        return None

    def matching(self) -> Action:
        """The action on the peer that completes this communication (a send's receive)."""
        peer = self.peer
        if peer is None:
            raise ValueError(f"{self} is not a communication action")
        return Action(_MATCHING[self.kind], peer, self.microbatch)

    def __str__(self) -> str:
        if self.kind in STEP_KINDS:
            after = "" if self.microbatch == -1 else str(self.microbatch)
            return f"{self.stage}:{self.kind.value}{after}"
        return f"{self.stage}:{self.kind.value}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Ordered actions of every rank for one mini-batch of ``microbatches`` micro-batches.

    ``placement[s]`` is the rank that runs stage s; leave it out for one stage per rank (it
    becomes the identity). ``actions[r]`` is rank r's list; it ends with the rank's step
    (:func:`step_tail`: REDUCE per stage, AGREE, STEP per stage, in ascending stage order; or,
    in older hand-written lists, the STEPs alone).

    Asynchronous schedules (PipeDream 1F1B, 2BW; see ``schedules/asynchronous.py``) have a
    non-empty ``lag``: ``actions`` is then the steady-state list of ONE ``train_step`` call, which
    never flushes. Its micro-batch numbers count from this call's first micro-batch; a negative
    one was fed by an earlier call and is still in flight (its backward runs now). A STEP names
    the micro-batch whose backward it follows and applies one optimizer update, which happens
    every ``update_every`` micro-batches (1 for PipeDream, ``microbatches`` for 2BW).
    ``lag[s]`` is the number of stage s's updates between the weights a micro-batch's forward
    reads and the update its gradient is applied in (steady state).

    ``overlaps`` holds the (forward, backward) pairs that form one unit of work (see the module
    docstring); empty in most schedules.
    """

    name: str
    stages: int
    microbatches: int
    actions: dict[int, tuple[Action, ...]]
    placement: tuple[int, ...] = field(default=())
    lag: tuple[int, ...] = field(default=())  # asynchronous only: per stage, in updates
    update_every: int = 0  # asynchronous only: micro-batches per optimizer update
    overlaps: frozenset[tuple[Action, Action]] = field(default=frozenset())  # (F, B) pairs

    def __post_init__(self) -> None:
        object.__setattr__(self, "lag", tuple(self.lag))
        if self.lag and (len(self.lag) != self.stages or self.update_every < 1):
            raise ValueError(
                f"asynchronous schedule {self.name!r} needs one lag per stage and "
                f"update_every >= 1, got lag={self.lag}, update_every={self.update_every}"
            )
        if not self.placement:
            object.__setattr__(self, "placement", tuple(range(self.stages)))
        placement = tuple(self.placement)
        object.__setattr__(self, "placement", placement)
        if len(placement) != self.stages:
            raise ValueError(
                f"schedule {self.name!r} places {len(placement)} stages but has {self.stages}"
            )
        ranks = max(placement, default=-1) + 1
        if idle := sorted(set(range(ranks)) - set(placement)):
            raise ValueError(f"schedule {self.name!r} places no stage on rank {idle[0]}")
        if sorted(self.actions) != list(range(ranks)):
            what = "stages" if self.one_stage_per_rank else "ranks"
            raise ValueError(
                f"schedule {self.name!r} must list actions for {what} 0..{ranks - 1}, "
                f"got {what} {sorted(self.actions)}"
            )

    @property
    def ranks(self) -> int:
        """How many ranks (devices) run the schedule."""
        return max(self.placement, default=-1) + 1

    @property
    def asynchronous(self) -> bool:
        """True for a schedule that never flushes (one list per train_step, see ``lag``)."""
        return bool(self.lag)

    @property
    def one_stage_per_rank(self) -> bool:
        """True under the identity placement: rank s runs stage s and nothing else."""
        return self.placement == tuple(range(self.stages))

    @property
    def splits_backward(self) -> bool:
        """True when every micro-batch's backward is split (zero bubble): each B computes input
        gradients only and a W per stage and micro-batch the weight gradients."""
        return bool(self.weights) and len(self.weights) == self.stages * self.microbatches

    @property
    def early_weights(self) -> dict[int, int]:
        """Per stage, the micro-batch of its one early W (``schedules/early.py``: its last
        backward's weight gradients, listed apart) in a schedule that does not split every
        backward; empty otherwise."""
        return {} if self.splits_backward else dict(self.weights)

    @cached_property
    def weights(self) -> frozenset[tuple[int, int]]:
        """The (stage, micro-batch) pairs whose W is listed: their B computes input gradients
        only."""
        return frozenset(
            (a.stage, a.microbatch)
            for ops in self.actions.values() for a in ops if a.kind is Kind.WEIGHT
        )

    def rank_of(self, stage: int) -> int:
        """The rank that runs ``stage``."""
        return self.placement[stage]

    def stages_on(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs, ascending."""
        return tuple(s for s, r in enumerate(self.placement) if r == rank)

    def placement_text(self) -> str:
        """Which stages each rank runs, for a person: "rank 0: stages 0, 3; rank 1: ..."."""
        return "; ".join(
            f"rank {r}: stages {', '.join(map(str, self.stages_on(r)))}" for r in range(self.ranks)
        )

    def local(self, stage: int, other: int) -> bool:
        """Whether the hand-off between two stages stays on one rank (no message)."""
        return self.placement[stage] == self.placement[other]

    def compute(self, rank: int) -> list[Action]:
        """The rank's forward, backward and weight actions in order (communication left
        out); under the identity placement, ``rank`` is the stage."""
        return [a for a in self.actions[rank] if a.kind in COMPUTE]
