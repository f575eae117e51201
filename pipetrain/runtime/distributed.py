"""Joining the job that torchrun started, and this process's device."""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from pipetrain.errors import CommunicationTimeout, PipelineError

_OWN_CORES = False  # set by pin_to_cores: this rank has processors no other local rank uses
_IO_THREAD = "gloo_tcp_loop"
EXIT_WAIT = 5.0  # seconds a process whose pipeline failed across processes may take to exit
_EXIT_BOUNDED = False  # set by bound_exit
# how shutdown waits for its barrier: the longest timeout of this process's pipelines, and
# their wait, which names the peers (set by bound_shutdown; None: the group's own timeout)
_SHUTDOWN_WAIT: tuple[float, Callable[[dist.Work], None]] | None = None


def init_distributed(
    backend: str | None = None, timeout: float = 600.0, pin_cores: bool = False
) -> tuple[int, int]:
    """Initialise the default process group from torchrun's environment; return (rank, world).

    NCCL when this node has a GPU for each of its processes, else gloo on the CPU (with a
    warning when there are GPUs, but too few). On GPUs each process takes ``cuda:LOCAL_RANK``.
    ``pin_cores`` first pins the process to its share of the node's processors
    (:func:`pin_to_cores`). Calling it again is harmless.
    """
    if not dist.is_initialized():
        needed = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [v for v in needed if v not in os.environ]
        if missing:
            raise RuntimeError(
                f"init_distributed needs torchrun's environment ({', '.join(missing)} unset): "
                "launch with `torchrun --nproc_per_node=STAGES script.py`, or run all stages in "
                "this process with Pipeline(..., devices=[...])"
            )
        if pin_cores:
            local = int(os.environ.get("LOCAL_RANK", "0"))
            pin_to_cores(local, int(os.environ.get("LOCAL_WORLD_SIZE", str(local + 1))))
        if backend is None:
            backend = _default_backend()
        if backend == "nccl":
            torch.cuda.set_device(local_device())
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(
            backend, store=_attempt_store(timeout), rank=rank, world_size=world,
            timeout=timedelta(seconds=timeout),
        )
    return dist.get_rank(), dist.get_world_size()


def shutdown(exit_code: int = 0) -> NoReturn:
    """End a torchrun script: wait until every rank gets here, run the exit handlers (atexit:
    traces, the user's own), flush the standard streams and end the process with
    ``exit_code``, without tearing the process groups down. Call it last, on every rank.

    The wait is bounded by the longest timeout of this process's pipelines (else by the
    group's own): a peer that never gets here (it died, hangs, or trains on) ends it with an
    error naming the peer (printed), and the process with status 1.

    Why: the teardown at the process's end at times aborted a rank whose training had
    succeeded ("terminate called without an active exception", SIGABRT), in about 1 run of 6
    of a 4-rank job and now and then in 2-rank ones, with or without destroy_process_group
    first; torchrun then reports the job as failed. Ending the process directly skips that
    teardown; the barrier makes sure no peer still needs this rank."""
    if dist.is_initialized():
        work = dist.barrier(async_op=True)
        try:
            if _SHUTDOWN_WAIT is None:
                work.wait()
            else:
                timeout, wait = _SHUTDOWN_WAIT
                with exit_if_stuck(timeout + EXIT_WAIT, CommunicationTimeout(
                        f"pipetrain.shutdown()'s barrier did not end {timeout + EXIT_WAIT:g} "
                        "s after its timeout (a peer hosting the store stopped?)")):
                    wait(work)
        except PipelineError as error:
            traceback.print_exception(error)
            exit_code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(exit_code)


def bound_shutdown(timeout: float, wait: Callable[[dist.Work], None]) -> None:
    """Have :func:`shutdown` wait for its barrier with ``wait`` (a pipeline's, bounded by its
    ``timeout`` and naming the peers), unless a pipeline of this process waits longer."""
    global _SHUTDOWN_WAIT
    if _SHUTDOWN_WAIT is None or _SHUTDOWN_WAIT[0] < timeout:
        _SHUTDOWN_WAIT = (timeout, wait)


