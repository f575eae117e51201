"""Pinning ranks to processors: each local rank gets its own share, threads started after
(gloo's I/O loop among them) inherit it, a rank with processors of its own runs its pipeline's
I/O threads in the idle class, and a trace records the pinning so its simulated twin knows
how many processors the ranks shared."""

from __future__ import annotations

import os
import threading

import pytest
import torch
import torch.distributed as dist
from torch import nn

import pipetrain
from pipetrain.runtime.distributed import _io_threads, pin_to_cores
from tests.runtime.harness import free_port, run_ranks, values
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_distributed import assert_trains_like_one_process

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def _pinned(rank: int, world: int, port: int) -> tuple[list[int], list[int]]:
    """Start the job again through init_distributed(pin_cores=True); return the processors of
    this thread and of a thread started afterwards."""
    dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    pipetrain.init_distributed("gloo", timeout=30, pin_cores=True)
    seen: list[int] = []
    later = threading.Thread(target=lambda: seen.extend(sorted(os.sched_getaffinity(0))))
    later.start()
    later.join()
    return sorted(os.sched_getaffinity(0)), seen


@pytest.mark.skipif(not CPUS, reason="needs os.sched_getaffinity (Linux)")
def test_each_local_rank_gets_its_own_processors_and_threads_inherit_them():
    world = 2
    got = values(run_ranks(_pinned, world, free_port(), deadline=60))
    share = len(CPUS) // world
    for rank, (mine, thread) in enumerate(got):
        assert thread == mine, "a thread started after pinning runs on the rank's processors"
        if share:
            assert mine == CPUS[rank * share : (rank + 1) * share]
        else:
            assert mine == [CPUS[rank % len(CPUS)]]
    if share:
        assert not set(got[0][0]) & set(got[1][0]), "ranks share no processor"


def _quiet_pipeline(rank: int, world: int, port: int, local_world: int) -> dict:
    """Join pinned as local rank ``rank`` of ``local_world``, build a 2-stage pipeline and train
    it; return the scheduling policies of the gloo I/O threads that were there before the
    pipeline and of those its groups started, and what training gave."""
    dist.destroy_process_group()
    os.environ.update(MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(local_world))
    pipetrain.init_distributed("gloo", timeout=30, pin_cores=True)
    before = _io_threads()
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=4, loss_fn=nn.functional.cross_entropy, optimizer=sgd, timeout=60
    )
    started = _io_threads() - before
    losses = [pipe.train_step(x, y) for x, y in batches(3)]
    return {
        "before": [os.sched_getscheduler(t) for t in before],
        "started": [os.sched_getscheduler(t) for t in started],
        "state": pipe.module.state_dict(), "losses": losses,
    }


@pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 processors to give each rank its own")
@pytest.mark.skipif(
    torch.__version__ < "2.11",  # torch.torch_version.TorchVersion compares as a version
    reason="gloo in torch <= 2.10 leaves its I/O threads unnamed (no gloo_tcp_loop), so there "
    "are none to find and quiet: a speed-up such a torch does without",
)
@pytest.mark.parametrize("shared", [False, True], ids=["own-processors", "shared-processors"])
def test_pinned_ranks_with_processors_of_their_own_run_the_pipelines_io_idle(shared):
    """The groups that carry messages get idle I/O threads, the agreement's does not."""
    # one rank more per node than processors: pinned round robin, shared, left alone
    local_world = len(CPUS) + 1 if shared else 2
    got = values(run_ranks(_quiet_pipeline, 2, free_port(), local_world, deadline=120))
    for result in got:
        assert result["before"] and set(result["before"]) == {os.SCHED_OTHER}, \
            "the default group's I/O thread, started before the pipeline, is left alone"
        started = sorted(result["started"])
        assert len(started) >= 2, "the pipeline's groups start I/O threads of their own"
        if shared:
            assert set(started) == {os.SCHED_OTHER}
        else:  # the agreement's group keeps its I/O awake (placement._new_groups), no other
            assert started.count(os.SCHED_OTHER) == 1 and set(started) == {
                os.SCHED_OTHER, os.SCHED_IDLE}, started
    assert_trains_like_one_process(got, mlp(), batches(3))


def _last_of_too_many(rank: int, world: int) -> list[int]:
    return pin_to_cores(len(CPUS), len(CPUS) + 1)  # the rank one beyond the processors


@pytest.mark.skipif(not CPUS, reason="needs os.sched_getaffinity (Linux)")
def test_more_ranks_than_processors_go_round_robin():
    got = values(run_ranks(_last_of_too_many, 1))
    assert got == [[CPUS[0]]], "it wraps round to the first processor"


def test_a_local_rank_outside_the_local_world_is_refused():
    with pytest.raises(ValueError, match="local rank 2 is not in 0..1"):
        pin_to_cores(2, 2)
