"""Per-step metrics and their report: one line per step on rank 0, redrawn in place on a
terminal (within its width), plain lines in a log; plus pipetrain's logger, quiet unless made
verbose."""

from __future__ import annotations

import logging
import resource
import shutil
import sys
from typing import Any, TextIO

import torch

logger = logging.getLogger("pipetrain")
logger.addHandler(logging.NullHandler())


_handler: logging.Handler | None = None  # verbose()'s, replaced when it is called again


def verbose(level: int = logging.INFO, rank: int | None = None) -> None:
    """Log pipetrain's events to stderr, each line prefixed with this rank. Calling it again
    changes the level or rank; every event is still printed once."""
    global _handler
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler()
    _handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(level)


def memory_label(device: torch.device) -> str:
    """What a peak_memory figure measures: a GPU's own allocations, or the whole process on a
    CPU (every stage this process runs on the CPU shares that figure)."""
    return str(device) if device.type == "cuda" else "cpu(process)"


def memory_kind(device: torch.device) -> str:
    """Which figure :func:`peak_memory` reports on ``device``, as the progress line names it."""
    return "allocated" if device.type == "cuda" else "RSS"


def peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated on the GPU, else this process's maximum resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """What ``Pipeline(progress=...)`` prints on the first rank: a line every ``every`` steps,
    and, given ``total`` (the step the run ends at, counted as ``pipe.step`` counts, so from a
    resumed checkpoint's step), "step N/total" and a bar on a terminal. ``progress=True`` is
    ``Progress()``: every step, no total."""

    def __init__(
        self, *, every: int = 1, total: int | None = None, stream: TextIO | None = None
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive number of steps, got {every!r}")
        if total is not None and (isinstance(total, bool) or not isinstance(total, int)
                                  or total < 1):
            raise ValueError(f"total must be a positive number of steps or None, got {total!r}")
        self.every, self.total = every, total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self._open = False  # a terminal line drawn in place, not yet ended

    def line(self, metrics: dict[str, Any], width: int | None = None) -> str:
        """The step's metrics in one line. Within ``width`` characters (if given) the
        per-stage figures shrink to their range, then whole fields go from the end (lr, grad
        norm, memory, bubble, speed); no figure is ever cut."""
        bubbles = metrics["stage_bubble"]
        memory = metrics["peak_memory"]
        kind = metrics.get("peak_memory_kind", "")
        rate = metrics.get("samples_per_second")
        head = [
            f"step {metrics['step']}" + (f"/{self.total}" if self.total else ""),
            f"loss {metrics['loss']:.4f}",
            f"{rate:,.0f} samples/s" if rate else f"{metrics['step_time'] * 1e3:.1f} ms/step",
        ]
        tail = []
        if metrics.get("skipped_step") and "loss_scale" in metrics:
            tail.append(f"overflow: step skipped, loss scale {metrics['loss_scale']:g}")
        elif metrics.get("skipped_step"):
            tail.append("non-finite: step skipped")
        if metrics.get("grad_norm") is not None:
            tail.append(f"grad norm {metrics['grad_norm']:.3g}")
        if metrics.get("lr") is not None:
            tail.append(f"lr {metrics['lr']:.3g}")
        peak = f"peak {kind} " if kind else "peak "
        full = [
            "bubble " + " ".join(f"{b:.0%}" for b in bubbles),
            peak + " ".join(f"{where}={m / 2**20:.0f}MiB" for where, m in memory.items()),
        ]
        short = [
            f"bubble {min(bubbles):.0%}-{max(bubbles):.0%}",
            f"{peak}max {max(memory.values()) / 2**20:.0f}MiB",
        ]
        fields = [*head, *full, *tail]
        if width is None or len(" | ".join(fields)) <= width:
            return " | ".join(fields)
        fields = [*head, *short, *tail]
        while len(fields) > 2 and len(" | ".join(fields)) > width:  # step and loss stay
            fields.pop()
        return " | ".join(fields)

    def due(self, step: int) -> bool:
        """Whether step ``step`` is reported: every ``every`` steps, and the last one."""
        return step % self.every == 0 or step == self.total

    def update(self, metrics: dict[str, Any]) -> None:
        """Report a finished step, if it is due."""
        if not self.due(metrics["step"]):
            return
        if self.tty:
            bar = ""
            if self.total:
                done = max(0, min(20, int(20 * metrics["step"] / self.total)))
                bar = f"[{'#' * done}{'.' * (20 - done)}] "
            width = shutil.get_terminal_size().columns - 1  # the last column would wrap
            text = bar + self.line(metrics, width - len(bar))
            self._open = not (self.total and metrics["step"] >= self.total)
            self.stream.write("\r\033[K" + text + ("" if self._open else "\n"))
        else:
            self.stream.write(self.line(metrics) + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        """A line of its own (e.g. a resume), below any line drawn in place."""
        self.stream.write(("\r\033[K" if self._open else "") + text + "\n")
        self._open = False
        self.stream.flush()


def progress_option(option: bool | Progress | None) -> Progress | None:
    """``Pipeline(progress=...)`` as a Progress (None: off); a bare number is refused, since
    it could mean either how often to print or how many steps the run has."""
    if option is None or option is False:
        return None
    if option is True:
        return Progress()
    if isinstance(option, Progress):
        return option
    if isinstance(option, int):
        raise ValueError(
            f"progress={option} is ambiguous: pass progress=Progress(every={option}) to print "
            f"every {option} steps, or progress=Progress(total={option}) for a bar up to step "
            f"{option} (Progress from pipetrain; progress=True prints every step)"
        )
    raise TypeError(f"progress must be True, False or a pipetrain.Progress, got {option!r}")
