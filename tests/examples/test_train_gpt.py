"""examples/train_gpt.py run as a user runs it: torchrun with 2 ranks (gloo, real processes)
and ``--single-process``, on a tiny GPT for a few steps.

The pipelined run's checkpoint, consolidated, must hold the parameters of the single-process
run (fp32, synchronous schedule, same seed and batches, clipping and LR schedule on): the
micro-batches' mean losses average to the whole batch's, so only the order of float additions
differs, and 1e-5 leaves room for that over a few AdamW steps, no more.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipetrain
from tests.runtime.harness import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"
TINY = [
    "--steps", "4", "--dim", "32", "--blocks", "2", "--heads", "2", "--context", "32",
    "--lr", "1e-2", "--warmup", "2", "--clip", "0.5",
    "--sample-length", "20", "--log-every", "1",
    "--precision", "fp32",  # "auto" picks bf16 on a CPU with AVX512-BF16 or AMX
]


def run(command: list[str], timeout: float = 240) -> str:
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


BATCH = ["--batch", "8", "--chunks", "4"]


def pipelined(folder: Path, *extra: str, batch: list[str] = BATCH) -> str:
    return run([
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        str(SCRIPT), *TINY, *batch, "--checkpoint-dir", str(folder), *extra,
    ])


def single(folder: Path, *extra: str) -> str:
    return run([sys.executable, str(SCRIPT), *TINY, *BATCH, "--checkpoint-dir", str(folder),
                "--single-process", *extra])


def validation_loss(log: str) -> float:
    found = re.search(r"^validation loss (\d+\.\d+)", log, re.MULTILINE)
    assert found, log
    return float(found.group(1))


def grad_norms(log: str) -> list[float]:
    return [float(v) for v in re.findall(r"grad norm +(\d+\.\d+)", log)]


def assert_same_parameters(pipelined_dir: Path, single_dir: Path, tolerance: float) -> None:
    theirs = torch.load(single_dir / "single-process.pt", weights_only=True)
    ours = pipetrain.consolidate(pipelined_dir)
    assert ours.keys() == theirs.keys()
    for key in theirs:
        torch.testing.assert_close(ours[key], theirs[key], rtol=tolerance, atol=tolerance,
                                   msg=lambda m, key=key: f"{key}: {m}")


def check_against_single(tmp_path: Path, *extra: str) -> str:
    log = pipelined(tmp_path / "pipe", *extra)
    reference = single(tmp_path / "single")
    assert_same_parameters(tmp_path / "pipe", tmp_path / "single", 1e-5)
    assert validation_loss(log) == pytest.approx(validation_loss(reference), abs=2e-4)
    return log


def test_pipelined_run_matches_single_process_and_samples(tmp_path):
    log = check_against_single(tmp_path)
    assert re.search(r"1f1b, balance \[\d, \d\], .* fp32", log), log  # planned: 2 stages
    from examples.models import gpt

    unique = sum(p.numel() for p in gpt(dim=32, blocks=2, heads=2, context=32).parameters())
    assert f"GPT of {unique:,} parameters" in log, log  # the tied weight counted once
    norms = grad_norms(log)
    assert len(norms) == 4 and max(norms) > 0.5, log  # the clip at 0.5 was active
    assert validation_loss(log) < 5.5  # below ln(256) = 5.545, a uniform guess
    assert "sample (temperature 0.8, seed 0):\nAnd Jesus said unto them, " in log, log


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "zb-h1"])
def test_other_schedules_match_single_process(tmp_path, schedule):
    log = check_against_single(tmp_path, "--schedule", schedule, "--no-sample")
    balance = r"\[1, 1, 1, 1\]" if schedule == "interleaved" else r"\[\d, \d\]"  # 2 ranks x 2|1
    assert re.search(rf"{schedule}, balance {balance}", log), log


@pytest.mark.slow
def test_bf16_tracks_single_process_autocast(tmp_path):
    """bf16 keeps 8 bits of mantissa (relative error ~4e-3 per rounding), and the pipeline
    rounds at other places than one process does (activations cross the stage boundary in
    bf16), so the runs agree to a loss difference of 2e-2 over 4 steps, not bit for bit."""
    log = pipelined(tmp_path / "pipe", "--precision", "bf16", "--no-sample")
    reference = single(tmp_path / "single", "--precision", "bf16", "--no-sample")
    assert "bf16" in log
    assert validation_loss(log) == pytest.approx(validation_loss(reference), abs=2e-2)


@pytest.mark.slow
def test_plan_from_the_cli(tmp_path):
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    kwargs = '{"dim": 32, "blocks": 2, "heads": 2, "context": 32}'
    run([sys.executable, "-m", "pipetrain", "profile", "examples.models:gpt", "--kwargs", kwargs,
         "--input-shape", "2,32", "--input-dtype", "int64", "--input-high", "256",
         "--threads", "1", "-o", str(profile)])
    run([sys.executable, "-m", "pipetrain", "plan", str(profile), "--stages", "2",
         "--microbatches", "4", "--cores", "2", "-o", str(plan)])
    log = pipelined(tmp_path / "pipe", "--plan", str(plan), "--no-sample", batch=[])
    assert "4 micro-batches of 2 x 32 bytes" in log, log  # batch and chunks from the plan
    reference = single(tmp_path / "single", "--no-sample")
    assert_same_parameters(tmp_path / "pipe", tmp_path / "single", 1e-5)
    assert validation_loss(log) == pytest.approx(validation_loss(reference), abs=2e-4)


def rank_pid(agent: subprocess.Popen, rank: int) -> int | None:
    """The process id of the agent's worker of ``rank`` (from /proc: its parent and RANK)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile, or not ours to read
        if parent == agent.pid and f"RANK={rank}".encode() in environ:
            return int(stat.parent.name)
    return None


