"""README blocks that tests/test_readme.py cannot run as they stand: the multi-node block, as
two torchrun agents on this machine, and the resume pattern, interrupted and resumed against
an uninterrupted run."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
from tests.runtime.harness import free_port
from tests.test_readme import README_BLOCKS, ROOT, Block, command

pytestmark = pytest.mark.readme  # README blocks: run with -m readme, as CI does

def readme_block(marker: str) -> Block:
    """The one README block whose code holds ``marker``."""
    found = [b for b in README_BLOCKS if marker in b.code]
    assert len(found) == 1, f"{len(found)} README blocks hold {marker!r}"
    return found[0]


def user_folder(path: Path) -> Path:
    """A working folder that sees the clone's examples, as a user's does."""
    path.mkdir()
    (path / "examples").symlink_to(ROOT / "examples")
    return path


def environment(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)


def test_the_multi_node_block_trains_two_replicas_of_a_two_stage_pipeline(tmp_path):
    """The block as written, with the variables it names set: NODE, HEAD, SHARED and STEPS (4
    steps of the default GPT keep it short)."""
    block = readme_block("--nnodes=2 --node_rank=$NODE --nproc_per_node=2")
    folder, shared = user_folder(tmp_path / "work"), tmp_path / "shared"
    head = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            ["bash", "-euo", "pipefail", "-c", block.code], cwd=folder,
            env=environment(NODE=str(node), HEAD=head, SHARED=str(shared), STEPS="4"),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in range(2)
    ]
    try:
        logs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    log = "\n".join(logs)
    assert [a.returncode for a in agents] == [0, 0], log[-4000:]
    assert re.search(r"4 ranks \(2 replica\(s\) x 2 ranks\), 1f1b, balance \[\d+, \d+\]", log), log
    assert "trained 4 steps" in log and "validation loss" in log, log[-4000:]
    assert (shared / "gpt" / "latest").read_text().strip() == "step-00000004"


def run_resume_block(folder: Path, code: str) -> None:
    block = Block(0, "python", code, None)
    done = subprocess.run(command(block, folder), cwd=folder, env=environment(),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def uninterrupted(steps: int) -> dict[str, torch.Tensor]:
    """The resume block's model trained ``steps`` steps in one process with plain PyTorch, on
    the batches of the block's ``batch(step)`` (taken from the README's own code)."""
    code = readme_block("checkpoint_every=5").code
    source = re.search(r"^def batch\(step\):.*?^    return .*?$", code, re.S | re.M)
    assert source, "the resume block defines batch(step)"
    scope: dict = {"torch": torch}
    exec(source.group(0), scope)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        x, y = scope["batch"](step)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


def test_the_resume_block_run_twice_ends_as_one_uninterrupted_run(tmp_path):
    """Run twice, the README's resume block trains steps 0-9, then resumes at 10 and trains
    10-19: its parameters must be those of 20 uninterrupted steps in one process (1e-6: two
    micro-batches only reorder the gradient's sums, about 1e-7 on this model; batches drawn
    out of step show at 1e-2), and the final save right after the periodic one of the same
    step leaves no second copy."""
    code = readme_block("checkpoint_every=5").code
    assert "model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))" in code
    assert "lr=0.1" in code and "total = pipe.step + 10" in code  # as uninterrupted() trains
    folder = user_folder(tmp_path / "work")
    block = Block(0, "python", code, None)
    for _ in range(2):
        done = subprocess.run(command(block, folder), cwd=folder, env=environment(),
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "trained to step 20" in done.stdout
    resumed, expected = pipetrain.consolidate(folder / "ckpt"), uninterrupted(20)
    assert resumed.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(resumed[key], expected[key], rtol=0, atol=1e-6)
    assert sorted(p.name for p in (folder / "ckpt").iterdir()) == [
        "latest", "step-00000015", "step-00000020"
    ]
