"""Does every rank of a user's script exit when a peer stops or dies (issue 50)? Measured on
real processes, as many runs of each case as asked.

Each run starts tests/runtime/jobs/fault_job.py as two processes with torchrun's environment
(RANK, WORLD_SIZE, MASTER_ADDR, ...; no agent, which would kill the survivor for it). Both
train a 2-stage MLP (1F1B, chunks 4, ``Pipeline(timeout=3)``, the process group's own timeout
left at its default) and print a line per step. After a few steps, at a random moment, the
launcher hits one rank from outside:

- stopped store host: SIGSTOP to rank 0, which hosts the rendezvous store;
- killed rank: SIGKILL to rank 1.

It then times how long the other rank's process takes to EXIT (not to raise), from the
signal, and reads the error it printed: the run passes when that rank exited non-zero within
``timeout + 10`` s and its error names the peer as "stage S (rank R)". A rank still
running at ``timeout + 30`` s is killed and counted as a hang.

    nice -n 10 python benchmarks/fault_runs.py --runs 20 [--at-agree]

``--at-agree`` adds each case with the rank hit as it enters the step's agreement (it signals
itself there), so that the other rank's wait is a collective's, not a receive's. ``--zero 1 2
3`` instead runs each case on 1 stage x 2 replicas sharded at each level, the rank hit as it
enters the level's collective of torch's (ZERO_PLACES); with ``--at-save`` as it enters the
gather of the sharded state for a checkpoint (the job saves after every step); ``--joins`` as
it enters the creation of the pipeline's process groups or pipetrain.shutdown().
:func:`run_job` also hits a rank of 2 replicas (4 processes) in the gradient all-reduce, or
any rank in the start-up check of the settings or the first step's check of the batch
(tests/runtime/test_faults.py).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "runtime" / "jobs" / "fault_job.py"
CASES = {  # name: (the rank hit, its signal)
    "stopped store host": (0, signal.SIGSTOP),
    "killed rank": (1, signal.SIGKILL),
}
WARMUP_STEPS = 3  # steps both ranks finish before the fault
# where each ZeRO level runs a collective of torch's (fault_job.py's PLACES)
ZERO_PLACES = {1: "zero-step", 2: "gather", 3: "gather"}
JOINS = ("groups", "shutdown")  # where every rank waits for every other, beyond the steps
_ERROR = re.compile(r"^(\[rank\d+\]: )?[\w.]*(Error|Timeout|Exception|Interrupt)\b.*?: ")


@dataclass
class Run:
    """One run of a case: how the surviving rank ended."""

    exit_code: int | None  # None: it hung (killed by the launcher)
    exit_time: float  # seconds from the signal to the process's exit
    error: str  # the exception it printed last on stderr
    named_peer: bool  # whether that line names the peer as "stage S (rank R)"
    saved: tuple[str, ...] = ()  # at a save: the checkpoint folder's files after the run
    latest: str = ""  # and the checkpoint its ``latest`` names


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(
    folder: Path, timeout: float, port: int, extra: list[str], world: int
) -> list[subprocess.Popen[bytes]]:
    """The job's ``world`` ranks (``extra``: more arguments), their output in
    ``folder``/rank{r}.out and .err."""
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))
        with open(folder / f"rank{rank}.out", "wb") as out, \
                open(folder / f"rank{rank}.err", "wb") as err:
            command = [sys.executable, str(JOB), "--timeout", str(timeout), *extra]
            procs.append(subprocess.Popen(command, stdout=out, stderr=err, env=env, cwd=ROOT))
    return procs


def _steps(folder: Path, rank: int) -> int:
    """How many steps rank ``rank`` has printed."""
    return (folder / f"rank{rank}.out").read_text().count("step ")


def _await_training(folder: Path, procs: list[subprocess.Popen[bytes]], limit: float) -> None:
    """Wait until every rank has printed WARMUP_STEPS steps."""
    stop = time.monotonic() + limit
    while any(_steps(folder, r) < WARMUP_STEPS for r in range(len(procs))):
        if time.monotonic() > stop or any(p.poll() is not None for p in procs):
            errors = [(folder / f"rank{r}.err").read_text()[-2000:] for r in range(len(procs))]
            raise RuntimeError(f"the job did not start training: {errors}")
        time.sleep(0.02)


def _error_line(text: str) -> str:
    """The last line of ``text`` that states an exception ("module.Class: message"): the
    error a traceback ends with, before any notes."""
    lines = [line for line in text.splitlines() if _ERROR.match(line)]
    return lines[-1] if lines else (text.strip().splitlines() or [""])[-1]


def _hit_from_outside(
    folder: Path, procs: list[subprocess.Popen[bytes]], victim: int, sig: int, seed: int | None
) -> float:
    """Signal ``victim`` at a random moment of a step after the warm-up; when (wall clock)."""
    _await_training(folder, procs, 120)
    time.sleep(random.Random(seed).uniform(0, 0.1))  # anywhere in a step
    os.kill(procs[victim].pid, sig)
    return time.time()


def _hit_by_itself(folder: Path, procs: list[subprocess.Popen[bytes]], victim: int) -> float:
    """When (wall clock) ``victim`` signalled itself, entering the place it was told."""
    stop = time.monotonic() + 120
    while "hit " not in (text := (folder / f"rank{victim}.out").read_text()):
        if time.monotonic() > stop or any(p.poll() not in (None, -signal.SIGKILL) for p in procs):
            raise RuntimeError(f"no hit: {(folder / f'rank{victim}.err').read_text()[-2000:]}")
        time.sleep(0.02)
    return float(text.split("hit ")[1].split()[0])


def _await_exits(
    procs: list[subprocess.Popen[bytes]], ranks: list[int], until: float
) -> dict[int, tuple[int | None, float]]:
    """Per rank of ``ranks``, its exit code and when (wall clock) it exited, polled until
    ``until`` (wall clock); (None, until) for one still running then."""
    ended: dict[int, tuple[int | None, float]] = {}
    while len(ended) < len(ranks) and time.time() < until:
        for r in ranks:
            if r not in ended and procs[r].poll() is not None:
                ended[r] = (procs[r].returncode, time.time())
        time.sleep(0.02)
    return {r: ended.get(r, (None, until)) for r in ranks}


def peer_name(rank: int, replicas: int, stages: int = 2) -> str:
    """How errors name global rank ``rank`` of the job's ``stages``-stage pipeline x
    ``replicas``."""
    replica, stage = divmod(rank, stages)
    return f"stage {stage}{f' of replica {replica}' if replicas > 1 else ''} (rank {rank})"


def run_job(
    case: str, timeout: float = 3.0, seed: int | None = None, at: str | None = None,
    replicas: int = 1, stages: int = 2, zero: int = 0,
) -> dict[int, Run]:
    """One run of ``case`` on ``replicas`` replicas of ``stages`` stages sharded at ``zero``:
    start the job, hit a rank mid-training (``at``: as it enters that place of fault_job.py's
    PLACES, so that its peers wait there), time the others' exits; per surviving rank, how it
    ended. The rank hit is the case's, of the world's (rank 1 of 2 processes)."""
    victim, sig = CASES[case]
    world = stages * replicas
    victim = min(victim, world - 1)
    extra = ["--replicas", str(replicas), "--stages", str(stages), "--zero", str(zero)]
    extra += ["--hit", str(victim), sig.name[3:], at] if at else []
    survivors = [r for r in range(world) if r != victim]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoints = folder / "checkpoints"
        extra += ["--save", str(checkpoints)] if at == "save" else []
        procs = _start(folder, timeout, _free_port(), extra, world)
        try:
            hit = (_hit_by_itself(folder, procs, victim) if at
                   else _hit_from_outside(folder, procs, victim, sig, seed))
            ended = _await_exits(procs, survivors, hit + timeout + 30)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        errors = {r: _error_line((folder / f"rank{r}.err").read_text()) for r in survivors}
        saved = tuple(sorted(str(p.relative_to(checkpoints)) for p in checkpoints.rglob("*")))
        latest = (checkpoints / "latest").read_text() if "latest" in saved else ""
    named = peer_name(victim, replicas, stages)
    return {r: Run(code, when - hit, errors[r], named in errors[r], saved, latest)
            for r, (code, when) in ended.items()}


def run_case(
    case: str, timeout: float = 3.0, seed: int | None = None, at_agree: bool = False
) -> Run:
    """One run of ``case`` on the job's two ranks (``at_agree``: the rank hit as it enters the
    step's agreement, so that its peer waits in a collective): how the other ended."""
    (run,) = run_job(case, timeout, seed, "agree" if at_agree else None).values()
    return run


