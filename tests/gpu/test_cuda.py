"""What only a GPU can check: CUDA-event profiling, stages on CUDA devices, NCCL between processes.

Without a GPU (as in CI) each test is skipped with its reason; on a GPU machine run
``python -m pytest tests/gpu -q -rs``. Tolerance as in tests/runtime/test_distributed.py (1e-5,
fp32), with TF32 matrix products switched off so that the GPU computes in true fp32; cuBLAS may
still pick other kernels for a micro-batch than for the whole batch, which moves results by a few
units in the last place, far inside 1e-5.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import pipetrain
from tests.runtime.harness import free_port, run_ranks, values
from tests.runtime.models import batches, mlp, reference, sgd

TOLERANCE = 1e-5
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
needs_gpu = pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU")
needs_two_gpus = pytest.mark.skipif(
    GPUS < 2, reason=f"needs 2 CUDA GPUs (NCCL joins one GPU per process); found {GPUS}"
)



def _on(data, device: str):
    return [(x.to(device), y.to(device)) for x, y in data]


def _assert_state_matches(state: dict, expected: dict) -> None:
    assert list(state) == list(expected)
    for key, value in state.items():
        diff = (value.float().cpu() - expected[key].float().cpu()).abs().max().item()
        assert diff <= TOLERANCE, f"{key}: {diff}"


@needs_gpu
def test_profile_on_cuda_times_layers_with_events():
    model, x = mlp(width=256), torch.randn(64, 256)
    on_cpu = pipetrain.profile(copy.deepcopy(model), x, warmup=1, repeats=2)
    on_gpu = pipetrain.profile(model, x.cuda(), device="cuda", warmup=1, repeats=3)
    assert on_gpu.device == torch.cuda.get_device_name(0)
    assert all(layer.forward > 0 and layer.backward > 0 for layer in on_gpu.layers)
    # Shapes do not depend on the device: the byte counts are the CPU profile's.
    assert [layer.activation_bytes for layer in on_gpu.layers] == [
        layer.activation_bytes for layer in on_cpu.layers
    ]
    assert [layer.param_bytes for layer in on_gpu.layers] == [
        layer.param_bytes for layer in on_cpu.layers
    ]


@needs_gpu
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_stages_on_cuda_match_single_process_training(schedule):
    devices = [f"cuda:{s % GPUS}" for s in range(2)]
    data = batches(3)
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=4, schedule=schedule, devices=devices, track_memory=True,
        loss_fn=nn.functional.cross_entropy, optimizer=sgd,
    )
    losses = [float(pipe.train_step(x, y)) for x, y in _on(data, "cuda:0")]
    expected_state, expected_losses = reference(mlp().cuda(), _on(data, "cuda:0"))
    _assert_state_matches(pipe.module.state_dict(), expected_state)
    assert losses == pytest.approx(expected_losses, abs=1e-6)
    assert all(stage.device.type == "cuda" for stage in pipe.stages)
    assert all(m > 0 for m in pipe.metrics["stage_peak_memory"]), "CUDA bytes allocated"


def _nccl_train(rank: int, world: int) -> dict:
    data = _on(batches(3), f"cuda:{rank}")
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=4, schedule="1f1b", loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, timeout=60,
    )
    losses = [float(pipe.train_step(x, y)) for x, y in data]  # 0-d device tensors
    state = {k: v.cpu() for k, v in pipe.module.state_dict().items()}
    return {"state": state, "losses": losses, "device": str(pipe.stages[0].device)}


@needs_two_gpus
def test_nccl_pipeline_matches_single_process_training():
    results = values(run_ranks(_nccl_train, 2, backend="nccl", deadline=180))
    assert [r["device"] for r in results] == ["cuda:0", "cuda:1"]
    expected_state, expected_losses = reference(mlp(), batches(3))
    _assert_state_matches({**results[0]["state"], **results[1]["state"]}, expected_state)
    assert results[1]["losses"] == pytest.approx(expected_losses, abs=1e-5)


def _launch_two(script: str) -> list[subprocess.CompletedProcess]:
    """Run ``script`` as ranks 0 and 1 of a two-process job on this node, as torchrun would."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
        )
        for r in range(2)
    ]
    done = []
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    return done


@pytest.mark.skipif(GPUS != 1, reason=f"needs a machine with exactly one GPU; found {GPUS}")
def test_more_processes_than_gpus():
    """NCCL asked for: refused with the fix. Chosen by default: gloo on the CPU, with a warning."""
    refused = _launch_two("""
        import datetime, torch.distributed as dist, pipetrain
        try:
            pipetrain.init_distributed(backend="nccl", timeout=20)
        except RuntimeError as error:
            print(error)
    """)
    assert "LOCAL_RANK 1 needs GPU 1, but this node has 1 GPU(s)" in refused[1].stdout
    assert "--nproc_per_node=1" in refused[1].stdout
    chosen = _launch_two("""
        import torch.distributed as dist, pipetrain
        pipetrain.init_distributed(timeout=60)
        print(dist.get_backend(), pipetrain.runtime.distributed.local_device())
    """)
    assert [c.stdout.split() for c in chosen] == [["gloo", "cpu"]] * 2, chosen
    assert "2 processes on this node but 1 GPU(s)" in chosen[0].stderr
