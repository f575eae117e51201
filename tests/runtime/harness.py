"""Start real processes joined by a process group, run a function on each, collect results.

Every rank runs ``fn(rank, world, *args)`` after ``init_process_group`` (gloo unless the test
asks for NCCL); its return value
(or the exception it raised, as text) comes back to the test. A rank that hangs is killed at the
deadline and reported, so a test can fail but never hang.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    rank: int, world: int, port: int, backend: str, fn: Callable, args: tuple, results: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
        WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=60))
        buffer = io.BytesIO()  # bytes, not shared-memory tensors, survive this process's exit
        torch.save(fn(rank, world, *args), buffer)
        results.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # reported to the test, which decides
        results.put((rank, "error", (type(error).__name__, str(error), traceback.format_exc())))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def run_ranks(
    fn: Callable, world: int, *args: Any, deadline: float = 120.0, backend: str = "gloo"
) -> list[tuple]:
    """Per rank, ("ok", value), ("error", (type name, message, traceback)) or ("died", exit
    code) for a process that ended without reporting."""
    ctx = mp.get_context("forkserver")  # forks from a server that imported torch once
    ctx.set_forkserver_preload(["torch", "torch.distributed", "pipetrain", "tests.runtime.models"])
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(r, world, port, backend, fn, args, results), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, tuple] = {}
    stop = time.monotonic() + deadline
    while len(out) < world and time.monotonic() < stop:
        try:
            rank, status, value = results.get(timeout=0.5)
        except queue.Empty:
            # A rank that exited without reporting died (on purpose in some tests).
            for r, p in enumerate(procs):
                if r not in out and p.exitcode is not None and results.empty():
                    out[r] = ("died", p.exitcode)
            continue
        if status == "ok":
            value = torch.load(io.BytesIO(value), weights_only=False)
        out[rank] = (status, value)
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
    missing = [r for r in range(world) if r not in out]
    assert not missing, f"ranks {missing} neither returned nor raised within {deadline} s (hang)"
    return [out[r] for r in range(world)]


def values(results: list[tuple]) -> list:
    """The ranks' return values; fails with every rank's traceback if any raised."""
    errors = [
        f"rank {r}: {v[2] if s == 'error' else f'died (exit code {v})'}"
        for r, (s, v) in enumerate(results) if s != "ok"
    ]
    assert not errors, "\n".join(errors)
    return [v for _, v in results]
