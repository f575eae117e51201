"""examples/finetune_hf.py run as a user runs it (torchrun, 2 ranks, gloo), a few steps: it
plans, fine-tunes, writes a Hugging Face directory that transformers loads with no key
warnings, and generates from it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runtime.harness import free_port

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')"
)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # two processes that import transformers, then a third step on rank 0
def test_finetune_hf_writes_a_directory_transformers_loads(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
         str(ROOT / "examples" / "finetune_hf.py"), "--out", str(tmp_path), "--steps", "3",
         "--seq", "16", "--microbatch", "2", "--microbatches", "2", "--log-every", "1"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "step 2  loss" in done.stdout and "sample (temperature 0.8" in done.stdout
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "tuned", output_loading_info=True)
    assert not any(info.values()), info
