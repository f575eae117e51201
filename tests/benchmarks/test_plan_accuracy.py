"""benchmarks/plan_accuracy.py --quick: two configurations of the example GPT planned and run on
2 CPU threads; the table has a row each with a positive, finite prediction and measurement of
the step and of each rank's memory, and the summary its lines."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run() -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_accuracy.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _numbers(cell: str) -> list[float]:
    return [float(v) for v in cell.strip().rstrip("%").split("/")]


def test_quick_run_prints_a_row_per_configuration_and_the_summary():
    out = _run()
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| model | schedule"))
    columns = [c.strip() for c in lines[header].strip("|").split("|")]
    assert columns[:5] == ["model", "schedule", "chunks", "recompute", "zero"]
    rows = []
    for line in lines[header + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(columns, (c.strip() for c in line.strip("|").split("|")),
                             strict=True)))
    assert len(rows) == 2, out
    assert {r["chunks"] for r in rows} == {"2", "4"}
    for row in rows:
        assert (row["model"], row["schedule"], row["recompute"]) == ("gpt", "1f1b", "never")
        figures = [float(row["predicted ms"]), float(row["measured ms"])]
        figures += _numbers(row["predicted MiB (rank 0/1)"])
        figures += _numbers(row["measured MiB (rank 0/1)"])
        assert len(figures) == 6
        assert all(math.isfinite(v) and v > 0 for v in figures), row
        assert math.isfinite(float(row["time error"].rstrip("%")))
    for start in ("step time: median |error|", "peak memory per rank: median |error|",
                  "gpt: the planner picks 1f1b"):
        assert any(line.startswith(start) for line in lines), (start, out)
    assert "the grid's median configuration" in out
