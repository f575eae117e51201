"""benchmarks/plan_accuracy_zero.py on 2 gloo processes, few rounds: a row per zero level and
reduce-scatter mode with positive, finite figures, and the memory model (which does not depend
on the machine's load) within its 10 % target on every rank at zero 0 to 2. (At zero 3 it
misses the layers FSDP2 holds gathered at once: docs/plan-accuracy.md.)"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_zero_row_is_measured_and_its_memory_below_3_predicted_within_ten_percent():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "plan_accuracy_zero.py"), "--rounds", "2",
         "--warmup", "1", "--profile-repeats", "3"],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line.strip("|").split("|") for line in done.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0].strip(), r[1].strip()) for r in rows] == [
        ("0", "-"), ("1", "-"), ("2", "step"), ("2", "microbatch"), ("3", "step"),
        ("3", "microbatch")]
    for row in rows:
        figures = [float(row[2]), float(row[3]), float(row[5])]
        figures += [float(v) for v in row[6].split("/") + row[8].split("/")]
        assert all(math.isfinite(v) and v > 0 for v in figures), row
        if int(row[0]) < 3:
            assert all(abs(float(e.strip().rstrip("%"))) <= 10 for e in row[7].split("/")), row
