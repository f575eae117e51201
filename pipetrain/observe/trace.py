"""Recording what each stage ran, and merging the ranks' records into one Chrome trace.

When tracing is on, the executor hands every action's start and end (this host's monotonic clock)
to a Recorder; off, it hands nothing and pays nothing. Each rank writes ``trace-rank{R}.json``
with the offset of its clock from rank 0's, measured at start-up, so records from several
machines line up. ``merge`` turns a folder of them into Chrome/Perfetto trace JSON.
"""

from __future__ import annotations

import bisect
import json
import os
import random
import socket
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from schedules import (
    Action,
    Kind,
    Schedule,
    Span,
    bubble_fraction,
    build,
    simulate,
    with_early_weights,
    with_step_tail,
)
from schedules.action import COMPUTE, RECVS, SENDS, STEP_KINDS, TIMED
from schedules.simulate import Cores

FORMAT = "pipetrain-trace"


@dataclass
class Recorder:
    """Spans of one rank's actions (of every stage it holds), grouped by training step.
    ``rank`` names the file (the global rank); ``stage`` is the rank's position in the
    pipeline, which is its stage when every rank holds one stage."""

    rank: int
    stage: int
    schedule: Schedule
    clock_offset: float = 0.0  # add to this host's clock to get rank 0's
    link_latency: float = 0.0  # one-way time of a small message to the first rank (s)
    steps: list[list[Span]] = field(default_factory=list)
    host: str = field(default_factory=socket.gethostname)
    cores: int = field(default_factory=lambda: len(os.sched_getaffinity(0)))  # it may use
    cpus: tuple[int, ...] = field(default_factory=lambda: tuple(sorted(os.sched_getaffinity(0))))
    threads: int = field(default_factory=torch.get_num_threads)  # torch's, per operation

    def begin_step(self) -> None:
        self.steps.append([])

    def record(self, action: Action, start: float, end: float) -> None:
        lane = None if self.schedule.one_stage_per_rank else self.stage
        self.steps[-1].append(Span(action, start, end, lane))

    def save(self, folder: str | Path) -> Path:
        path = Path(folder) / f"trace-rank{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "format": FORMAT,
            "version": 1,
            "rank": self.rank,
            "stage": self.stage,
            "clock_offset": self.clock_offset,
            "link_latency": self.link_latency,
            "host": self.host,
            "cores": self.cores,
            "cpus": list(self.cpus),
            "threads": self.threads,
            "schedule": self.schedule.name,
            "stages": self.schedule.stages,
            "microbatches": self.schedule.microbatches,
            "ranks": self.schedule.ranks,
            "steps": [
                [
                    [s.action.kind.value, s.action.microbatch, s.start, s.end, s.action.stage]
                    for s in spans
                ]
                for spans in self.steps
            ],
        }
        path.write_text(json.dumps(data))
        return path


@dataclass(frozen=True)
class RankTrace:
    rank: int
    stage: int  # the rank's position in the pipeline (its stage under one stage per rank)
    schedule: Schedule
    steps: list[list[Span]]  # times on rank 0's clock
    link_latency: float = 0.0
    host: str = ""
    cores: int = 0  # 0: not recorded
    threads: int = 1
    cpus: tuple[int, ...] = ()  # the processors it might use; (): not recorded


def load(path: str | Path) -> RankTrace:
    data = json.loads(Path(path).read_text())
    if data.get("format") != FORMAT or data.get("version") != 1:
        raise ValueError(f"{path} is not a pipetrain trace (version 1)")
    lane, offset = data["stage"], data["clock_offset"]
    stages = data["stages"]
    ranks = data.get("ranks", stages)
    rank = None if ranks == stages else lane
    steps = [
        [
            Span(Action(Kind(k), (rest or [lane])[0], mb), a + offset, b + offset, rank)
            for k, mb, a, b, *rest in spans
        ]
        for spans in data["steps"]
    ]
    schedule = build(data["schedule"], stages, data["microbatches"], ranks=ranks)
    return RankTrace(
        data["rank"], lane, schedule, steps, data.get("link_latency", 0.0),
        data.get("host", ""), data.get("cores", 0), data.get("threads", 1),
        tuple(data.get("cpus", ())),
    )


