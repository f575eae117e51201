"""The one representation of a pipeline schedule: per stage, an ordered list of actions.

The generators build it, the validator checks it, the simulator times it and the runtime executes
it. Nothing else encodes the order of work.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    """What an action does. Communication kinds name the tensor that crosses the link."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SEND_ACT"
    RECV_ACT = "RECV_ACT"
    SEND_GRAD = "SEND_GRAD"
    RECV_GRAD = "RECV_GRAD"
    STEP = "STEP"


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD})
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})


@dataclass(frozen=True)
class Action:
    """One unit of work of one stage on one micro-batch (``microbatch`` is -1 for ``STEP``)."""

    kind: Kind
    stage: int
    microbatch: int = -1

    @property
    def peer(self) -> int | None:
        """The stage at the other end of a communication action, else None."""
        if self.kind in (Kind.SEND_ACT, Kind.RECV_GRAD):
            return self.stage + 1
        if self.kind in (Kind.RECV_ACT, Kind.SEND_GRAD):
            return self.stage - 1
        return None

    def matching(self) -> Action:
        """The action on the peer that completes this communication (a send's receive)."""
        pairs = {
            Kind.SEND_ACT: Kind.RECV_ACT,
            Kind.RECV_ACT: Kind.SEND_ACT,
            Kind.SEND_GRAD: Kind.RECV_GRAD,
            Kind.RECV_GRAD: Kind.SEND_GRAD,
        }
        if self.peer is None:
            raise ValueError(f"{self} is not a communication action")
        return Action(pairs[self.kind], self.peer, self.microbatch)

    def __str__(self) -> str:
        if self.kind is Kind.STEP:
            return f"{self.stage}:STEP"
        return f"{self.stage}:{self.kind.value}{self.microbatch}"


@dataclass(frozen=True)
class Schedule:
    """Ordered actions of every stage for one mini-batch of ``microbatches`` micro-batches."""

    name: str
    stages: int
    microbatches: int
    actions: dict[int, tuple[Action, ...]]

    def __post_init__(self) -> None:
        if sorted(self.actions) != list(range(self.stages)):
            raise ValueError(
                f"schedule {self.name!r} must list actions for stages 0..{self.stages - 1}, "
                f"got stages {sorted(self.actions)}"
            )

    def compute(self, stage: int) -> list[Action]:
        """The stage's forward and backward actions in order (communication left out)."""
        return [a for a in self.actions[stage] if a.kind in COMPUTE]