@contextmanager
def exit_if_stuck(seconds: float, error: Exception) -> Iterator[None]:
    """End the process with status 1, printing ``error``, if the block is still running
    after ``seconds``: for a wait of torch's that no timeout bounds (a store client awaiting
    a stopped store host's answer, in C++), which nothing else could end."""
    done = threading.Event()

    def watch() -> None:
        if not done.wait(seconds):
            print("".join(traceback.format_exception_only(error)), file=sys.stderr, flush=True)
            os._exit(1)

    threading.Thread(target=watch, name="pipetrain-exit-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()


def bound_exit() -> None:
    """Once a pipeline of this process has failed across processes, let the process's exit
    take at most EXIT_WAIT seconds: then it ends with status 1 (as on the uncaught error),
    whatever its teardown still waits for. Calling it again is harmless.

    Why: at the interpreter's end each gloo process group's destructor joins its worker
    threads, and a worker inside a collective with a stopped peer (a SIGSTOPped rank) waits
    out the group's own timeout (init_distributed's, 600 s by default): the rank raised
    CommunicationTimeout on time and then did not exit. The transport closes the links that
    hold such a collective (transport.py); this bounds what it cannot reach (a group of the
    user's own). The watchdog, armed by the first exit handler to run, is faulthandler's
    thread, which needs no interpreter to end the process."""
    global _EXIT_BOUNDED
    if not _EXIT_BOUNDED:
        _EXIT_BOUNDED = True
        atexit.register(_arm_exit_watchdog)


def _arm_exit_watchdog() -> None:
    """From the process's exit on, end it after EXIT_WAIT seconds (status 1, silently)."""
    faulthandler.dump_traceback_later(
        EXIT_WAIT, exit=True, file=os.open(os.devnull, os.O_WRONLY)
    )


def pin_to_cores(local_rank: int, local_world: int) -> list[int]:
    """Pin the calling process to its share of the processors it may use: local rank ``r`` of
    ``local_world`` gets the r-th of that many equal, contiguous slices (the r-th processor,
    round robin, when there are more ranks than processors). Returns the processors.

    Call it before the process group starts, so the backend's threads (gloo's I/O loop) are
    pinned too: they then take their rank's own processor when a message arrives, instead of
    preempting a neighbour's compute and stalling it for a scheduler time slice. The rank's
    other threads (torch's intra-op pool) should be at most the slice's size.

    A rank with processors of its own also gets quiet I/O threads (:func:`quiet_io_threads`).
    """
    global _OWN_CORES
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} is not in 0..{local_world - 1}")
    if not hasattr(os, "sched_setaffinity"):
        raise RuntimeError("pinning to cores needs os.sched_setaffinity (Linux); leave it off")
    cpus = sorted(os.sched_getaffinity(0))
    share = len(cpus) // local_world
    mine = cpus[local_rank * share : (local_rank + 1) * share] if share else [
        cpus[local_rank % len(cpus)]
    ]
    os.sched_setaffinity(0, mine)
    _OWN_CORES = share > 0
    return mine


@contextmanager
def quiet_io_threads() -> Iterator[None]:
    """Move the gloo I/O threads that start inside the block (one per process group) to the
    idle scheduling class, when :func:`pin_to_cores` gave this rank processors of its own.

    Why: the I/O thread shares its rank's processor with the compute. When a message arrives
    while the compute thread is inside a send or receive call, holding that link's lock, the
    woken I/O thread preempts it, finds the lock taken and polls its still-readable socket
    until its time slice ends: the compute waits milliseconds for nothing. In the idle class
    it never preempts, and runs whenever the compute thread blocks (on a wait for a message,
    which is when the I/O is needed). Ranks that share processors are left alone: there an
    idle I/O thread would wait for the neighbour's compute. gloo in torch <= 2.10 leaves its
    I/O threads unnamed: there this finds none and changes nothing.
    """
    before = _io_threads()
    yield
    if not _OWN_CORES:
        return
    for tid in _io_threads() - before:
        try:
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            pass
        except PermissionError as error:  # a sandbox may forbid it; only speed is at stake
            warnings.warn(f"gloo's I/O threads keep their scheduling class: {error}", stacklevel=3)
            return


def _io_threads() -> set[int]:
    """The thread ids of this process's gloo I/O threads (none where /proc is missing)."""
    found: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except FileNotFoundError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as comm:
                if comm.read().strip() == _IO_THREAD:
                    found.add(int(tid))
        except FileNotFoundError:
            pass
    return found


def _default_backend() -> str:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if gpus == 0:
        return "gloo"  # a CPU node: gloo is the expected choice, nothing to warn about
    if gpus >= local:
        return "nccl"
    warnings.warn(
        f"{local} processes on this node but {gpus} GPU(s): training on the CPU with gloo. "
        f"For the GPUs start at most {gpus} processes per node (--nproc_per_node={gpus}); "
        "pass init_distributed(backend='gloo') to silence this",
        stacklevel=3,
    )
    return "gloo"


def _attempt_store(timeout: float) -> dist.Store:
    """The rendezvous store, its keys prefixed by torchrun's restart count.

    Under `--rdzv-backend=c10d` the agent keeps one store across restarts, so a restarted
    group would read the addresses of the processes it replaced and fail to connect; a prefix
    per attempt keeps each attempt's keys apart.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=not agent and os.environ["RANK"] == "0",
        timeout=timedelta(seconds=timeout), multi_tenant=not agent,
    )
    return dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def local_device() -> torch.device:
    """cuda:LOCAL_RANK when the default group runs NCCL (or CUDA is there), else the CPU.

    NCCL joins one GPU per process, so a node needs a GPU for each of its local ranks.
    """
    if torch.cuda.is_available() and (not dist.is_initialized() or dist.get_backend() == "nccl"):
        local, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        if local >= count:
            raise RuntimeError(
                f"LOCAL_RANK {local} needs GPU {local}, but this node has {count} GPU(s): "
                f"start at most {count} processes per node (torchrun --nproc_per_node={count}) "
                "and give the pipeline that many stages per node, or run on the CPU with "
                "init_distributed(backend='gloo')"
            )
        return torch.device("cuda", local)
    return torch.device("cpu")
