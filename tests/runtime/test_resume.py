"""A rank killed mid-training: torchrun restarts the group, which resumes from the newest
checkpoint by itself and ends with the very parameters of an uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.harness import free_port

JOB = Path(__file__).parent / "jobs" / "resume_job.py"


def torchrun(tmp: Path, name: str, *extra: str) -> tuple[dict, str]:
    out = tmp / name
    out.mkdir()
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(JOB), "--dir", str(out / "ckpt"), "--out", str(out), *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    state = {}
    for rank in range(2):
        state.update(torch.load(out / f"final-rank{rank}.pt", weights_only=True))
    return state, done.stdout + done.stderr


@pytest.mark.slow  # three torchrun starts: 40 s; tests/runtime/test_checkpoint.py resumes fast
def test_killed_rank_resumes_bit_exact(tmp_path):
    killed, log = torchrun(tmp_path, "killed", "--kill-after", "6")
    assert "attempt 1 from step 6" in log, log  # restarted, resumed from step 6's checkpoint
    straight, _ = torchrun(tmp_path, "straight")
    assert killed.keys() == straight.keys()
    for key in straight:
        assert torch.equal(killed[key], straight[key]), key
