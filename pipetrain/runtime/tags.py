"""The message tags of a pipeline, in one place, and why no two messages share one.

A message is one boundary crossing of one micro-batch: an activation, a gradient, or the header
that describes the shapes (pipetrain/runtime/meta.py). Each tensor of a tuple travels as a message
of its own, tag ``base + k``. The tag is a number in mixed radix, most significant digit first::

    tag = ((microbatch * LANES + lane) * boundaries + boundary) * TENSORS + k

Every digit stays below its radix (checked here), so distinct (micro-batch, lane, boundary,
tensor) give distinct tags. ``TENSORS`` is what a header can describe at most, so the header
refuses a tuple before its tags could spill into the next message's. All message tags lie below
``CONTROL``, where the transport's own tags start (``BREAK_TAG``, the probe that closes a link;
``CLOCK_TAG``, the clock-offset pings; from ``GENERATION`` on, generation's messages,
pipetrain/runtime/generation.py), and those stay below 2**31 (a C int in every backend).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipetrain.runtime.meta import MAX_TENSORS

LANES = 3  # activation, gradient, header
ACTIVATION, GRADIENT, HEADER = range(LANES)
TENSORS = MAX_TENSORS  # tags per message: one per tensor of a tuple
CONTROL = 2**30  # first tag that is no message of the schedule
BREAK_TAG = CONTROL
CLOCK_TAG = CONTROL + 1
GENERATION = CONTROL + TENSORS  # generation_tag's first
assert CLOCK_TAG < GENERATION < 2**31 - 1, "tags are C ints"


@dataclass(frozen=True)
class TagLayout:
    """The tags of a pipeline of ``stages`` stages whose messages carry micro-batch numbers
    0 .. ``microbatches``-1. Refuses a pipeline whose tags would reach ``CONTROL``."""

    stages: int
    microbatches: int

    def __post_init__(self) -> None:
        most = self.max_microbatches(self.stages)
        if not 0 < self.microbatches <= most:
            raise ValueError(
                f"{self.microbatches} micro-batch numbers in flight do not fit the message "
                f"tags of a {self.stages}-stage pipeline, which hold at most {most}: use fewer "
                "chunks (or fewer stages)"
            )

    @staticmethod
    def max_microbatches(stages: int) -> int:
        """The most micro-batch numbers whose tags stay below CONTROL."""
        return CONTROL // (LANES * max(stages - 1, 1) * TENSORS)

    def tag(self, microbatch: int, lane: int, boundary: int) -> int:
        """The first tag of a message: micro-batch, lane (ACTIVATION, GRADIENT or HEADER) and
        boundary (boundary s joins stages s and s+1; two may join the same pair of ranks)."""
        boundaries = max(self.stages - 1, 1)
        if not (0 <= microbatch < self.microbatches and 0 <= lane < LANES
                and 0 <= boundary < boundaries):
            raise ValueError(
                f"no tag for micro-batch {microbatch}, lane {lane}, boundary {boundary} of "
                f"{self.microbatches} micro-batches, {LANES} lanes, {boundaries} boundaries"
            )
        return ((microbatch * LANES + lane) * boundaries + boundary) * TENSORS


def tensor_tags(base: int, count: int) -> range:
    """The tags of a message's ``count`` tensors, from its first tag ``base``."""
    if count > TENSORS:
        raise ValueError(
            f"a message of {count} tensors needs more than the {TENSORS} tags it has; send at "
            f"most {TENSORS} tensors across a stage boundary (e.g. stack or concatenate some)"
        )
    return range(base, base + count)


def generation_tag(microbatch: int, boundary: int, header: bool, stages: int) -> int:
    """The first tag of one of generation's messages: of micro-batch ``microbatch`` (the
    number of micro-batches for the final result), across ``boundary`` (s joins stages s and
    s + 1; ``stages - 1`` carries the chosen tokens back to the first stage), its header or its
    payload. Refuses a tag past 2**31."""
    tag = GENERATION + ((microbatch * stages + boundary) * 2 + int(not header)) * TENSORS
    if tag + TENSORS >= 2**31:
        raise ValueError(
            f"generation with micro-batch {microbatch} of a {stages}-stage pipeline needs "
            "message tags past 2**31: use fewer chunks"
        )
    return tag
