"""Traces: every rank records its actions; merged, they form one valid Chrome trace in which
each micro-batch's work runs in dependency order across stages."""

from __future__ import annotations

import io
import json
import random
import resource

import pytest
from torch import nn

import pipetrain
from pipetrain.observe.progress import Progress
from pipetrain.observe.trace import (
    RankTrace,
    drawn_costs,
    full_speed,
    load_folder,
    message_latency,
    report,
    runtime_overhead,
    shared_cores,
    simulated_twin,
    step_spans,
)
from schedules import Action, Kind, Span, build, simulate, with_early_weights
from schedules.action import COMPUTE, STEP_KINDS
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_local import pipeline

STEPS = 3
SLACK = 1e-3  # seconds: clock offsets between processes are known to about half a round trip


def _traced(rank: int, world: int, folder: str) -> float:
    pipe = pipetrain.Pipeline(
        mlp(), [2, 3, 4, 3][:world] if world == 4 else [5, 7], chunks=4, schedule="1f1b",
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, trace=folder, timeout=60,
    )
    for x, y in batches(STEPS):
        pipe.train_step(x, y)
    pipe.save_trace()
    return pipe.metrics["stage_bubble"][0]


def check_dependency_order(folder) -> None:
    traces = load_folder(folder)
    for step in range(STEPS):
        end, start = {}, {}
        for t in traces:
            spans = t.steps[step]
            computes = [s.action for s in spans if s.action.kind in COMPUTE]  # early Ws too
            assert computes == t.schedule.compute(t.stage), "ran in the schedule's order"
            for s in spans:
                start[s.action], end[s.action] = s.start, s.end
        p, m = traces[0].schedule.stages, traces[0].schedule.microbatches
        for i in range(m):
            for s in range(1, p):
                f_prev, f_here = end[_a(Kind.FORWARD, s - 1, i)], start[_a(Kind.FORWARD, s, i)]
                assert f_here >= f_prev - SLACK, (step, s, i)
                b_next, b_here = end[_a(Kind.BACKWARD, s, i)], start[_a(Kind.BACKWARD, s - 1, i)]
                assert b_here >= b_next - SLACK, (step, s, i)


def _a(kind, stage, mb):
    return Action(kind, stage, mb)


def test_runtime_overhead_is_the_unaccounted_time_per_action():
    spans = [
        Span(_a(Kind.FORWARD, 0, 0), 0.0, 1.0),
        Span(_a(Kind.SEND_ACT, 0, 0), 1.25, 1.5),  # a send's span counts as overhead
        Span(_a(Kind.RECV_GRAD, 0, 0), 1.5, 2.0),  # waiting is not overhead
        Span(_a(Kind.BACKWARD, 0, 0), 2.25, 3.0),
        Span(_a(Kind.STEP, 0, -1), 3.0, 3.5),
    ]
    # 3.5 s long; F, RECV, B and STEP account for 2.75 s; the rest spread over 5 actions
    assert runtime_overhead(spans) == pytest.approx(0.75 / 5)
    assert runtime_overhead([]) == 0.0


def test_message_latency_counts_only_receives_that_began_before_the_message_left():
    def recv(kind, stage, mb, start, end):
        return Span(_a(kind, stage, mb), start, end)

    spans = [
        Span(_a(Kind.FORWARD, 0, 0), 0.0, 1.0),
        recv(Kind.RECV_ACT, 1, 0, 0.5, 1.25),  # waited from before departure: 0.25 s flight
        Span(_a(Kind.FORWARD, 0, 1), 1.0, 2.0),
        recv(Kind.RECV_ACT, 1, 1, 4.0, 4.5),  # began after departure: the message was there
        Span(_a(Kind.BACKWARD, 1, 0), 2.0, 3.0),
        recv(Kind.RECV_GRAD, 0, 0, 2.5, 3.75),  # waited: 0.75 s flight
        Span(_a(Kind.BACKWARD, 1, 1), 3.0, 4.0),
        recv(Kind.RECV_GRAD, 0, 1, 3.5, 4.5),  # waited: 0.5 s flight
    ]
    assert message_latency(spans) == pytest.approx(0.5)  # median of 0.25, 0.75, 0.5
    assert message_latency(spans[2:4]) is None