def load_folder(folder: str | Path) -> list[RankTrace]:
    """Every rank's trace in ``folder``, by stage; their schedule is the list the ranks ran:
    with the whole step (:func:`schedules.with_step_tail`) and the early weight passes
    (schedules/early.py)."""
    paths = sorted(Path(folder).glob("trace-rank*.json"))
    if not paths:
        raise FileNotFoundError(
            f"no trace-rank*.json in {folder}; train with Pipeline(..., trace=DIR) or "
            "PIPETRAIN_TRACE=DIR first"
        )
    traces = sorted((load(p) for p in paths), key=lambda t: t.stage)
    schedule = with_step_tail(traces[0].schedule)  # as the runtime ran it
    early = {
        s.action.stage for t in traces for step in t.steps for s in step
        if s.action.kind is Kind.WEIGHT
    }
    if early and not schedule.splits_backward:
        schedule = with_early_weights(schedule, early)
    return [replace(t, schedule=schedule) for t in traces]


def chrome_trace(traces: Sequence[RankTrace]) -> dict[str, Any]:
    """Chrome/Perfetto trace events: one track per rank, one slice per action (µs)."""
    origin = min((s.start for t in traces for step in t.steps for s in step), default=0.0)
    events: list[dict[str, Any]] = []
    for t in traces:
        held = ", ".join(map(str, t.schedule.stages_on(t.stage)))
        events.append({"ph": "M", "name": "thread_name", "pid": 0, "tid": t.rank,
                       "args": {"name": f"rank {t.rank} (stage {held})"}})
        for number, spans in enumerate(t.steps):
            for s in spans:
                a = s.action
                label = a.kind.value if a.kind in STEP_KINDS else f"{a.kind.value}{a.microbatch}"
                events.append({
                    "ph": "X", "pid": 0, "tid": t.rank, "name": label, "cat": a.kind.name,
                    "ts": (s.start - origin) * 1e6, "dur": s.duration * 1e6,
                    "args": {"step": number, "microbatch": a.microbatch, "stage": a.stage},
                })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def step_spans(traces: Sequence[RankTrace], step: int) -> list[Span]:
    """Every rank's spans of training step ``step`` (negative counts from the end)."""
    return [s for t in traces for s in t.steps[step]]


def measure_clock_offset(
    group: dist.ProcessGroup, ranks: Sequence[int], tag: int, rounds: int = 8
) -> tuple[float, float]:
    """This rank's clock offset from the group's first rank and the one-way latency of a small
    message between them (NTP-style ping-pong on messages tagged ``tag``, one no other message
    of the group uses; the round with the shortest round trip wins; both 0 on the first rank).
    Every rank of the group must call it.

    Ranks under one kernel (one boot) read one monotonic clock, so their offset is 0; the
    ping-pong only bounds it (within half a round trip, which on busy shared cores reaches a
    millisecond). There the offset is 0 whenever the measurement allows it."""
    me = dist.get_rank()
    first_boot = [_boot_id()]
    dist.broadcast_object_list(first_boot, src=ranks[0], group=group)
    ping = torch.zeros(1, dtype=torch.float64)
    best = (float("inf"), 0.0)
    for peer in ranks[1:]:
        for _ in range(rounds):
            if me == ranks[0]:
                dist.recv(ping, peer, group=group, tag=tag)
                ping[0] = time.perf_counter()
                dist.send(ping, peer, group=group, tag=tag)
            elif me == peer:
                sent = time.perf_counter()
                dist.send(ping, ranks[0], group=group, tag=tag)
                dist.recv(ping, ranks[0], group=group, tag=tag)
                back = time.perf_counter()
                best = min(best, (back - sent, float(ping[0]) - (sent + back) / 2))
    if me == ranks[0]:
        return 0.0, 0.0
    round_trip, offset = best
    if first_boot[0] is not None and first_boot[0] == _boot_id() and abs(offset) <= round_trip / 2:
        offset = 0.0
    return offset, round_trip / 2


