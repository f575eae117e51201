"""ZeRO 1-3 over each stage's replicas (pipetrain/runtime/sharding.py) against ZeRO 0 and
single-process training, on real gloo processes: AdamW, clipping by the global norm (small
enough to bite) and a LambdaLR schedule, 3 steps.

Tolerances (fp32): 1e-6 against zero=0, whose gradients are the same sums in another order
(reduce-scatter instead of all-reduce) and whose optimizer runs the same arithmetic per element;
1e-5 against single-process training, as test_hybrid.py (replicas also change the order in which
a mini-batch's contributions are summed).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import pipetrain
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp

STEPS = 3
CLIP = 0.5  # the gradients' norm is above it at every step here: the clip changes the answer
AGAINST_ZERO = 1e-6
AGAINST_ONE_PROCESS = 1e-5


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def single_process() -> dict[str, torch.Tensor]:
    """The same 3 steps in one process: the whole batch, clip_grad_norm_, then the step."""
    model = mlp()
    opt = adamw(model.parameters())
    schedule = decay(opt)
    for x, y in batches(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        schedule.step()
    return model.state_dict()


def _whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict with every sharded tensor gathered (a collective over its replicas)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _train_each_level(rank: int, world: int, replicas: int) -> dict[int, dict]:
    """Per zero level: this rank's whole parameters after the steps, the gradient norms, and
    what it sharded (its parameters' and optimizer state's local elements)."""
    out = {}
    for zero in (0, 1, 2, 3):
        pipe = pipetrain.Pipeline(
            mlp(), [5, 7], chunks=2, schedule="1f1b", replicas=replicas, zero=zero,
            loss_fn=nn.functional.cross_entropy, optimizer=adamw, lr_scheduler=decay,
            clip_grad_norm=CLIP, timeout=60,
        )
        share = len(batches(1)[0][0]) // replicas
        part = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
        norms = []
        for x, y in batches(STEPS):
            pipe.train_step(x[part], y[part])
            norms.append(pipe.metrics["grad_norm"])
        stage = pipe.stages[0]
        optimizer = stage.optimizer
        assert optimizer is not None
        mine = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        out[zero] = {
            "state": _whole(pipe.module.state_dict()),
            "norms": norms,
            "weights": sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel()
                for p in stage.module.parameters()
            ),
            "optimizer": sum(
                (t.to_local() if isinstance(t, DTensor) else t).numel()
                for s in mine.state.values() for t in s.values() if t.dim() > 0
            ),
        }
    return out


def _check(results: list[dict[int, dict]], replicas: int) -> None:
    expected = single_process()
    for ranks in results:
        base = ranks[0]
        assert min(base["norms"]) > CLIP  # the clip was in force at every step
        for zero in (1, 2, 3):
            got = ranks[zero]
            assert got["norms"] == pytest.approx(base["norms"], rel=1e-6)
            for key, value in got["state"].items():
                assert (value - base["state"][key]).abs().max().item() <= AGAINST_ZERO, (zero, key)
                assert (value - expected[key]).abs().max().item() <= AGAINST_ONE_PROCESS, key
        # what each level shards, on this rank: ZeroRedundancyOptimizer partitions whole
        # parameters; FSDP2 every parameter's dim 0, and between steps it holds only the
        # shards at zero 2 too (zero 3 differs in the step, when weights are gathered)
        assert base["optimizer"] == 2 * base["weights"]  # AdamW: two moments per weight
        assert ranks[1]["weights"] == base["weights"]
        assert ranks[1]["optimizer"] < base["optimizer"]
        for zero in (2, 3):
            assert ranks[zero]["weights"] < base["weights"]
            assert ranks[zero]["optimizer"] == 2 * ranks[zero]["weights"]
    keys = set().union(*(r[3]["state"].keys() for r in results))
    assert keys == set(expected)


def test_zero_1_2_3_train_as_zero_0_and_one_process_on_2_stages_x_2_replicas():
    results = values(run_ranks(_train_each_level, 4, 2, deadline=400))
    _check(results, 2)


@pytest.mark.slow
def test_zero_1_2_3_train_as_zero_0_and_one_process_on_2_stages_x_4_replicas():
    results = values(run_ranks(_train_each_level, 8, 4, deadline=900))
    _check(results, 4)