def test_full_speed_work_of_ranks_sharing_one_core():
    # rank 0 runs 0-4 s but waits in a receive from 1 to 3; rank 1 runs 0-2 s. One core:
    # 0-1 two run (half speed), 1-2 rank 1 alone, 2-3 nobody (a rank would run at full
    # speed), 3-4 rank 0 alone.
    spans = [
        Span(_a(Kind.FORWARD, 0, 0), 0.0, 1.0),
        Span(_a(Kind.RECV_GRAD, 0, 0), 1.0, 3.0),
        Span(_a(Kind.BACKWARD, 0, 0), 3.0, 4.0),
        Span(_a(Kind.FORWARD, 1, 0), 0.0, 2.0),
    ]
    for cores in (1, {(0, 1): 1}):  # all ranks share, or the one group of both does
        work = full_speed(spans, cores)[0]
        assert work(0.0, 1.0) == pytest.approx(0.5)
        assert work(0.0, 2.0) == pytest.approx(1.5)
        assert work(0.5, 3.5) == pytest.approx(0.25 + 1.0 + 1.0 + 0.5)
    assert full_speed(spans, cores=2)[0](0.0, 4.0) == pytest.approx(4.0)  # never short of cores
    assert full_speed(spans, None)[1](0.5, 3.5) == pytest.approx(3.0)
    # pinned apart (rank 1 in a group of its own, rank 0 in none): nobody shares
    assert full_speed(spans, {(1,): 1})[0](0.0, 1.0) == pytest.approx(1.0)
    # the overhead of rank 0 (no gaps) stays 0; measured in full-speed seconds as well
    assert runtime_overhead(spans[:3], work) == pytest.approx(0.0)


def test_shared_cores_only_for_ranks_on_one_host_beyond_its_cores():
    def trace(rank, host, cores, threads=1, cpus=()):
        return RankTrace(rank, rank, build("1f1b", 4, 4), [], 0.0, host, cores, threads, cpus)

    everyone = (0, 1, 2, 3)
    assert shared_cores([trace(r, "a", 2) for r in range(4)]) == {everyone: 2}
    assert shared_cores([trace(r, "a", 8, threads=4) for r in range(4)]) == {everyone: 2}
    assert shared_cores([trace(r, "a", 4) for r in range(4)]) is None  # a core each
    assert shared_cores([trace(r, "ab"[r % 2], 2) for r in range(4)]) is None  # two hosts
    assert shared_cores([trace(r, "a", 0) for r in range(4)]) is None  # not recorded
    # pinned: four ranks, one processor each of two (round robin), or one each of four
    assert shared_cores([trace(r, "a", 1, cpus=(r % 2,)) for r in range(4)]) == {
        (0, 2): 1, (1, 3): 1,
    }
    assert shared_cores([trace(r, "a", 1, cpus=(r,)) for r in range(4)]) is None
    # overlapping sets join one group; a group with a processor per rank is left out
    overlap = [(0, 1), (1, 2), (3,), (4,)]
    assert shared_cores([trace(r, "a", 2, cpus=overlap[r]) for r in range(4)]) is None
    assert shared_cores([trace(r, "a", 1, cpus=(0, 1) if r < 3 else (2,)) for r in range(4)]) == {
        (0, 1, 2): 2,
    }


def test_the_twin_of_a_simulated_step_is_that_step():
    # a step as the simulator runs it, written as rank traces, comes back from the twin: the
    # costs converted from shared to full speed, the overhead (none), the latency, the cores
    # each pinned group shared and the ranks' late entries all round-trip
    schedule = build("1f1b", 4, 4)
    step = simulate(
        schedule, [1.0, 1.5, 0.5, 1.0], [2.0, 2.5, 1.5, 2.0], transfer=0.25,
        cores={(0, 2): 1, (1, 3): 1}, start=[0.3, 0.0, 0.1, 0.2],
    ).timeline
    traces = [
        RankTrace(r, r, schedule, [[s for s in step if s.lane == r]], 0.0, "host", 1, 1, (r % 2,))
        for r in range(4)
    ]
    twin = {s.action: (s.start, s.end) for s in simulated_twin(traces, 0)}
    assert len(twin) == len(step)
    for s in step:
        assert twin[s.action] == pytest.approx((s.start, s.end), abs=1e-9), s.action


