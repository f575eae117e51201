"""Micro-batch schedules as data, their validator and simulator. No torch here."""

from schedules.action import Action, Kind, Schedule
from schedules.asynchronous import (
    drain,
    for_call,
    measure_lag,
    peak_versions,
    pipedream,
    pipedream_2bw,
    unroll,
)
from schedules.errors import ScheduleError
from schedules.generators import (
    GENERATORS,
    build,
    gpipe,
    interleaved,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
)
from schedules.simulate import Simulation, simulate, steady_state
from schedules.timeline import Span, bubble_fraction
from schedules.validate import validate

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
    "drain",
    "for_call",
    "gpipe",
    "interleaved",
    "measure_lag",
    "one_f_one_b",
    "peak_versions",
    "pipedream",
    "pipedream_2bw",
    "simulate",
    "steady_state",
    "unroll",
    "validate",
    "zero_bubble_h1",
    "zero_bubble_h2",
]
