"""Each stage's own random stream, so that a recomputed forward draws what its forward drew.

Dropout (like every random op in torch) draws from the process-wide default generators: the CPU
one and one per CUDA device. With every stage in a thread of one process, all stages share them,
and torch.utils.checkpoint's own save and restore of their state goes wrong: another stage's
thread draws between the save and the forward's draws, and a restore rewinds the draws the
other threads made meanwhile, so a recomputation sees other dropout masks than its forward did
(wrong gradients, silently).

Here each stage owns a stream: a CPU generator state and, on a CUDA device, that device's state,
seeded when the pipeline is built from seeds drawn from the global generator (so
``torch.manual_seed`` before building makes a run reproducible, in either mode). A stage's
forward runs with its stream installed in the default generators, under one lock per process:
the forwards of this process's stages take turns (their backwards, without recomputation, still
overlap). An evaluation forward (``eval_step``, modules in eval mode, where dropout draws
nothing) runs on the default generators as they are, without the lock, so the stages'
evaluation forwards overlap and a stage waiting for its turn cannot run on after another stage
failed. The stream's state at the start of a recomputed micro-batch's forward is kept with
its checkpoint and installed again for each recomputation. The process's own generator states
are put back after each, so draws outside the pipeline do not depend on its training.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

# Installing a stream swaps the process-wide generator states: one stage at a time.
_LOCK = threading.RLock()

State = tuple[torch.Tensor, torch.Tensor | None]  # CPU generator state, CUDA device's (or None)


def draw_seeds(count: int) -> list[int]:
    """``count`` seeds from the global CPU generator, one per stage, the same in every process
    seeded alike (each process draws all of them, in stage order)."""
    return [int(s) for s in torch.randint(0, 2**62, (count,))]


class StageRng:
    """The random stream of one stage on ``device``."""

    def __init__(self, seed: int, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        cpu = torch.Generator().manual_seed(seed).get_state()
        gpu = torch.Generator(device).manual_seed(seed).get_state() if self.cuda else None
        self.state: State = (cpu, gpu)

    def _swap(self, state: State) -> State:
        """Install ``state`` in the default generators; return the states it replaced."""
        cpu, gpu = state
        previous = (
            torch.get_rng_state(),
            torch.cuda.get_rng_state(self.device) if self.cuda else None,
        )
        torch.set_rng_state(cpu)
        if gpu is not None:
            torch.cuda.set_rng_state(gpu, self.device)
        return previous

    @contextmanager
    def forward(self) -> Iterator[State]:
        """Run a forward on this stream (it advances); yields the state it starts from, which
        ``replay`` installs again for a recomputation."""
        with _LOCK:
            start = self.state
            previous = self._swap(start)
            try:
                yield start
            finally:
                self.state = self._swap(previous)

    @contextmanager
    def replay(self, start: State) -> Iterator[None]:
        """Run a recomputation on the stream as it was at its forward's start (the stream
        itself does not advance)."""
        with _LOCK:
            previous = self._swap(start)
            try:
                yield
            finally:
                self._swap(previous)

    def checkpoint_contexts(self, start: State) -> tuple[Any, Any]:
        """``context_fn`` for torch.utils.checkpoint (with preserve_rng_state=False): nothing
        around the forward, which runs inside ``forward()`` already; ``start`` installed around
        each recomputation (a split backward recomputes twice)."""
        return nullcontext(), _Reusable(lambda: self.replay(start))

    def state_dict(self) -> dict[str, torch.Tensor]:
        cpu, gpu = self.state
        return {"cpu": cpu} if gpu is None else {"cpu": cpu, "cuda": gpu}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore a saved stream. Its CUDA state applies only on a CUDA device; one saved
        without (on a CPU stage) leaves this device's state as it is."""
        gpu = state.get("cuda") if self.cuda else None
        self.state = (state["cpu"].cpu(), self.state[1] if gpu is None else gpu.cpu())


class _Reusable:
    """A context manager entered afresh each time (torch enters the recompute context once per
    recomputation, and a generator-based one only works once)."""

    def __init__(self, make: Any):
        self._make = make
        self._open: list[Any] = []

    def __enter__(self) -> None:
        context = self._make()
        context.__enter__()
        self._open.append(context)

    def __exit__(self, *exc: object) -> None:
        self._open.pop().__exit__(*exc)
