"""Micro-batch schedules as data, their validator and simulator. No torch here."""

from schedules.action import Action, Kind, Schedule, step_tail, with_step_tail
from schedules.asynchronous import (
    drain,
    for_call,
    measure_lag,
    peak_versions,
    pipedream,
    pipedream_2bw,
    unroll,
)
from schedules.csv_lists import from_csv, to_csv
from schedules.dualpipe import dualpipev
from schedules.early import with_early_weights
from schedules.errors import ScheduleError
from schedules.generators import (
    from_order,
    gpipe,
    interleaved,
    looped_bfs,
    one_f_one_b,
    zero_bubble_h1,
    zero_bubble_h2,
)
from schedules.list_scheduling import interleaved_zb, v_placement, zbv
from schedules.overlap import overlapped
from schedules.registry import (
    DEFAULT_SCHEDULE,
    GENERATORS,
    ScheduleSpec,
    build,
    inflight,
    lookup,
    names,
    register,
    spec_of,
    unregister,
)
from schedules.simulate import Simulation, simulate, steady_state
from schedules.timeline import Span, bubble_fraction
from schedules.v_shape import v_half, v_min
from schedules.validate import validate

__all__ = [
    "DEFAULT_SCHEDULE",
    "GENERATORS",
    "Action",
    "Kind",
    "Schedule",
    "ScheduleError",
    "ScheduleSpec",
    "Simulation",
    "Span",
    "bubble_fraction",
    "build",
    "drain",
    "dualpipev",
    "for_call",
    "from_csv",
    "from_order",
    "gpipe",
    "inflight",
    "interleaved",
    "interleaved_zb",
    "looped_bfs",
    "lookup",
    "measure_lag",
    "names",
    "one_f_one_b",
    "overlapped",
    "peak_versions",
    "pipedream",
    "pipedream_2bw",
    "register",
    "simulate",
    "spec_of",
    "steady_state",
    "step_tail",
    "to_csv",
    "unregister",
    "unroll",
    "v_half",
    "v_min",
    "v_placement",
    "validate",
    "with_early_weights",
    "with_step_tail",
    "zero_bubble_h1",
    "zero_bubble_h2",
    "zbv",
]
