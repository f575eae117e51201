"""Every part of FSDP2 that ZeRO 2 and 3 read beyond its public API is there on this torch
(pipetrain.runtime.fsdp_parts), read the way this release names it; CI runs this on the
oldest and newest torch it claims (.ci/matrix). One real gloo process: fully_shard needs a
process group."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from pipetrain.runtime import fsdp_parts


class Bypass(nn.Module):
    """A layer with weights that its forward leaves out."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@pytest.fixture
def one_rank_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


def test_each_part_is_there_and_a_weight_without_gradient_is_reduced(one_rank_group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    unused = Bypass()  # in the model, its weights never reached by the backward
    model.append(unused)
    for layer in model:
        fully_shard(layer, mesh=one_rank_group)
    fully_shard(model, mesh=one_rank_group)
    fsdp_parts.reduce_unused_weights(model)
    groups = [g for part in model for g in fsdp_parts.param_groups(fsdp_parts.state(part))]
    assert len(groups) == 3
    weights = [w for g in groups for w in fsdp_parts.private(g, "fsdp_params")]
    assert len(weights) == 6
    assert callable(fsdp_parts.private(fsdp_parts.state(model),
                                       "_root_post_backward_final_callback"))
    model(torch.randn(5, 3)).sum().backward()
    assert len(fsdp_parts.all_states(model)) == 4  # the root's and each layer's (lazy: now)
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name}: no gradient reduced"
    assert all(torch.count_nonzero(p.grad.full_tensor()) == 0 for p in unused.parameters())
    assert torch.count_nonzero(model[0].weight.grad.full_tensor()) > 0


def test_each_collective_method_named_is_there_and_wrapped(one_rank_group):
    """fsdp_parts.COLLECTIVES (the methods whose failures ZeRO 2 and 3 name the lost replica
    by) are methods of this torch's parameter groups, and every call of theirs in a step goes
    through the wrapper."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    for layer in model:
        fully_shard(layer, mesh=one_rank_group)
    fully_shard(model, mesh=one_rank_group)
    seen: list[str] = []

    def bounded(what, method):
        def wrapped(*args, **options):
            seen.append(what)
            return method(*args, **options)
        return wrapped

    fsdp_parts.name_collective_failures(model, bounded)
    model(torch.randn(5, 3)).sum().backward()
    assert set(seen) == set(fsdp_parts.COLLECTIVES.values()), seen
