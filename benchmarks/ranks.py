"""Starting a benchmark's ranks: a free port, spawned processes and the result one of them reports.

A rank that dies before any result arrives stops the wait at once with its exit code (its
traceback is already on stderr), instead of leaving the parent waiting out the timeout; on any
failure the ranks are killed at once.
"""

from __future__ import annotations

import os
import queue
import socket
import time
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Callable, world: int, *args: Any, timeout: float = 1800.0) -> Any:
    """Run ``target(rank, port, *args, results)`` in ``world`` spawned processes and return the
    first thing a rank puts on ``results``."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, *args, results)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return results.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0][0]} exited with {dead[0][1]}") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no result within {timeout:g} s") from None
    except BaseException:
        for p in procs:
            p.kill()
        raise
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


def init_rank(rank: int, world: int, port: int, timeout: float) -> None:
    """Join the ranks' gloo group on this host as ``rank`` of ``world`` (the environment
    torchrun would set), with one torch thread, as ``pipetrain.init_distributed`` does it."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
    )
    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    import pipetrain

    pipetrain.init_distributed("gloo", timeout=timeout)