def saved_step(folder: Path) -> int:
    """The step of the checkpoint ``latest`` names in ``folder`` (-1: none yet)."""
    try:
        return int((folder / "latest").read_text().strip()[5:13])
    except (OSError, ValueError):
        return -1


RESUMABLE = ["--steps", "16", "--checkpoint-every", "4", "--no-sample"]


@pytest.mark.slow  # ~20 s of torchrun; by default the README resume block and test_resume.py
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds ranks in /proc")
def test_a_killed_rank_resumes_from_the_last_checkpoint(tmp_path):
    """As the README tells users: torchrun --max-restarts=1, then kill -9 of rank 1 once a
    periodic checkpoint is on disk. The restarted job resumes from the newest checkpoint, on the
    batches and learning rates an uninterrupted run trains with, and ends with the parameters
    of the uninterrupted single-process run (1e-5, as the test above: only the order of float
    additions differs; a batch or a learning rate out of step shows at 1e-3 or more)."""
    folder = tmp_path / "killed"
    agent = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--max-restarts=1",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPT), *TINY,
         *BATCH, *RESUMABLE, "--checkpoint-dir", str(folder)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        while saved_step(folder) < 4 and agent.poll() is None:
            time.sleep(0.005)
        killed_after = saved_step(folder)
        victim = rank_pid(agent, 1)
        assert victim is not None and killed_after < 16, "the run ended before the kill"
        os.kill(victim, signal.SIGKILL)
        log = agent.communicate(timeout=240)[0]
    finally:
        agent.kill()
    assert agent.returncode == 0, log[-3000:]
    resumed = re.search(r"^resumed from step (\d+) of", log, re.MULTILINE)
    assert resumed, log[-3000:]
    step = int(resumed.group(1))
    assert step % 4 == 0 and killed_after <= step < 16, (killed_after, step)
    assert f"trained {16 - step} steps" in log, log[-3000:]
    single(tmp_path / "single", *RESUMABLE)
    assert_same_parameters(folder, tmp_path / "single", 1e-5)


def example_module():
    """examples/train_gpt.py imported as its run imports it (examples/ on the path)."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import train_gpt
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return train_gpt


def test_stages_that_do_not_divide_the_world_are_refused():
    train_gpt = example_module()
    args = train_gpt.parse_args(["--stages", "3"])
    refused = r"3 stages do not divide the 4 ranks .*one of \[1, 2, 4\]"
    with pytest.raises(SystemExit, match=refused):
        train_gpt.ranks_per_pipeline(args, None, 4)
    assert train_gpt.ranks_per_pipeline(train_gpt.parse_args(["--stages", "2"]), None, 4) == 2
    assert train_gpt.ranks_per_pipeline(train_gpt.parse_args([]), None, 4) == 4  # no replicas
    args = train_gpt.parse_args(["--stages", "2", "--batch", "12", "--chunks", "4"])
    with pytest.raises(SystemExit, match=r"--batch 12 does not split into 2 replica\(s\) x 4 "
                       r"micro-batches: pass a multiple of 8"):
        train_gpt.batch_layout(args, None, 2)


def test_a_new_run_into_an_earlier_runs_folder_is_refused(tmp_path):
    """The README's first command leaves steps 250 and 300 in gpt-checkpoint; a second run
    there (`--steps 20 --schedule zb-h1`) is refused on every rank before it trains, naming the
    folder and the ways on, and the checkpoints stay."""
    pipe = pipetrain.Pipeline(torch.nn.Sequential(torch.nn.Linear(2, 2)), [1], devices=["cpu"])
    for step in (250, 300):
        pipe.step = step
        pipe.save(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPT), *TINY,
         *BATCH, "--checkpoint-dir", str(tmp_path), "--steps", "20", "--no-sample",
         "--schedule", "zb-h1"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    refused = (f"train_gpt.py: {tmp_path} holds checkpoints of an earlier run (the newest: "
               "step-00000300)")
    assert done.returncode != 0 and done.stderr.count(refused) == 2, done.stderr[-3000:]
    assert "--resume" in done.stderr and "--fresh" in done.stderr
    assert "step " not in done.stdout, done.stdout  # not one step trained
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "step-00000250", "step-00000300"
    ]


@pytest.mark.slow  # two torchrun runs of the tiny GPT, ~30 s
def test_the_readme_runs_in_order_lose_no_checkpoint(tmp_path):
    """A first run, then a second of another schedule into the same folder: refused as it
    stands (exit status 1, the first run's checkpoints untouched); with --fresh it trains and
    prunes only its own checkpoints."""
    folder = tmp_path / "ckpt"
    pipelined(folder, "--no-sample", "--checkpoint-every", "2")
    first = sorted(p.name for p in folder.iterdir() if p.is_dir())
    assert first == ["step-00000002", "step-00000004"]
    again = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
         "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", str(SCRIPT), *TINY,
         *BATCH, "--checkpoint-dir", str(folder), "--steps", "2", "--schedule", "zb-h1"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert again.returncode != 0 and "holds checkpoints of an earlier run" in again.stderr
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == first
    log = pipelined(folder, "--no-sample", "--steps", "2", "--schedule", "zb-h1", "--fresh")
    assert "trained 2 steps" in log, log
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [
        "step-00000000", "step-00000002", "step-00000002.0001", "step-00000004"
    ]