def _boot_id() -> str | None:
    """Names this kernel's boot (Linux); processes that share it share the monotonic clock."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def shared_cores(traces: Sequence[RankTrace]) -> dict[tuple[int, ...], int] | None:
    """Which ranks shared processors, as ``schedules.simulate`` takes ``cores``: each group of
    ranks (pipeline positions) that shared too few processors, with how many ranks' worth they
    had (processors // torch threads). Unpinned ranks on one host share all its processors;
    ranks pinned to processors (pipetrain.runtime.distributed.pin_to_cores) share those they were
    pinned to with the ranks pinned to the same ones. None when no group ran short (each had
    its own, or they ran on several hosts, or the traces predate the record)."""
    hosts = {t.host for t in traces}
    if len(hosts) != 1 or any(t.cores < 1 for t in traces):
        return None
    groups: list[tuple[set[int], list[RankTrace]]] = []
    if all(t.cpus for t in traces):
        for t in traces:  # ranks whose processors overlap form one group
            cpus, members = set(t.cpus), [t]
            for other in [g for g in groups if g[0] & cpus]:
                groups.remove(other)
                cpus, members = cpus | other[0], other[1] + members
            groups.append((cpus, members))
    else:
        groups.append((set(range(min(t.cores for t in traces))), list(traces)))
    shared = {}
    for cpus, members in groups:
        cores = max(1, len(cpus) // max(max(t.threads, 1) for t in members))
        if cores < len(members):
            shared[tuple(sorted(t.stage for t in members))] = cores
    return shared or None


Work = Callable[[float, float], float]  # (start, end) -> full-speed seconds done in between


def _elapsed(start: float, end: float) -> float:
    return end - start


def full_speed(spans: Sequence[Span], cores: Cores) -> dict[int, Work]:
    """Each rank's (lane's) full-speed seconds between two instants of ``spans``' step when
    ranks shared processors as ``cores`` says (processor sharing, as ``schedules.simulate``
    models it): the integral of min(1, n / k(t)), n the processors of the rank's group and k(t)
    its ranks running at t. A rank runs from its first span's start to its last one's end
    except while it waits in a receive. A rank that shared nothing: the elapsed time."""
    lanes = sorted({s.lane for s in spans})
    if isinstance(cores, int):
        cores = {tuple(lanes): cores}
    work: dict[int, Work] = {lane: _elapsed for lane in lanes}
    for group, count in (cores or {}).items():
        integral = _shared_work([s for s in spans if s.lane in group], count)
        work.update({lane: integral for lane in group})
    return work


def _shared_work(spans: Sequence[Span], cores: int) -> Work:
    """The full-speed seconds of one rank of a group that shares ``cores`` processors."""
    change: dict[float, int] = {}
    for lane in {s.lane for s in spans}:
        mine = [s for s in spans if s.lane == lane]
        for at, by in [(min(s.start for s in mine), 1), (max(s.end for s in mine), -1)] + [
            (t, d) for s in mine if s.action.kind in RECVS for t, d in ((s.start, -1), (s.end, 1))
        ]:
            change[at] = change.get(at, 0) + by
    times, done, running = sorted(change), [0.0], 0
    for a, b in pairwise(times):
        running += change[a]
        done.append(done[-1] + (b - a) * min(1.0, cores / max(running, 1)))

    def integral(t: float) -> float:
        i = bisect.bisect_right(times, t) - 1
        if i < 0:
            return 0.0
        if i + 1 >= len(times):
            return done[-1]
        return done[i] + (t - times[i]) * (done[i + 1] - done[i]) / (times[i + 1] - times[i])

    return lambda start, end: integral(end) - integral(start)


def measured_costs(
    spans: Sequence[Span], stages: int, work: Mapping[int, Work] | None = None
) -> dict[Kind, list[float]]:
    """Each stage's mean time of each timed kind in ``spans``: forward, backward, weight, and
    the step's gradient reduction, agreement and optimizer update (in full-speed seconds by
    each rank's ``work``, when given; see :func:`full_speed`)."""
    costs = {}
    for kind in sorted(TIMED, key=lambda k: k.value):
        mean = [0.0] * stages
        for s in range(stages):
            times = [
                (work[x.lane] if work else _elapsed)(x.start, x.end) for x in spans
                if x.action.kind is kind and x.action.stage == s
            ]
            mean[s] = sum(times) / len(times) if times else 0.0
        costs[kind] = mean
    return costs


