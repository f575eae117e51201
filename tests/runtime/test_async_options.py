"""Asynchronous schedules with data-parallel replicas, recomputation and gradient clipping, each
against what its definition says, computed in one process:

* replicas: each stage's replicas average their gradients once per weight version, just before
  the stage's update, so 2 stages x 2 replicas (4 gloo processes) train as one process training
  the same delayed updates (DelayedPipeline) on the whole batch, each replica's micro-batch k
  a share of the rows of the whole batch's micro-batch k; a weight only some replicas' backwards
  reached is averaged as in one process, one that none reached keeps no gradient;
* recomputation: the backward recomputes the forward on the weight version the forward read
  (the stashed or predicted copy), so a recomputed run equals the plain one, in threads and in
  2 gloo processes (dropout replayed too); without stashing it is refused where the weights
  change between forward and backward;
* clipping: each stage clips its update's gradients by their own norm (the stages of one
  version update at different moments: pipetrain/runtime/inflight.py), as DelayedPipeline's
  ``clip_grad_norm`` computes it in one thread with torch.nn.utils.clip_grad_norm_.

Tolerance 1e-5 (float32): a replica average of two row-means, or a mini-batch gradient summed
over micro-batches, equals the one-process mean over all rows up to rounding in the order of
the sums (about 1e-7 relative per update), which momentum carries over a few updates.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.runtime.collectives import Collectives
from pipetrain.runtime.data_parallel import VersionSync
from tests.benchmarks.test_delayed import delayed_run
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd

BALANCE = [4, 8]
CHUNKS = 2
STEPS = 3
REPLICAS = 2
DROPOUT_BALANCE = [5, 9]
MAX_NORM = 0.3  # below every stage's gradient norm here: every update is clipped


def dropout_mlp() -> nn.Sequential:
    """:func:`mlp` with a dropout on each stage of DROPOUT_BALANCE: a recomputation must
    replay its mask."""
    body = mlp()
    return nn.Sequential(*body[:2], nn.Dropout(0.2), *body[2:10], nn.Dropout(0.2), *body[10:])


def _train(model: nn.Sequential, balance: list[int], data: list, **options: Any) -> dict:
    """Train ``data`` with the pipeline ``options`` describe; its losses, state and the
    forward calls of the first stage here (a recomputed forward runs twice)."""
    pipe = pipetrain.Pipeline(model, balance, chunks=CHUNKS, loss_fn=nn.functional.cross_entropy,
                              optimizer=sgd, timeout=60, **options)
    calls: list[int] = []
    pipe.stages[0].module[0].register_forward_hook(lambda *_: calls.append(1))
    losses = [float(pipe.train_step(x, y)) for x, y in data]
    pipe.flush()
    return {"losses": losses, "state": pipe.module.state_dict(), "calls": len(calls)}


def _close(got: dict, expected: dict, tolerance: float) -> None:
    assert got["losses"] == pytest.approx(expected["losses"], abs=tolerance)
    for key, value in got["state"].items():
        assert (expected["state"][key] - value).abs().max().item() <= tolerance, key


# -- recomputation -------------------------------------------------------------------------

RECOMPUTED = {
    "pipedream": dict(schedule="pipedream"),  # prediction and compensation ("auto")
    "pipedream-stash": dict(schedule="pipedream", weight_prediction=None,
                            delay_compensation=None),
    "2bw": dict(schedule="pipedream-2bw"),
    "2bw-stash": dict(schedule="pipedream-2bw", weight_prediction=None, delay_compensation=None),
}


def _recomputed_and_not(devices: list[str] | None, options: dict) -> dict:
    data = batches(STEPS)
    return {
        str(mode): _train(dropout_mlp(), DROPOUT_BALANCE, data, recompute=mode, devices=devices,
                          **options)
        for mode in ("never", "always", ["always", "never"])
    }


@pytest.mark.parametrize("name", list(RECOMPUTED))
def test_a_recomputed_forward_reads_the_version_its_forward_read(name):
    runs = _recomputed_and_not(["cpu"] * 2, RECOMPUTED[name])
    plain = runs.pop("never")
    assert plain["calls"] == STEPS * CHUNKS
    for mode, run in runs.items():
        _close(run, plain, 0.0)  # the same tensors, the same dropout masks: bit for bit
        assert run["calls"] == 2 * plain["calls"], mode  # stage 0 ran its forward again


def _recomputed_ranks(rank: int, world: int) -> dict:
    return {name: _recomputed_and_not(None, options) for name, options in RECOMPUTED.items()}


@pytest.mark.slow
def test_recomputation_in_processes_equals_threads():
    per_rank = values(run_ranks(_recomputed_ranks, 2, deadline=180))
    for name, options in RECOMPUTED.items():
        here = _recomputed_and_not(["cpu"] * 2, options)
        for mode in ("never", "always"):
            got = {"losses": per_rank[0][name][mode]["losses"],
                   "state": {k: v for r in per_rank for k, v in r[name][mode]["state"].items()}}
            _close(got, here[mode], 1e-6)


def test_recomputation_without_stashing_only_where_no_update_intervenes():
    data = batches(STEPS)
    stale = dict(schedule="pipedream", weight_stashing=False, devices=["cpu"] * 2)
    for recompute in ("always", ["always", "never"]):
        with pytest.raises(ValueError, match=r"weight_stashing=False keeps no copy.*"
                           r"keep weight_stashing=True.*recompute only the last stage"):
            _train(mlp(), BALANCE, data, recompute=recompute, **stale)
    # the last stage updates after its backward: its recomputation reads the forward's weights
    last = _train(dropout_mlp(), DROPOUT_BALANCE, data, recompute=["never", "always"], **stale)
    _close(last, _train(dropout_mlp(), DROPOUT_BALANCE, data, **stale), 0.0)


# -- clipping -------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_clipping_clips_each_stage_by_its_own_norm(schedule):
    data = batches(STEPS)
    clipped = _train(mlp(), BALANCE, data, schedule=schedule, clip_grad_norm=MAX_NORM,
                     devices=["cpu"] * 2)
    delayed, losses = delayed_run(mlp(), BALANCE, schedule, data, CHUNKS, optimizer=sgd,
                                  clip_grad_norm=MAX_NORM)
    _close(clipped, {"losses": losses, "state": delayed.module.state_dict()}, 1e-5)
    free = _train(mlp(), BALANCE, data, schedule=schedule, devices=["cpu"] * 2)
    assert max((free["state"][k] - v).abs().max().item() for k, v in clipped["state"].items()) \
        > 1e-3  # the clipping bit


# -- replicas -------------------------------------------------------------------------------

REPLICATED = {
    "pipedream": dict(schedule="pipedream"),
    "2bw": dict(schedule="pipedream-2bw"),
    "2bw-clip": dict(schedule="pipedream-2bw", clip_grad_norm=MAX_NORM),
    "pipedream-stash-recompute": dict(schedule="pipedream", weight_prediction=None,
                                      delay_compensation=None, recompute="always"),
}


def _share(batch: torch.Tensor, replica: int) -> torch.Tensor:
    """Replica ``replica``'s rows of ``batch``: its micro-batch k is its share of the whole
    batch's micro-batch k (CHUNKS contiguous blocks, each cut into REPLICAS parts)."""
    return batch.unflatten(0, (CHUNKS, REPLICAS, -1))[:, replica].flatten(0, 1)