def test_the_twin_of_a_step_with_early_weight_passes_is_that_step():
    # the early W and its input-only B keep their own times; the stages' other backwards are
    # whole (backward + weight), and the twin does not add the W's time to them
    schedule = with_early_weights(build("1f1b", 4, 4), [1, 2, 3])
    step = simulate(
        schedule, [1.0, 1.5, 0.5, 1.0], [2.0, 2.5, 1.5, 2.0], transfer=0.25, weight=0.75,
        cores={(0, 2): 1, (1, 3): 1}, start=[0.3, 0.0, 0.1, 0.2],
    ).timeline
    traces = [
        RankTrace(r, r, schedule, [[s for s in step if s.lane == r]], 0.0, "host", 1, 1, (r % 2,))
        for r in range(4)
    ]
    assert {s.action.kind for s in step} >= {Kind.WEIGHT, Kind.REDUCE, Kind.AGREE}
    twin = {s.action: (s.start, s.end) for s in simulated_twin(traces, 0)}
    assert len(twin) == len(step)
    for s in step:
        assert twin[s.action] == pytest.approx((s.start, s.end), abs=1e-9), s.action


def _shared_core_step(durations: dict) -> list[RankTrace]:
    """Rank traces of a simulated 4-rank 1F1B step on two shared cores (as the twin test)."""
    schedule = build("1f1b", 4, 4)
    step = simulate(
        schedule, 1.0, 2.0, transfer=0.25, cores={(0, 2): 1, (1, 3): 1},
        start=[0.3, 0.0, 0.1, 0.2], durations=durations,
    ).timeline
    return [
        RankTrace(r, r, schedule, [[s for s in step if s.lane == r]], 0.0, "host", 1, 1, (r % 2,))
        for r in range(4)
    ]


def _computes(schedule):
    return [
        a for ops in schedule.actions.values() for a in ops
        if a.kind in (Kind.FORWARD, Kind.BACKWARD)
    ]


def test_drawn_costs_come_from_the_stages_own_measured_times():
    # each micro-batch's forward and backward its own time, on shared cores: every draw is one
    # of the times that stage measured for that kind (converted back to full speed), and over
    # many draws each of them turns up
    times = {
        a: (1.0 + 0.5 * a.microbatch) * (2.0 if a.kind is Kind.BACKWARD else 1.0)
        for a in _computes(build("1f1b", 4, 4))
    }
    traces = _shared_core_step(times)
    spans = step_spans(traces, 0)
    work = full_speed(spans, shared_cores(traces))
    rng, seen = random.Random(0), {}
    for _ in range(200):
        for a, t in drawn_costs(spans, work, rng).items():
            seen.setdefault((a.kind, a.stage), set()).add(round(t, 9))
    for (kind, stage), drawn in seen.items():
        if kind in STEP_KINDS:  # REDUCE, AGREE, STEP: not given times here
            continue
        own = {round(t, 9) for a, t in times.items() if (a.kind, a.stage) == (kind, stage)}
        assert drawn == own, (kind, stage)


def test_a_twin_with_drawn_times_sees_the_slow_actions_that_means_hide():
    # uniform actions: drawing changes nothing. Spread actions (one slow micro-batch per
    # stage): the stage means give a shorter step than times drawn from the spread (by 15%
    # over these 50 draws), as the slow actions that the means smooth away hold the step up
    uniform = _shared_core_step({})
    drawn = simulated_twin(uniform, 0, random.Random(1))
    means = {s.action: (s.start, s.end) for s in simulated_twin(uniform, 0)}
    for s in drawn:
        assert means[s.action] == pytest.approx((s.start, s.end), abs=1e-9), s.action

    spread = _shared_core_step({
        a: (1.75 if a.microbatch == a.stage else 0.25) * (2.0 if a.kind is Kind.BACKWARD else 1.0)
        for a in _computes(build("1f1b", 4, 4))
    })
    rng = random.Random(2)

    def length(spans):
        return max(s.end for s in spans) - min(s.start for s in spans)

    mean_step = length(simulated_twin(spread, 0))
    drawn_steps = [length(simulated_twin(spread, 0, rng)) for _ in range(50)]
    assert sum(drawn_steps) / len(drawn_steps) > 1.1 * mean_step


