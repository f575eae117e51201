"""Timed actions: what the simulator predicts and what the runtime's trace measures.

Both produce Spans, so one picture, one bubble formula and one dependency check serve a planned
schedule and a measured run alike. A span records the rank it ran on when that differs from its
stage (several stages per rank); spans without a rank are taken to run on their stage's rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schedules.action import COMPUTE, Action


@dataclass(frozen=True)
class Span:
    """``action`` ran (or, for a receive, waited) from ``start`` to ``end``, in seconds, on
    ``rank`` (None: the rank numbered like the action's stage)."""

    action: Action
    start: float
    end: float
    rank: int | None = None

    @property
    def lane(self) -> int:
        """The rank the span occupies."""
        return self.action.stage if self.rank is None else self.rank

    @property
    def duration(self) -> float:
        return self.end - self.start


def bubble_fraction(spans: Iterable[Span]) -> float:
    """Share of rank-time not spent in forward, backward or weight work, over the spans'
    extent: 1 - sum(compute) / (ranks * (last end - first start))."""
    spans = list(spans)
    if not spans:
        return 0.0
    ranks = {s.lane for s in spans}
    extent = max(s.end for s in spans) - min(s.start for s in spans)
    busy = sum(s.duration for s in spans if s.action.kind in COMPUTE)
    return 1.0 - busy / (len(ranks) * extent) if extent > 0 else 0.0