def passed(run: Run, timeout: float) -> bool:
    """Whether the surviving rank exited non-zero within ``timeout + 10`` s."""
    return run.exit_code not in (None, 0) and run.exit_time <= timeout + 10


def _kind(error: str) -> str:
    """The class of the exception on ``error``'s line, without its module."""
    head = error.removeprefix(error.split(": ")[0] + ": ") if error.startswith("[rank") else error
    return head.split(":")[0].rsplit(".", 1)[-1] or "(nothing)"


def _row(case: str, runs: list[Run], timeout: float) -> str:
    """The table's row of ``case``."""
    times = [r.exit_time for r in runs]
    seen = sorted({_kind(r.error) for r in runs})
    return (f"| {case} | {len(runs)} | {sum(passed(r, timeout) for r in runs)}/{len(runs)} "
            f"| {statistics.median(times):.1f} / {max(times):.1f} "
            f"| {sum(r.named_peer for r in runs)}/{len(runs)} | {', '.join(seen)} |")


def _settings(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Per row of each case, its label's end and run_job's arguments."""
    one_stage = {"replicas": 2, "stages": 1}
    if args.at_save:
        return [(f", zero={z}, at a save", {"at": "save", "zero": z, **one_stage})
                for z in args.zero or ZERO_PLACES]
    if args.zero:
        return [(f", zero={z}", {"at": ZERO_PLACES[z], "zero": z, **one_stage})
                for z in args.zero]
    if args.joins:
        return [(f", at {place}", {"at": place, **one_stage}) for place in JOINS]
    return [("", {}), *([(", at the agreement", {"at": "agree"})] if args.at_agree else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=3.0)
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--at-agree", action="store_true",
                        help="also each case with the rank hit as it enters the agreement")
    parser.add_argument("--zero", type=int, nargs="*", default=[], choices=list(ZERO_PLACES),
                        help="instead each case sharded at these levels (1 stage x 2 replicas)")
    parser.add_argument("--at-save", action="store_true",
                        help="instead each case with the rank hit as it enters a checkpoint's "
                        "gather, at --zero's levels (default: 1 2 3)")
    parser.add_argument("--joins", action="store_true",
                        help="instead each case at group creation and at shutdown")
    args = parser.parse_args()
    print(f"code: {ROOT}, Pipeline(timeout={args.timeout:g}), {args.runs} runs per case")
    print("| case | runs | exited non-zero within timeout + 10 s | exit time median / max (s) "
          "| named the peer's stage and rank | errors raised |")
    print("|---|---|---|---|---|---|")
    for label, options in _settings(args):
        for case in args.cases:
            runs = [r for i in range(args.runs)
                    for r in run_job(case, args.timeout, i, **options).values()]
            print(_row(f"{case}{label}", runs, args.timeout), flush=True)
            for r in runs:
                if not (passed(r, args.timeout) and r.named_peer):
                    print(f"  failed run: exit {r.exit_code} after {r.exit_time:.1f} s: "
                          f"{r.error}")


if __name__ == "__main__":
    main()
