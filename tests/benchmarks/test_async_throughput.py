"""benchmarks/async_throughput.py --quick: 1F1B and PipeDream-2BW on 2 gloo processes for both
models; the table has the documented columns and a row per model with positive, finite times,
a ratio that is their quotient, and memory where 2BW's first rank holds weight versions that
1F1B's does not (its last rank none)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COLUMNS = ["stages", "model", "chunks", "1F1B ms/step", "2BW ms/step", "ratio",
           "1F1B samples/s", "2BW samples/s", "1F1B MiB/rank", "2BW MiB/rank",
           "2BW versions MiB/rank"]


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.slow
def test_quick_run_prints_the_table():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "async_throughput.py"), "--quick"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = max(i for i, line in enumerate(lines) if line.startswith("| stages |"))
    assert _cells(lines[header]) == COLUMNS
    rows = [dict(zip(COLUMNS, _cells(line), strict=True))
            for line in lines[header + 2:] if line.startswith("|")]
    assert [(r["stages"], r["model"], r["chunks"]) for r in rows] == [
        ("2", "digits", "4"), ("2", "gpt", "4")]
    for row in rows:
        sync, bw = float(row["1F1B ms/step"]), float(row["2BW ms/step"])
        assert 0 < sync < math.inf and 0 < bw < math.inf
        assert float(row["ratio"]) == pytest.approx(sync / bw, rel=0.01)
        first, last = (float(v) for v in row["2BW versions MiB/rank"].split("/"))
        assert first > 0 and last == 0  # the last stage has no lag, so no second version
        sync_mem = [float(v) for v in row["1F1B MiB/rank"].split("/")]
        bw_mem = [float(v) for v in row["2BW MiB/rank"].split("/")]
        assert bw_mem[0] > sync_mem[0] > 0
