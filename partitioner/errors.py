"""The errors a planner user can meet, each saying what is wrong and what to do.

All derive from :class:`PlannerError` (a ValueError: each is bad input to the planner, a file
or constraints), so a caller can catch the package's errors in one clause. Arguments of the
wrong value (an unknown solver, a malformed size) raise a plain ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class PlannerError(ValueError):
    """Base of the partitioner's errors."""


class ProfileError(PlannerError):
    """A profile file that cannot be read: unknown version, missing or malformed field."""


@dataclass(frozen=True)
class Remedy:
    """One way out of an infeasible plan, worded for ``partitioner.plan`` (``argument``) and
    for the ``pipetrain plan`` command line (``flag``)."""

    argument: str
    flag: str


class InfeasibleError(PlannerError):
    """No split satisfies the constraints; ``smallest_cap`` is the memory cap that would fit
    (bytes per device), or None when memory is not what stands in the way. ``remedies`` are
    the ways out, which the message lists in ``partitioner.plan``'s words and
    :meth:`for_command_line` in flags."""

    def __init__(
        self, message: str, smallest_cap: int | None = None, remedies: Sequence[Remedy] = ()
    ) -> None:
        self.reason = message
        self.remedies = tuple(remedies)
        super().__init__(self._worded([r.argument for r in self.remedies]))
        self.smallest_cap = smallest_cap

    def _worded(self, ways: list[str]) -> str:
        return self.reason + (f"; {', or '.join(ways)}" if ways else "")

    def for_command_line(self) -> str:
        """The message with its remedies as command-line flags."""
        return self._worded([r.flag for r in self.remedies])


class PlanMismatchError(PlannerError):
    """The model being trained is not the one the plan was made for."""


class PlanFileError(PlannerError):
    """A plan file that cannot be read: unknown version, missing or malformed field."""
