"""How long faults take to stop every rank, and what the ranks are told (issue 22).

Two gloo processes on the CPU run a 2-stage MLP pipeline and one fault each:

- stopped store host: rank 0 (which hosts the rendezvous store) is SIGSTOPped mid-step,
  timeout=3; rank 1 should stop with CommunicationTimeout near 3 s.
- caught stage failure: stage 1 raises, its process catches the StageError and lives on,
  timeout=6; rank 0 should hear the root cause at once, not after the timeout.
- store host fails: stage 0 (the store's host) fails on a shape mismatch and exits at once;
  rank 1 should get the root cause, not "its process probably died".

Prints, per case, the median over repeats of the time until every running rank had stopped
(from the start of train_step) and what the waiting rank raised. Run it against another tree
(e.g. the code before a fix) with PYTHONPATH=that/tree:

    nice -n 19 python benchmarks/fault_times.py --repeats 3
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import tempfile
import time

from torch import nn

import pipetrain
from tests.runtime.harness import run_ranks
from tests.runtime.models import batches, mlp, sgd


class _Fault(nn.Module):
    """Does ``fault`` on its ``call``-th forward."""

    def __init__(self, call: int, fault: str):
        super().__init__()
        self.call, self.calls, self.fault = call, 0, fault

    def forward(self, x):
        self.calls += 1
        if self.calls == self.call:
            if self.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if self.fault == "raise":
                raise RuntimeError("boom")
        if self.fault == "ragged" and self.calls > 1:
            return x[:, :-1]
        return x


def _rank(rank: int, world: int, case: str, pid_file: str) -> tuple[str, str, float]:
    fault_rank, fault, timeout = {
        "stopped store host": (0, "stop", 3.0),
        "caught stage failure": (1, "raise", 6.0),
        "store host fails": (0, "ragged", 30.0),
    }[case]
    layer = _Fault(2, fault if rank == fault_rank else "none")  # the same model on every rank
    cut = 5 + fault_rank  # the last layer of stage 0, or the first of stage 1
    model = nn.Sequential(*mlp()[:cut], layer, *mlp()[cut:])
    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    pipe = pipetrain.Pipeline(model, [6, 7], chunks=4, loss_fn=nn.functional.cross_entropy,
                              optimizer=sgd, timeout=timeout, recompute="never")
    start = time.monotonic()
    try:
        pipe.train_step(*batches(1)[0])
        outcome = ("ok", "")
    except Exception as error:
        outcome = (type(error).__name__, str(error))
    took = time.monotonic() - start
    if case == "stopped store host" and rank == 1:
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGKILL)
    if case == "store host fails" and rank == 0:
        os._exit(7)  # a script ends on the uncaught error at once, its store with it
    if case == "caught stage failure" and rank == 1:
        time.sleep(timeout + 1)  # lives on while its peer waits
    return (*outcome, took)


def _said(message: str) -> str:
    if "probably died" in message:
        return "'probably died'"
    if "boom" in message or "micro-batch 1 produced" in message:
        return "root cause"
    return "timeout" if "timeout=" in message else message[:40]


def measure(case: str, deadline: float) -> tuple[float | None, str]:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            results = run_ranks(_rank, 2, case, os.path.join(tmp, "pid"), deadline=deadline)
        except AssertionError:
            return None, "hang"
    waiting = 1 if case != "caught stage failure" else 0
    status, value = results[waiting]
    if status != "ok":  # the rank catches its error and reports it
        return None, f"{status}: {str(value)[:60]}"
    kind, message, took = value
    return float(took), f"{kind} ({_said(message)})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--deadline", type=float, default=40.0, help="counted as a hang after")
    args = parser.parse_args()
    print(f"code: {os.path.dirname(os.path.dirname(os.path.abspath(pipetrain.__file__)))}")
    print(f"{'case':<24} | {'waiting rank raised':<40} | time until every rank stopped (s)")
    for case in ("stopped store host", "caught stage failure", "store host fails"):
        runs = [measure(case, args.deadline) for _ in range(args.repeats)]
        times = [t for t, _ in runs if t is not None]
        said = sorted({s for _, s in runs})
        shown = f"{statistics.median(times):.1f}" if len(times) == len(runs) else (
            f"> {args.deadline:g} (hang)" if not times else f"{statistics.median(times):.1f}*")
        print(f"{case:<24} | {', '.join(said):<40} | {shown}")


if __name__ == "__main__":
    main()
