"""Timed actions: what the simulator predicts and what the runtime's trace measures.

Both produce Spans, so one picture, one bubble formula and one dependency check serve a planned
schedule and a measured run alike.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schedules.action import COMPUTE, Action


@dataclass(frozen=True)
class Span:
    """``action`` ran (or, for a receive, waited) from ``start`` to ``end``, in seconds."""

    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def bubble_fraction(spans: Iterable[Span]) -> float:
    """Share of stage-time not spent in forward or backward work, over the spans' extent:
    1 - sum(compute) / (stages * (last end - first start))."""
    spans = list(spans)
    if not spans:
        return 0.0
    stages = {s.action.stage for s in spans}
    extent = max(s.end for s in spans) - min(s.start for s in spans)
    busy = sum(s.duration for s in spans if s.action.kind in COMPUTE)
    return 1.0 - busy / (len(stages) * extent) if extent > 0 else 0.0
