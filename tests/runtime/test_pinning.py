"""Pinning ranks to processors: each local rank gets its own share, threads started after
(gloo's I/O loop among them) inherit it, and a trace records it so its simulated twin knows
how many processors the ranks shared."""

from __future__ import annotations

import os
import threading

import pytest
import torch.distributed as dist

import pipetrain
from pipetrain.distributed import pin_to_cores
from tests.runtime.harness import free_port, run_ranks, values

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


def _last_of_too_many(rank: int, world: int) -> list[int]:
    return pin_to_cores(len(CPUS), len(CPUS) + 1)  # the rank one beyond the processors


@pytest.mark.skipif(not CPUS, reason="needs os.sched_getaffinity (Linux)")
def test_more_ranks_than_processors_go_round_robin():
    got = values(run_ranks(_last_of_too_many, 1))
    assert got == [[CPUS[0]]], "it wraps round to the first processor"


def test_a_local_rank_outside_the_local_world_is_refused():
    with pytest.raises(ValueError, match="local rank 2 is not in 0..1"):
        pin_to_cores(2, 2)
