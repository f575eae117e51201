"""`pipetrain trace` names the step it drew (never "step -1") and refuses one it does not
hold; the timeline's bars have a legend (issue 31, item 12)."""

from __future__ import annotations

import shlex

import pytest

from pipetrain.observe.gantt import STEP_COLOUR, legend
from pipetrain.tools.cli import main
from schedules import Kind
from schedules.action import TIMED
from tests.runtime.models import batches, mlp
from tests.runtime.test_local import pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trace")
    pipe = pipeline(mlp(), [6, 6], chunks=2, trace=folder)
    for x, y in batches(3):
        pipe.train_step(x, y)
    pipe.save_trace()
    return folder


def test_trace_names_the_step_it_drew(traced, capsys) -> None:
    assert main(shlex.split(f"trace {traced} --no-png")) == 0
    out = capsys.readouterr().out
    assert "3 steps traced (0..2); step 2: measured bubble" in out
    assert "step -1" not in out
    assert main(shlex.split(f"trace {traced} --no-png --step 0")) == 0
    assert "; step 0: measured" in capsys.readouterr().out
    assert main(shlex.split(f"trace {traced} --no-png --step 3")) == 2
    assert "holds 3 traced steps (0..2)" in capsys.readouterr().err


def test_every_kind_of_bar_has_a_legend_entry(traced) -> None:
    kinds = set(TIMED)
    labels = {label: (colour, hatch) for label, colour, hatch in legend(kinds)}
    assert len(labels) == len(kinds)
    assert labels["optimizer step"] == (STEP_COLOUR, None)
    assert {"gradient reduction (REDUCE)", "step agreement (AGREE)"} <= set(labels)
    assert labels["weight gradient (W)"][1] == "//"
    assert {"forward (dark shade)", "backward (light shade)"} <= set(labels)
    assert [label for label, _, _ in legend({Kind.FORWARD, Kind.STEP})] == [
        "forward (dark shade)", "optimizer step"
    ]
    pytest.importorskip("matplotlib", reason="drawing needs matplotlib")
    assert main(shlex.split(f"trace {traced}")) == 0
    assert (traced / "timeline.png").stat().st_size > 10_000
