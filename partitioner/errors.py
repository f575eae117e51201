"""The errors a planner user can meet, each saying what is wrong and what to do.

All derive from :class:`PlannerError` (a ValueError: each is bad input to the planner, a file
or constraints), so a caller can catch the package's errors in one clause. Arguments of the
wrong value (an unknown solver, a malformed size) raise a plain ValueError.
"""

from __future__ import annotations


class PlannerError(ValueError):
    """Base of the partitioner's errors."""


class ProfileError(PlannerError):
    """A profile file that cannot be read: unknown version, missing or malformed field."""


class InfeasibleError(PlannerError):
    """No split satisfies the constraints; ``smallest_cap`` is the memory cap that would fit
    (bytes per device), or None when memory is not what stands in the way."""

    def __init__(self, message: str, smallest_cap: int | None = None) -> None:
        super().__init__(message)
        self.smallest_cap = smallest_cap


class PlanMismatchError(PlannerError):
    """The model being trained is not the one the plan was made for."""


class PlanFileError(PlannerError):
    """A plan file that cannot be read: unknown version, missing or malformed field."""
