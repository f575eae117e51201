"""The errors a planner user can meet, each saying what is wrong and what to do."""

from __future__ import annotations


class ProfileError(ValueError):
    """A profile file that cannot be read: unknown version, missing or malformed field."""


class InfeasibleError(ValueError):
    """No split satisfies the constraints; ``smallest_cap`` is the memory cap that would fit
    (bytes per device), or None when memory is not what stands in the way."""

    def __init__(self, message: str, smallest_cap: int | None = None) -> None:
        super().__init__(message)
        self.smallest_cap = smallest_cap


class PlanMismatchError(ValueError):
    """The model being trained is not the one the plan was made for."""


class PlanFileError(ValueError):
    """A plan file that cannot be read: unknown version, missing or malformed field."""
