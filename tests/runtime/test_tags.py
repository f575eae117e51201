"""The message tag layout (pipetrain/runtime/tags.py): no two messages share a tag, over every
range the layout admits, and the limits that make it so are enforced where they bind."""

from __future__ import annotations

import itertools

import pytest
import torch

from pipetrain.runtime.boundary import tag
from pipetrain.runtime.meta import HEADER_LEN, MAX_TENSORS, describe, encode
from pipetrain.runtime.tags import (
    BREAK_TAG,
    CLOCK_TAG,
    CONTROL,
    LANES,
    TENSORS,
    TagLayout,
    tensor_tags,
)
from schedules import Kind, build


def every_tag(layout: TagLayout) -> list[int]:
    """The tag of every tensor of every message the layout admits."""
    return [
        number
        for mb, lane, boundary in itertools.product(
            range(layout.microbatches), range(LANES), range(max(layout.stages - 1, 1))
        )
        for number in tensor_tags(layout.tag(mb, lane, boundary), TENSORS)
    ]


@pytest.mark.parametrize("stages", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("microbatches", [1, 2, 7, 16])
def test_no_two_messages_share_a_tag(stages, microbatches):
    tags = every_tag(TagLayout(stages, microbatches))
    assert len(set(tags)) == len(tags)
    assert min(tags) >= 0 and max(tags) < CONTROL
    assert BREAK_TAG not in tags and CLOCK_TAG not in tags


@pytest.mark.parametrize("stages", [1, 2, 9, 64, 1000])
def test_the_largest_layout_stays_below_the_control_tags(stages):
    most = TagLayout.max_microbatches(stages)
    layout = TagLayout(stages, most)
    boundaries = max(stages - 1, 1)
    last = tensor_tags(layout.tag(most - 1, LANES - 1, boundaries - 1), TENSORS)[-1]
    assert last < CONTROL <= last + TENSORS * boundaries * LANES  # tight: one more would reach it
    with pytest.raises(ValueError, match=f"hold at most {most}: use fewer chunks"):
        TagLayout(stages, most + 1)


def test_every_digit_is_checked():
    layout = TagLayout(3, 4)
    for mb, lane, boundary in [(4, 0, 0), (-1, 0, 0), (0, LANES, 0), (0, 0, 2), (0, 0, -1)]:
        with pytest.raises(ValueError, match="no tag for"):
            layout.tag(mb, lane, boundary)
    with pytest.raises(ValueError, match=f"more than the {TENSORS} tags"):
        tensor_tags(0, TENSORS + 1)


def test_a_header_describes_exactly_as_many_tensors_as_a_message_has_tags():
    assert TENSORS == MAX_TENSORS == (HEADER_LEN - 3) // 3
    scalars = [torch.zeros(()) for _ in range(MAX_TENSORS + 1)]
    assert encode(describe(scalars[:MAX_TENSORS], True)).shape == (HEADER_LEN,)
    with pytest.raises(ValueError, match=f"carries {MAX_TENSORS + 1} tensors, more than the"):
        encode(describe(scalars, True))


def test_the_executor_tags_each_action_by_the_layout():
    """Activation, gradient and header (activations only: shapes travel forward) of every
    boundary and micro-batch of a schedule get distinct tags."""
    schedule = build("interleaved", 6, 4, ranks=2)
    layout = TagLayout(schedule.stages, schedule.microbatches)
    seen = {}
    for ops in schedule.actions.values():
        for a in ops:
            if a.peer is not None and a.kind in (Kind.SEND_ACT, Kind.SEND_GRAD):
                for header in (False, True) if a.kind is Kind.SEND_ACT else (False,):
                    seen.setdefault(tag(a, layout, header), set()).add((a, header))
    assert all(len(v) == 1 for v in seen.values())
