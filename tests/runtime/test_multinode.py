"""Two torchrun agents on loopback act as two nodes of 2 ranks each: 2 stages x 2 replicas,
launched as a cluster is (c10d rendezvous), trained to equivalence with one process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.runtime.harness import free_port
from tests.runtime.models import batches, mlp, reference
from tests.runtime.test_distributed import TOLERANCE

JOB = Path(__file__).parent / "jobs" / "hybrid_job.py"


def test_two_agents_as_two_nodes(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    agents = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node}",
             "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
             "--rdzv-id=pipetrain-test", str(JOB), "--out", str(tmp_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in range(2)
    ]
    logs = [agent.communicate(timeout=240)[0] for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], "\n".join(log[-3000:] for log in logs)
    expected, expected_losses = reference(mlp(), batches(3))
    for rank in range(4):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        assert result["losses"] == pytest.approx(expected_losses, abs=1e-6)
        for key, value in result["state"].items():
            assert (value - expected[key]).abs().max().item() <= TOLERANCE, (rank, key)
