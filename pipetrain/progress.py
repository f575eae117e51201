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


def peak_memory(device: torch.device) -> int:
    """Peak bytes: allocated on the GPU, else this process's maximum resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Progress:
    """Reports each step's metrics; ``total`` steps (if known) draws a bar on a terminal."""

    def __init__(self, total: int | None = None, stream: TextIO | None = None):
        self.total = total
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()

    def line(self, metrics: dict[str, Any], width: int | None = None) -> str:
        """The step's metrics in one line. Within ``width`` characters (if given): the
        per-stage figures shrink to their range, then the line is cut."""
        bubbles = metrics["stage_bubble"]
        memory = metrics["peak_memory"]
        rate = metrics.get("samples_per_second")
        head = [
            f"step {metrics['step']}" + (f"/{self.total}" if self.total else ""),
            f"loss {metrics['loss']:.4f}",
            f"{rate:,.0f} samples/s" if rate else f"{metrics['step_time'] * 1e3:.1f} ms/step",
        ]
        tail = []
        if metrics.get("lr") is not None:
            tail.append(f"lr {metrics['lr']:.3g}")
        if metrics.get("grad_norm") is not None:
            tail.append(f"grad norm {metrics['grad_norm']:.3g}")
        if metrics.get("skipped_step"):
            tail.append(f"overflow: step skipped, loss scale {metrics['loss_scale']:g}")
        text = " | ".join([
            *head,
            "bubble " + " ".join(f"{b:.0%}" for b in bubbles),
            "peak " + " ".join(f"{where}={m / 2**20:.0f}MiB" for where, m in memory.items()),
            *tail,
        ])
        if width is None or len(text) <= width:
            return text
        text = " | ".join([
            *head,
            f"bubble {min(bubbles):.0%}-{max(bubbles):.0%}",
            f"peak max {max(memory.values()) / 2**20:.0f}MiB",
            *tail,
        ])
        return text if len(text) <= width else text[: width - 1] + "…"

    def update(self, metrics: dict[str, Any]) -> None:
        if self.tty:
            bar = ""
            if self.total:
                done = int(20 * metrics["step"] / self.total)
                bar = f"[{'#' * done}{'.' * (20 - done)}] "
            width = shutil.get_terminal_size().columns - 1  # the last column would wrap
            text = bar + self.line(metrics, width - len(bar))
            end = "\n" if self.total and metrics["step"] >= self.total else ""
            self.stream.write("\r\033[K" + text + end)
        else:
            self.stream.write(self.line(metrics) + "\n")
        self.stream.flush()