def _replica(rank: int, world: int, configs: list[str]) -> dict:
    replica = rank // len(BALANCE)
    data = [(_share(x, replica), _share(y, replica)) for x, y in batches(STEPS)]
    return {name: _train(mlp(), BALANCE, data, **REPLICATED[name]) for name in configs}


def _replicas_equal_one_process(configs: list[str]) -> None:
    per_rank = values(run_ranks(_replica, len(BALANCE) * REPLICAS, configs, deadline=240))
    data = batches(STEPS)
    for name in configs:
        options = dict(REPLICATED[name])
        options.pop("recompute", None)  # the same updates (test above): not DelayedPipeline's
        delayed, losses = delayed_run(mlp(), BALANCE, options.pop("schedule"), data, CHUNKS,
                                      optimizer=sgd, **options)
        expected = {"losses": losses, "state": delayed.module.state_dict()}
        for replica in range(REPLICAS):
            ranks = per_rank[replica * len(BALANCE) : (replica + 1) * len(BALANCE)]
            got = {"losses": ranks[0][name]["losses"],
                   "state": {k: v for r in ranks for k, v in r[name]["state"].items()}}
            _close(got, expected, 1e-5)


def test_replicas_average_each_version_as_one_process_on_the_whole_batch():
    _replicas_equal_one_process(["2bw"])


@pytest.mark.slow
def test_replicas_of_every_asynchronous_schedule_as_one_process():
    _replicas_equal_one_process(list(REPLICATED))


def _version_sync(rank: int, world: int) -> list:
    group = torch.distributed.new_group(list(range(world)))
    both, one, none = (nn.Parameter(torch.zeros(3)) for _ in range(3))
    other = nn.Parameter(torch.zeros(2, dtype=torch.float64))  # a buffer of its own dtype
    both.grad = torch.full((3,), float(rank + 1))
    one.grad = torch.ones(3) if rank == 0 else None  # only replica 0's backward reached it
    other.grad = torch.full((2,), 4.0 * rank, dtype=torch.float64)
    collectives = Collectives(None, {}, 30)  # type: ignore[arg-type]  # no failure to name
    VersionSync([both, one, none, other], group, 1 / world, collectives).finish()
    return [None if p.grad is None else p.grad.tolist() for p in (both, one, none, other)]


def test_a_version_sync_averages_and_keeps_no_gradient_no_replica_made():
    """As one process on both replicas' rows: a weight one replica's backward reached gets
    half its gradient on both, one that none reached keeps None (its optimizer skips it)."""
    for got in values(run_ranks(_version_sync, 2, deadline=60)):
        assert got == [[1.5] * 3, [0.5] * 3, None, [2.0] * 2]
