"""How busy the machine was with other work while a benchmark ran.

On a shared 2-core machine any foreign load slows the ranks and widens the spread, so the
benchmarks read /proc/stat before and after and report (or filter on) what others took.
"""

from __future__ import annotations

import os
import resource


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, steal) clock ticks of the whole machine so far, from /proc/stat (Linux only)."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq, steal


def load_report(before: tuple[int, int] | None, after: tuple[int, int] | None, wall: float) -> str:
    """One line: this benchmark's share of the CPUs, other processes', hypervisor steal; with a
    warning when others took more than 5%."""
    if before is None or after is None:
        return "machine load: /proc/stat unavailable"
    hz = os.sysconf("SC_CLK_TCK")
    ncpu = os.cpu_count() or 1
    ours = sum(
        getattr(resource.getrusage(who), field)
        for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
        for field in ("ru_utime", "ru_stime")
    )
    busy = (after[0] - before[0]) / hz
    steal = (after[1] - before[1]) / hz / wall / ncpu
    foreign = max(busy - ours, 0.0) / wall / ncpu
    line = (
        f"machine load during the run: {ncpu} CPUs, this benchmark {ours / wall / ncpu:.0%}, "
        f"other processes {foreign:.0%}, hypervisor steal {steal:.0%}"
    )
    if foreign > 0.05 or steal > 0.05:
        line += "  <-- WARNING: numbers disturbed; rerun on a quiet machine"
    return line
