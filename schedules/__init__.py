"""Micro-batch schedules as data, their validator and simulator. No torch here."""

from schedules.action import Action, Kind, Schedule
from schedules.generators import (
    GENERATORS,
    build,
    gpipe,
    interleaved,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
)
from schedules.simulate import Simulation, simulate
from schedules.timeline import Span, bubble_fraction
from schedules.validate import ScheduleError, validate

__all__ = [
    "GENERATORS",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "Simulation",
    "Span",
    "bubble_fraction",
    "build",
    "gpipe",
    "interleaved",
    "one_f_one_b",
    "simulate",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_h2",
]