def drawn_costs(
    spans: Sequence[Span], work: Mapping[int, Work], rng: random.Random
) -> dict[Action, float]:
    """A time for each compute and optimizer step in ``spans``, drawn with replacement from
    the full-speed times (by ``work``, see :func:`full_speed`) that its stage measured for that
    kind: the stage's spread, without knowing which action was the slow one."""
    timed = [s for s in spans if s.action.kind in TIMED]
    measured: dict[tuple[Kind, int], list[float]] = {}
    for s in timed:
        measured.setdefault((s.action.kind, s.action.stage), []).append(
            work[s.lane](s.start, s.end)
        )
    return {s.action: rng.choice(measured[s.action.kind, s.action.stage]) for s in timed}


def runtime_overhead(spans: Sequence[Span], work: Work | None = None) -> float:
    """One rank's own time per action in one step: the part of its step that is neither
    compute, a step action nor a receive (waiting for a message is the simulator's to
    reproduce), spread over its actions but REDUCE and AGREE (which the simulator gives no
    overhead). It holds the gaps between actions (posting messages, bookkeeping, the process
    losing its core) and the sends' short spans. In full-speed seconds by ``work``, when
    given."""
    if not spans:
        return 0.0
    took = work or _elapsed
    length = took(min(s.start for s in spans), max(s.end for s in spans))
    accounted = sum(took(s.start, s.end) for s in spans if s.action.kind not in SENDS)
    counted = [s for s in spans if s.action.kind not in (Kind.REDUCE, Kind.AGREE)]
    return max(length - accounted, 0.0) / max(len(counted), 1)


def message_latency(spans: Sequence[Span]) -> float | None:
    """Median time from a message's departure (the end of the compute that produced it) to its
    arrival, over the receives in ``spans`` (all ranks' spans of a step, on one clock) that
    began before their message left, so that their end is its arrival; None if none did. A
    receive that began later found its message (or part of it) already there, and its span
    says nothing about the flight. Under load this is the latency that counts: it holds the
    peers' waits for a core, which an idle start-up measurement does not."""
    produced = {s.action: s.end for s in spans if s.action.kind in COMPUTE}
    seen = []
    for s in spans:
        a = s.action
        if a.kind in RECVS and a.peer is not None:
            source = Kind.FORWARD if a.kind is Kind.RECV_ACT else Kind.BACKWARD
            departure = produced.get(Action(source, a.peer, a.microbatch))
            if departure is not None and s.start < departure:
                seen.append(s.end - departure)
    return statistics.median(seen) if seen else None


def step_overheads(traces: Sequence[RankTrace], step: int = -1) -> list[float]:
    """Each rank's runtime overhead per action in step ``step`` (:func:`runtime_overhead`), in
    full-speed seconds when the ranks shared too few cores: what ``pipetrain plan
    --overhead-ms`` takes."""
    work = full_speed(step_spans(traces, step), shared_cores(traces))
    return [runtime_overhead(t.steps[step], work[t.stage]) for t in traces]


