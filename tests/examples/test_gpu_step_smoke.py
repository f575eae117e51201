"""benchmarks/gpu_step.py --smoke: the GPU benchmark's whole path (both libraries, fresh
processes, the time and memory tables) on a tiny GPT on the CPU, as CI can run it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROWS = ("bf16, gpipe", "bf16, 1f1b", "fp32, gpipe", "fp32, 1f1b")


@pytest.mark.slow  # the benchmark's whole path, four fresh runs
def test_smoke_prints_every_row_and_the_libraries_agree(tmp_path):
    out = tmp_path / "gpu_step.md"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_step.py"), "--smoke", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = out.read_text().splitlines()
    cells = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in lines if "|" in line}
    for row in ROWS:
        pipetrain_ms, torch_ms, ratio, losses = (c.strip() for c in cells[row])
        assert pipetrain_ms.endswith(" ms") and torch_ms.endswith(" ms") and float(ratio) > 0
        ours, theirs = (float(v) for v in losses.split(","))
        # the same steps on the same batch from the same weights: the same loss (bf16: 1e-2)
        assert abs(ours - theirs) < 1e-2, (row, ours, theirs)
    assert "accumulation" in cells and "1f1b never" in cells
    assert float(cells["1f1b never"][0].split()[0]) > 0