@pytest.mark.parametrize("world", [2, 4])
def test_merged_trace_is_chrome_json_with_a_track_per_rank(tmp_path, world):
    bubbles = values(run_ranks(_traced, world, str(tmp_path), deadline=120))
    assert all(0.0 <= b < 1.0 for b in bubbles)
    result = report(tmp_path)
    events = json.loads(result["trace"].read_text())["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    names = [e for e in events if e["ph"] == "M" and e["name"] == "thread_name"]
    assert {e["tid"] for e in slices} == set(range(world)) == {e["tid"] for e in names}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    per_rank_steps = {e["args"]["step"] for e in slices}
    assert per_rank_steps == set(range(STEPS))
    forwards = [e for e in slices if e["cat"] == "FORWARD"]
    assert len(forwards) == world * 4 * STEPS
    check_dependency_order(tmp_path)
    latencies = {t.rank: t.link_latency for t in load_folder(tmp_path)}
    assert latencies[0] == 0.0, "rank 0 is the reference"
    assert all(0.0 < latencies[r] < 0.05 for r in range(1, world)), latencies
    # one host, one kernel: one monotonic clock, so no rank is shifted (a measured offset
    # would be off by up to half a round trip)
    offsets = [json.loads(p.read_text())["clock_offset"] for p in tmp_path.glob("trace-rank*")]
    assert offsets == [0.0] * world
    assert 0.0 < result["simulated_bubble"] < 1.0
    assert result["picture"].stat().st_size > 10_000


def test_single_process_mode_traces_too(tmp_path):
    pipe = pipeline(mlp(), [6, 6], chunks=4, trace=tmp_path)
    for x, y in batches(STEPS):
        pipe.train_step(x, y)
    paths = pipe.save_trace()
    assert sorted(p.name for p in paths) == ["trace-rank0.json", "trace-rank1.json"]
    check_dependency_order(tmp_path)
    assert report(tmp_path, png=False)["ranks"] == 2


def test_metrics_and_progress_lines(capsys):
    pipe = pipeline(mlp(), [6, 6], chunks=4, progress=Progress(total=STEPS))
    for x, y in batches(STEPS):
        loss = pipe.train_step(x, y)
    metrics = pipe.metrics
    assert metrics["step"] == STEPS and metrics["loss"] == loss
    assert metrics["samples_per_second"] == pytest.approx(24 / metrics["step_time"])
    assert len(metrics["stage_bubble"]) == 2 and all(0 <= b < 1 for b in metrics["stage_bubble"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == STEPS and lines[-1].startswith(f"step {STEPS}/{STEPS} | loss")



def test_single_process_mode_reports_memory_per_device(capsys):
    """Two CPU stages in one process: one memory figure, labelled as the process's (the
    process's peak resident set, which the stages share), not the same figure per stage."""
    pipe = pipeline(mlp(), [6, 6], chunks=4, progress=True)
    pipe.train_step(*batches(1)[0])
    peaks = pipe.metrics["peak_memory"]
    assert list(peaks) == ["cpu(process)"]
    assert 0 < peaks["cpu(process)"] <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    line = capsys.readouterr().err.strip()
    assert pipe.metrics["peak_memory_kind"] == "RSS"
    figure = f"peak RSS cpu(process)={peaks['cpu(process)'] / 2**20:.0f}MiB"
    assert figure in line.split(" | "), line

class _Terminal(io.StringIO):
    """What Progress writes to a terminal, kept (a StringIO that says it is a terminal)."""

    def isatty(self) -> bool:
        return True


def test_progress_line_fits_the_terminal(monkeypatch):
    """8 stages on an 80-column terminal (shutil reads COLUMNS): every redrawn line fits; a log
    (no terminal) keeps every stage's figures."""
    pipe = pipeline(mlp(), [2, 2, 1, 1, 1, 1, 2, 2], chunks=8)
    monkeypatch.setenv("COLUMNS", "80")
    shown, log = Progress(total=2, stream=_Terminal()), Progress(total=2, stream=io.StringIO())
    for x, y in batches(2):
        pipe.train_step(x, y)
        shown.update(pipe.metrics)
        log.update(pipe.metrics)
    drawn = [line.removeprefix("\033[K") for line in shown.stream.getvalue().split("\r")[1:]]
    assert len(drawn) == 2 and all(len(line.rstrip("\n")) < 80 for line in drawn), drawn
    assert drawn[-1].startswith("[####################] step 2/2 | loss")
    logged = log.stream.getvalue().splitlines()
    assert all(len(line.split(" | ")[3].split()) == 9 for line in logged)  # "bubble" + 8
