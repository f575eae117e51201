"""``Pipeline(schedule=lists)``: a registered schedule written with ``to_csv`` and read back
with ``from_csv`` trains to the very parameters of the named schedule (threads, and two gloo
processes), and lists that do not fit the pipeline are refused naming the mismatch and the
fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from schedules import Schedule, build, from_csv, lookup, to_csv
from tests.runtime.harness import run_ranks, values
from tests.runtime.test_csv_in_torch import MICROBATCHES, _data, _model  # the same MLP and batch


def _ranks(name: str) -> int:
    """4 stages: on 2 ranks where the schedule puts two stages on each, else on 4."""
    return 2 if lookup(name).multi_stage_per_rank else 4


def _read_back(name: str) -> Schedule:
    """The registered ``name`` for 4 stages, through its CSV."""
    ranks = _ranks(name)
    return from_csv(to_csv(build(name, 4, MICROBATCHES, ranks=ranks)), name="from-csv")


def _pipeline(schedule: str | Schedule, devices: list[str] | None = None, **options):
    return pipetrain.Pipeline(
        _model(), [1, 1, 1, 1], devices=devices, schedule=schedule,
        loss_fn=nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        **options,
    )


def _trained(schedule: str | Schedule, devices: list[str] | None = None, **options):
    """Every parameter here (keyed) after two steps."""
    pipe = _pipeline(schedule, devices, **({"chunks": MICROBATCHES} | options))
    x, y = _data()
    for _ in range(2):
        pipe.train_step(x, y)
    return {k: p.detach().clone() for s in pipe.stages for k, p in s.module.named_parameters()}


NAMES = ["1f1b", "zb-h1", "zbv", "v-half"]


@pytest.mark.parametrize("name", NAMES)
def test_read_back_lists_train_as_the_name_does_in_threads(name):
    devices = ["cpu"] * _ranks(name)
    lists = _read_back(name)
    named, listed = _trained(name, devices), _trained(lists, devices, chunks=None)
    assert named.keys() == listed.keys() and named
    for key, value in named.items():
        assert torch.equal(value, listed[key]), key
    pipe = _pipeline(lists, devices)
    assert pipe.schedule is lists and pipe.chunks == MICROBATCHES  # chunks: the lists'


def _in_processes(rank: int, world: int, name: str) -> list[dict[str, torch.Tensor]]:
    return [_trained(name), _trained(_read_back(name))]


def test_read_back_lists_train_as_the_name_does_in_processes():
    for rank in values(run_ranks(_in_processes, 2, "zbv")):
        named, listed = rank
        assert named.keys() == listed.keys() and named
        for key, value in named.items():
            assert torch.equal(value, listed[key]), key


def test_a_generators_lists_run_as_their_name():
    lists = build("zbv", 4, MICROBATCHES, ranks=2)
    pipe = _pipeline(lists, ["cpu", "cpu"])
    assert pipe.config.schedule == "zbv" and pipe.config.lists is None


@pytest.mark.parametrize(
    "lists, options, complaint",
    [
        (build("1f1b", 3, MICROBATCHES), {"devices": ["cpu"] * 3},
         "lists run 3 stages but balance has 4 entries; pass a balance of 3 entries"),
        (_read_back("1f1b"), {"devices": ["cpu"] * 4, "chunks": 2},
         "lists run 4 micro-batches per mini-batch but chunks=2; pass chunks=4 or leave chunks"),
        (_read_back("zbv"), {"devices": ["cpu"] * 4},
         r"place their 4 stages on 2 ranks \(rank 0: stages 0, 3; rank 1: stages 1, 2\) but "
         "this pipeline has 4; pass 2 devices"),
        (from_csv(to_csv(build("zb-h1", 4, MICROBATCHES)), name="1f1b"),
         {"devices": ["cpu"] * 4}, "named '1f1b' but are not what the registry builds"),
    ],
)
def test_lists_that_do_not_fit_are_refused_with_the_fix(lists, options, complaint):
    with pytest.raises(ValueError, match=complaint):
        _pipeline(lists, **options)


def test_a_schedule_of_another_type_is_refused():
    with pytest.raises(ValueError, match=r"schedule must be a registered name, one of \['1f1b'"):
        _pipeline(4, ["cpu"] * 4)  # type: ignore[arg-type]
