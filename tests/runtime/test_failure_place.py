"""A failed step shows the failing rank's place in its schedule: its actions around the one that
failed, that one marked, as a note on the error (printed with its traceback) and in the log."""

from __future__ import annotations

import logging
import re

import pytest
from torch import nn

import pipetrain
from pipetrain.errors import StageError
from schedules import build
from schedules.listing import excerpt
from tests.runtime.harness import run_ranks
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_errors import FailOn

# 1F1B, 2 stages, 4 micro-batches: FailOn(call=3) fails stage 1's forward of micro-batch 2,
# its 10th action of 20 (17 of the schedule's computes and messages, the early W of its last
# backward, REDUCE and AGREE).
MARKED = r"rank 1 \(stage 1\) of schedule '1f1b', 2 stages, 4 micro-batches: actions 6-14 of 20"


def failing_model() -> nn.Sequential:
    return nn.Sequential(*mlp()[:6], FailOn(call=3), *mlp()[6:])


def test_the_note_marks_the_failing_action_among_its_neighbours(caplog):
    pipe = pipetrain.Pipeline(
        failing_model(), [6, 7], chunks=4, schedule="1f1b", recompute="never",
        devices=["cpu", "cpu"], loss_fn=nn.functional.cross_entropy, optimizer=sgd,
    )
    with caplog.at_level(logging.ERROR, logger="pipetrain"):
        with pytest.raises(StageError, match="forward of micro-batch 2") as info:
            pipe.train_step(*batches(1)[0])
    (note,) = info.value.__notes__
    lines = note.splitlines()
    assert re.fullmatch(MARKED, lines[0])
    assert len(lines) == 1 + 9, "four actions either side, not the whole list"
    marked = [line for line in lines if "<- failed here" in line]
    assert marked == ["  -> 10  1:F2  <- failed here"]
    assert note in caplog.text


def test_the_excerpt_stops_at_the_ends_of_the_list():
    schedule = build("gpipe", 2, 2)
    first = excerpt(schedule, 0, 0).splitlines()
    # 2 forwards, 2 sends, 2 receives, 2 backwards, REDUCE, AGREE, STEP
    assert first[0].endswith("actions 1-5 of 11") and first[1] == "  -> 1  0:F0  <- failed here"
    last = excerpt(schedule, 0, 10).splitlines()
    assert last[0].endswith("actions 7-11 of 11") and last[-1] == "  -> 11  0:STEP  <- failed here"
    assert last[-3:-1] == ["      9  0:REDUCE", "     10  0:AGREE"]


def _fail(rank: int, world: int) -> None:
    pipe = pipetrain.Pipeline(
        failing_model(), [6, 7], chunks=4, schedule="1f1b", recompute="never",
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60,
    )
    pipe.train_step(*batches(1)[0])


def test_a_failing_process_prints_its_place_and_its_peer_does_not():
    results = run_ranks(_fail, 2)
    (kind0, _, trace0), (kind1, _, trace1) = (r[1] for r in results)
    assert (kind0, kind1) == ("PeerError", "StageError")
    assert re.search(MARKED, trace1) and "-> 10  1:F2  <- failed here" in trace1
    assert "<- failed here" not in trace0, "a peer that stopped because of it adds nothing"
