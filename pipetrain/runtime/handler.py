"""What a rank's list asks of the step beyond compute and messages: the step's actions (REDUCE,
AGREE, STEP) and the messages' life across calls.

The executor (executor.py) runs every action and hands the step's three kinds to a step
handler, one object shared by this process's executors:

* :class:`WithinCall`, a list whose messages stay within its call (synchronous lists and
  evaluation): micro-batch i of the call is message i, each call waits for its own sends, and
  the gradients a stage sends are announced once per call (which are there: see
  executor.py's module docstring). Used as is, it runs lists without a step (evaluation);
  the synchronous step (REDUCE, AGREE, STEP) is :class:`~pipetrain.runtime.update.Update`'s.
* pipetrain/runtime/inflight.py's ``InFlight``, an asynchronous list whose micro-batches outlive
  a call: messages are numbered by global micro-batch, a call carries its sends to the next,
  every gradient is sent (zeros where none flows), and STEP updates a stage at once.

:class:`Call` is what one run of a rank's list gets besides the list; :class:`Carry` what one
rank keeps from call to call.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipetrain.errors import PipelineError
from pipetrain.runtime.meta import BoundaryMeta
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.transport import Handle
from schedules import Action, Schedule

Pending = tuple[Action, Handle]  # a posted send, waited for before its tensors are reused


@dataclass
class Carry:
    """What outlives one call of a rank's list: the same object is handed to every call."""

    shapes_in: dict[int, BoundaryMeta] = field(default_factory=dict)
    """Per stage, the boundary shapes it received in the last call (its first payload's
    receive is posted with them, before the header arrives)."""
    shapes_out: dict[int, BoundaryMeta] = field(default_factory=dict)
    """Per stage, the boundary shapes it sent in the last call (when they change, a stand-in
    of these fills the receiver's early receive)."""
    headers: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per stage, the header encoding ``shapes_out`` (sent again while they stay the same:
    only its reader touches it)."""
    presence: dict[tuple[bool, ...], torch.Tensor] = field(default_factory=dict)
    """The headers saying which gradients a message holds, per pattern (sent again)."""
    in_flight: dict[tuple[int, int], BoundaryMeta] = field(default_factory=dict)
    """(stage, global micro-batch) -> the shapes its forward sent, for the receive of the
    gradient that comes back (in this call, or a later one of an asynchronous schedule)."""
    sends: list[Pending] = field(default_factory=list)
    """Asynchronous schedules: the last call's sends, which the peer receives in its next call."""


class StepHandler(Protocol):
    """The step's actions and the messages' life across calls, for the executors of this
    process (see the module docstring)."""

    announces_presence: bool
    """Whether a stage announces once per call which gradients it sends (messages within a
    call), rather than sending zeros for absent ones (messages across calls)."""

    def cycle(self, schedule: Schedule) -> int:
        """How many message numbers the micro-batches of ``schedule``'s lists take in turn."""
        ...

    def settle(self, carry: Carry, sends: list[Pending], feeds: bool) -> list[Pending]:
        """At the end of a rank's list (``feeds``: it has forwards), the sends to wait for
        now; the handler may keep others in ``carry`` for the next call."""
        ...

    def loss_scale(self) -> float | torch.Tensor:
        """What the last stage's backwards start from this call (fp16's scale, else 1)."""
        ...

    def reduce(self, stage: Stage) -> None:
        """REDUCE: ``stage``'s gradients summed across its replicas and tie groups."""
        ...

    def agree(
        self, stages: Collection[int], check: Callable[[], None], timeout: float, where: str
    ) -> None:
        """AGREE of the rank holding ``stages``: every rank's agreement on the step. ``check``
        raises when a peer stopped; ``timeout`` bounds any wait; ``where`` names the rank."""
        ...

    def update(self, stage: Stage) -> None:
        """STEP: ``stage``'s optimizer update (or none, where the agreement skipped it)."""
        ...


class WithinCall:
    """A list whose messages stay within its call (module docstring). Used as is, it runs
    lists without a step (evaluation); :class:`~pipetrain.runtime.update.Update` adds it."""

    announces_presence = True

    def cycle(self, schedule: Schedule) -> int:
        return schedule.microbatches

    def settle(self, carry: Carry, sends: list[Pending], feeds: bool) -> list[Pending]:
        return sends

    def loss_scale(self) -> float | torch.Tensor:
        return 1.0

    def reduce(self, stage: Stage) -> None:
        raise PipelineError(f"stage {stage.index}: this list has no step, but lists REDUCE")

    def agree(
        self, stages: Collection[int], check: Callable[[], None], timeout: float, where: str
    ) -> None:
        raise PipelineError(f"{where}: this list has no step, but lists AGREE")

    def update(self, stage: Stage) -> None:
        raise PipelineError(f"stage {stage.index}: this list has no step, but lists STEP")


@dataclass
class Call:
    """What one run of a rank's list gets besides the list: the step handler, the rank's
    :class:`Carry`, the global number of its micro-batch 0 (``base``: asynchronous lists
    count across calls) and whether it trains."""

    handler: StepHandler = field(default_factory=WithinCall)
    carry: Carry = field(default_factory=Carry)
    base: int = 0
    training: bool = True
