"""Per-step metrics and their report: one line per step on rank 0, redrawn in place on a
terminal, plain lines in a log; plus pipetrain's logger, quiet unless made verbose."""

from __future__ import annotations

import logging
import resource
import sys
from typing import TextIO

import torch

logger = logging.getLogger("pipetrain")
logger.addHandler(logging.NullHandler())


def verbose(level: int = logging.INFO, rank: int | None = None) -> None:
    """Log pipetrain's events to stderr, each line prefixed with this rank."""
    if rank is None:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


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

    def line(self, metrics: dict) -> str:
        bubbles = metrics["stage_bubble"]
        memory = metrics["stage_peak_memory"]
        rate = metrics.get("samples_per_second")
        parts = [
            f"step {metrics['step']}" + (f"/{self.total}" if self.total else ""),
            f"loss {metrics['loss']:.4f}",
            f"{rate:,.0f} samples/s" if rate else f"{metrics['step_time'] * 1e3:.1f} ms/step",
            "bubble " + " ".join(f"{b:.0%}" for b in bubbles),
            "peak " + " ".join(f"{m / 2**20:.0f}MiB" for m in memory),
        ]
        if metrics.get("lr") is not None:
            parts.append(f"lr {metrics['lr']:.3g}")
        if metrics.get("grad_norm") is not None:
            parts.append(f"grad norm {metrics['grad_norm']:.3g}")
        if metrics.get("skipped_step"):
            parts.append(f"overflow: step skipped, loss scale {metrics['loss_scale']:g}")
        return " | ".join(parts)

    def update(self, metrics: dict) -> None:
        text = self.line(metrics)
        if self.tty:
            if self.total:
                done = int(20 * metrics["step"] / self.total)
                text = f"[{'#' * done}{'.' * (20 - done)}] {text}"
            end = "\n" if self.total and metrics["step"] >= self.total else ""
            self.stream.write("\r\033[K" + text + end)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
