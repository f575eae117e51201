"""The registry: one entry per schedule, checked against its generator, read everywhere."""

from __future__ import annotations

from dataclasses import replace

import pytest

from partitioner.costs import inflight as planned_inflight
from schedules import GENERATORS, build, from_csv, inflight, lookup, names, register, to_csv
from schedules.registry import check_spec, counted_inflight, fewer_in_flight, spec_of


@pytest.mark.parametrize("name", names())
def test_every_entry_states_what_its_generator_builds(name):
    check_spec(lookup(name))


@pytest.mark.parametrize(
    "name, change, complaint",
    [
        ("gpipe", dict(split_backward=True), "split_backward = True"),
        ("zb-h1", dict(split_backward=False), "split_backward = False"),
        ("1f1b", dict(asynchronous=True), "asynchronous"),
        ("interleaved", dict(multi_stage_per_rank=False), "states stages = "),
        ("pipedream", dict(update_per_microbatch=False), "micro-batches per update"),
        ("gpipe", dict(inflight=lambda s, p, m: min(m, p - s)), "inflight rule gives"),
        ("1f1b", dict(checkpoint="sometimes"), "checkpoint must be one of"),
        ("pipedream", dict(checkpoint="always"), "use checkpoint='never'"),
        ("gpipe", dict(name="other"), "states name = other"),
    ],
)
def test_an_entry_its_generator_contradicts_is_refused(name, change, complaint):
    with pytest.raises(ValueError, match=complaint):
        check_spec(replace(lookup(name), **change))
    assert "other" not in names()


def test_register_checks_before_it_adds():
    with pytest.raises(ValueError, match="states name = other, the schedule has gpipe"):
        register(replace(lookup("gpipe"), name="other"))
    assert "other" not in names()


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="registered already"):
        register(lookup("1f1b"))


def test_generators_is_a_view_of_the_registry():
    assert sorted(GENERATORS) == names()
    assert names(asynchronous=True) == ["pipedream", "pipedream-2bw"]
    assert names(multi_stage_per_rank=True, runnable=True) == [
        "dualpipev", "interleaved", "interleaved-zb", "looped-bfs", "v-half", "v-min", "zbv"
    ]
    assert all(GENERATORS[n] is lookup(n).generator for n in names())
    with pytest.raises(ValueError, match=r"unknown schedule 'zb-v'; choose one of \['1f1b'"):
        lookup("zb-v")


def test_stated_inflight_rules_agree_with_the_lists():
    for name in names():
        spec = lookup(name)
        for p, m in [(1, 1), (2, 4), (4, 4), (4, 8), (5, 2)]:
            ranks = p // 2 if spec.multi_stage_per_rank else None
            if spec.multi_stage_per_rank and (p % 2 or m % (p // 2)):
                continue
            try:
                schedule = build(name, p, m, ranks=ranks)
            except ValueError:  # pipedream-2bw needs m >= p - 1
                continue
            assert inflight(schedule) == counted_inflight(schedule), (name, p, m)


def test_the_planner_counts_pipedreams_micro_batches_across_calls():
    """PipeDream's stream keeps p - s micro-batches in flight on stage s however few a call
    feeds (the runtime's ledger measures this, tests/runtime/test_schedule_registry.py); the
    planner once took the peak of one call's list, 1 per stage with one micro-batch a call."""
    assert planned_inflight("pipedream", 4, 1) == [4, 3, 2, 1]
    assert planned_inflight("pipedream", 4, 2) == [4, 3, 2, 1]
    assert planned_inflight("pipedream-2bw", 4, 3) == [4, 3, 2, 1]
    assert planned_inflight("gpipe", 3, 5) == [5, 5, 5]
    assert planned_inflight("1f1b", 3, 5) == [3, 2, 1]



@pytest.mark.parametrize(
    "name, stages, microbatches, lighter",
    [
        ("gpipe", 3, 4, "1f1b"),  # GPipe holds all 4 micro-batches, 1F1B at most 3
        ("gpipe", 4, 2, None),  # 2 micro-batches: both hold 2
        ("1f1b", 3, 4, None),  # the default itself
        ("zb-h1", 3, 4, None),  # holds as many as 1F1B
        ("pipedream", 3, 4, None),  # asynchronous: 1F1B is another kind of training
    ],
)
def test_the_schedule_holding_fewer_micro_batches_is_found_in_the_registry(
    name, stages, microbatches, lighter
):
    assert fewer_in_flight(name, stages, microbatches) == lighter


def test_lists_run_under_their_names_entry_only_where_it_builds_them():
    """What Pipeline(schedule=lists) reads: the registry's own lists get their entry; others
    (a CSV read back, lists built for another name) an entry stating what the lists show."""
    built = build("zbv", 6, 4, ranks=3)
    assert spec_of(built) is lookup("zbv")
    assert spec_of(build("pipedream", 3, 2)) is lookup("pipedream")
    read = from_csv(to_csv(built), name="mine")
    spec = spec_of(read)
    assert (spec.name, spec.multi_stage_per_rank, spec.split_backward, spec.asynchronous) == (
        "mine", True, True, False
    )
    assert spec.checkpoint == "never" and spec.inflight is None
    assert inflight(read) == counted_inflight(built)
    renamed = from_csv(to_csv(build("zb-h1", 3, 4)), name="1f1b")  # not what 1f1b builds
    assert spec_of(renamed) is not lookup("1f1b") and spec_of(renamed).split_backward
    assert inflight(renamed) == counted_inflight(renamed) != inflight(build("1f1b", 3, 4))
