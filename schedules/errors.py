"""The errors of the schedules package.

:class:`ScheduleError` (a ValueError) is a schedule that cannot run as written: incomplete, out
of order or deadlocking, found by :func:`schedules.validate` before anything runs it (the
simulator validates too). Arguments of the wrong value (no stages, an unknown schedule name, a
negative cost) raise a plain ValueError naming the argument.
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule that is incomplete, out of order or would deadlock."""