def simulated_twin(
    traces: Sequence[RankTrace], step: int = -1, rng: random.Random | None = None
) -> list[Span]:
    """The schedule simulated with what was measured in step ``step``: each stage's mean
    forward, backward, weight and optimizer-step times, each rank's runtime overhead per
    action, the step's message latency (:func:`message_latency`; the start-up measurement
    when no receive waited) and when each rank entered the step (after a barrier or its previous
    step, ranks enter a few milliseconds apart). When ranks shared too few cores
    (:func:`shared_cores`), the costs are converted to full speed (:func:`full_speed`) and
    simulated on the cores each group shared. What differs from the measured step is what the
    simulator's model of waiting gets wrong, and with stage means the spread of the actions'
    times: a step follows its slow actions, which the means smooth away. With ``rng`` each
    compute and optimizer step instead takes a time drawn from those its stage measured for
    that kind in the step (:func:`drawn_costs`); average the bubble over several draws. An
    early weight pass and its B (schedules/early.py) always take their own measured times."""
    schedule = traces[0].schedule
    spans = step_spans(traces, step)
    origin = min(s.start for s in spans)
    cores = shared_cores(traces)
    work = full_speed(spans, cores)
    # an early weight pass (schedules/early.py) and its B take their own measured times: the
    # stage's other backwards are whole, and its means are theirs
    early = {Action(k, s, i) for s, i in schedule.early_weights.items() for k in (Kind.BACKWARD,
                                                                                  Kind.WEIGHT)}
    split = [x for x in spans if x.action in early]
    whole = [x for x in spans if x.action not in early]
    cost = measured_costs(whole, schedule.stages, work)
    latency = message_latency(spans)
    overhead = step_overheads(traces, step)
    durations = drawn_costs(whole, work, rng) if rng is not None else {}
    durations.update({x.action: work[x.lane](x.start, x.end) for x in split})
    return list(
        simulate(
            schedule, cost[Kind.FORWARD], cost[Kind.BACKWARD],
            transfer=max(t.link_latency for t in traces) if latency is None else latency,
            optimizer_step=cost[Kind.STEP], weight=cost[Kind.WEIGHT], overhead=overhead,
            reduce=cost[Kind.REDUCE], agree=cost[Kind.AGREE],
            cores=cores, start=[min(s.start for s in t.steps[step]) - origin for t in traces],
            durations=durations,
        ).timeline
    )


def report(folder: str | Path, png: bool = True, step: int = -1) -> dict[str, Any]:
    """Merge ``folder``'s rank traces into ``trace.json`` (Chrome/Perfetto) and, with
    matplotlib, ``timeline.png`` (measured step beside its simulated twin); return what was
    written, the step drawn (``step`` counted from 0; negative from the end, -1 the last) and
    the measured and simulated bubble fractions of that step."""
    traces = load_folder(folder)
    steps = min(len(t.steps) for t in traces)
    if not -steps <= step < steps:
        raise ValueError(
            f"{folder} holds {steps} traced steps (0..{steps - 1}); pick one of them, or -1 "
            "for the last"
        )
    step %= steps
    out = Path(folder)
    (out / "trace.json").write_text(json.dumps(chrome_trace(traces)))
    measured, twin = step_spans(traces, step), simulated_twin(traces, step)
    result = {
        "trace": out / "trace.json",
        "ranks": len(traces),
        "steps": steps,
        "step": step,
        "measured_bubble": bubble_fraction(measured),
        "simulated_bubble": bubble_fraction(twin),
        "overhead": step_overheads(traces, step),
    }
    if png:
        from pipetrain.observe.gantt import draw

        name = traces[0].schedule.name
        result["picture"] = draw(
            [(f"measured {name}", measured), (f"simulated {name}, measured costs", twin)],
            out / "timeline.png",
        )
    return result
