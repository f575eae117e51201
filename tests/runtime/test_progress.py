"""What Pipeline(progress=...) prints (issue 31, item 10): a print interval and a total that
cannot be confused, a line on resume, lines that fit a terminal without cutting a figure, and
the memory figure named."""

from __future__ import annotations

import io
import re

import pytest

import pipetrain
from pipetrain import Progress
from tests.runtime.models import batches, mlp
from tests.runtime.test_local import pipeline
from tests.runtime.test_trace import _Terminal


def test_a_bare_number_is_refused_naming_both_meanings() -> None:
    with pytest.raises(ValueError) as err:
        pipeline(mlp(), [6, 6], progress=10)
    assert "Progress(every=10)" in str(err.value) and "Progress(total=10)" in str(err.value)
    with pytest.raises(ValueError, match="every must be a positive number"):
        Progress(every=0)


def test_every_prints_an_interval_and_total_the_last_step() -> None:
    log = io.StringIO()
    pipe = pipeline(mlp(), [6, 6], chunks=2, progress=Progress(every=2, total=5, stream=log))
    for x, y in batches(5):
        pipe.train_step(x, y)
    steps = [line.split(" | ")[0] for line in log.getvalue().splitlines()]
    assert steps == ["step 2/5", "step 4/5", "step 5/5"]


def test_a_resumed_run_says_so_and_counts_on(tmp_path, capsys) -> None:
    """After a resume from step 2, a run of 4 steps in all prints 'step 3/4', never '3/2'."""
    first = pipeline(mlp(), [6, 6], chunks=2, checkpoint_dir=tmp_path, checkpoint_every=2)
    for x, y in batches(2):
        first.train_step(x, y)
    capsys.readouterr()
    log = io.StringIO()
    again = pipeline(
        mlp(), [6, 6], chunks=2, checkpoint_dir=tmp_path, progress=Progress(total=4, stream=log)
    )
    assert again.step == 2
    assert f"pipetrain: resumed from step 2 of {tmp_path}" in log.getvalue()
    for x, y in batches(2):
        again.train_step(x, y)
    assert [line.split(" | ")[0] for line in log.getvalue().splitlines()[1:]] == [
        "step 3/4", "step 4/4"
    ]
    pipeline(mlp(), [6, 6], chunks=2, checkpoint_dir=tmp_path)  # no progress: said anyway
    assert "pipetrain: resumed from step 2" in capsys.readouterr().err


@pytest.mark.parametrize("columns", [40, 60, 80, 120])
def test_narrow_terminals_drop_whole_fields(monkeypatch, columns: int) -> None:
    """Every field a terminal shows is a whole field of the full line (or its per-stage range),
    never a figure cut short; the step and the loss always stay."""
    pipe = pipeline(
        mlp(), [2, 2, 1, 1, 1, 1, 2, 2], chunks=8, clip_grad_norm=1.0,
    )
    monkeypatch.setenv("COLUMNS", str(columns))
    shown = Progress(stream=_Terminal())
    for x, y in batches(2):
        pipe.train_step(x, y)
        shown.update(pipe.metrics)
    drawn = shown.stream.getvalue().split("\r")[-1].removeprefix("\033[K")
    full = Progress().line(pipe.metrics).split(" | ")
    short = Progress().line(pipe.metrics, width=1).split(" | ")
    assert len(drawn) < columns or drawn.split(" | ") == short[:2], drawn
    bubble, peak = pipe.metrics["stage_bubble"], max(pipe.metrics["peak_memory"].values())
    ranges = [f"bubble {min(bubble):.0%}-{max(bubble):.0%}", f"peak RSS max {peak / 2**20:.0f}MiB"]
    for field in drawn.split(" | "):
        assert field in full or field in ranges, (field, drawn)
    assert drawn.startswith("step 2 | loss ")
    assert "…" not in drawn
    if columns >= 120:
        assert "grad norm" in drawn


def test_the_memory_figure_says_what_it_measures() -> None:
    pipe = pipeline(mlp(), [6, 6], chunks=2)
    pipe.train_step(*batches(1)[0])
    line = Progress().line(pipe.metrics)
    assert re.search(r"\| peak RSS cpu\(process\)=\d+MiB", line), line
    assert pipetrain.observe.progress.memory_kind(pipe.stages[0].device) == "RSS"
