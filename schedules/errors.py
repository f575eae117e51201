"""The errors of the schedules package: a schedule that cannot run as written."""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order or would deadlock."""
