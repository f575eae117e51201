"""Deferred BatchNorm run several times per forward: at two positions of the model (on one stage
or on two) and called twice by one module.

The reference is plain single-process training. Its weights: one process accumulating the
gradients of the same micro-batches (BatchNorm normalises each micro-batch with its own
statistics, the README's caveat; with chunks=1 that is the whole mini-batch). Its running
statistics: plain BatchNorm's own update, fed at each of its calls the whole mini-batch of
what that call sees (the micro-batches' inputs to that call, concatenated), in call order;
with chunks=1 that is plain training as it is. Tolerance 1e-6 in fp32: the pipeline sums the
same values in another order (per micro-batch, then merged), a few roundings of values below 1.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.training.batchnorm import DeferredBatchNorm, gathering_statistics
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import sgd

TOLERANCE = 1e-6
STEPS = 3
CHUNKS = [1, 2, 4]
MODES = [("gpipe", "never"), ("1f1b", "never"), ("1f1b", "always"), ("zb-h1", "except_last")]


class Twice(nn.Module):
    """Calls one BatchNorm twice, the second time on what the first returned."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.BatchNorm1d(width, momentum=0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.tanh(self.norm(x)) * 2 + 1)


def one_stage() -> nn.Sequential:
    """One BatchNorm at two positions, both on stage 0 of balance [5, 1]."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6, momentum=0.3)
    return nn.Sequential(nn.Linear(5, 6), norm, nn.ReLU(), nn.Linear(6, 6), norm,
                         nn.Linear(6, 3))


def two_stages() -> nn.Sequential:
    """A block holding a BatchNorm (cumulative average: momentum=None) at two positions, one
    on each stage of balance [2, 3]."""
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=None))
    return nn.Sequential(nn.Linear(5, 6), block, nn.ReLU(), block, nn.Linear(6, 3))


def called_twice() -> nn.Sequential:
    """A module calling its BatchNorm twice in one forward, on stage 1 of balance [2, 2]."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.ReLU(), Twice(6), nn.Linear(6, 3))


MODELS = {"one_stage": (one_stage, [5, 1]), "two_stages": (two_stages, [2, 3]),
          "called_twice": (called_twice, [2, 2])}
# under "interleaved" on two processes stages 1 and 3, both the block's, are rank 1's
INTERLEAVED = (two_stages, [1, 1, 1, 2])


def data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g))
            for _ in range(steps)]


def norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def reference(model: nn.Sequential, batches, chunks: int) -> dict[str, torch.Tensor]:
    """The state_dict after plain single-process training (module docstring)."""
    optimizer = sgd(model.parameters())
    seen: dict[nn.Module, list[torch.Tensor]] = {norm: [] for norm in norms(model)}
    for norm in seen:
        norm.register_forward_pre_hook(lambda m, args: seen[m].append(args[0].detach()))
    for x, y in batches:
        before = {norm: copy.deepcopy(norm.state_dict()) for norm in seen}
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks), strict=True):
            (nn.functional.cross_entropy(model(xs), ys) / chunks).backward()
        optimizer.step()
        with torch.no_grad():
            for norm, inputs in seen.items():
                norm.load_state_dict(before[norm] | {k: v for k, v in norm.state_dict().items()
                                                     if "running" not in k
                                                     and "tracked" not in k})
                calls = len(inputs) // chunks  # per micro-batch's forward
                whole = [torch.cat(inputs[call::calls]) for call in range(calls)]
                for call in whole:  # plain BatchNorm on the whole mini-batch, in call order
                    norm(call)
                inputs.clear()
    return model.state_dict()


def train(name: str, chunks: int, schedule: str, checkpoint: str, **options) -> dict:
    make, balance = INTERLEAVED if schedule == "interleaved" else MODELS[name]
    options.setdefault("devices", ["cpu"] * len(balance))
    pipe = pipetrain.Pipeline(
        make(), balance, chunks=chunks, schedule=schedule, recompute=checkpoint,
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, deferred_batch_norm=True,
        timeout=60, **options,
    )
    for x, y in data():
        pipe.train_step(x, y)
    return pipe.module.state_dict()


def apart(state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference over ``state``'s keys (a process's share of the model)."""
    assert state and set(state) <= set(expected)
    return max((value.double() - expected[key].double()).abs().max().item()
               for key, value in state.items())


@pytest.mark.parametrize(("schedule", "checkpoint"), MODES)
@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("name", list(MODELS))
def test_threads_match_plain_training(name, chunks, schedule, checkpoint):
    state = train(name, chunks, schedule, checkpoint)
    expected = reference(MODELS[name][0](), data(), chunks)
    assert set(state) == set(expected)
    assert int(state[next(k for k in state if "tracked" in k)]) == STEPS * 2
    assert apart(state, expected) <= TOLERANCE


def test_a_norm_on_two_stages_is_one_module():
    """Both positions run one DeferredBatchNorm, holding the model's own tensors."""
    model = two_stages()
    pipe = pipetrain.Pipeline(model, [2, 3], devices=["cpu", "cpu"], chunks=2,
                              deferred_batch_norm=True)
    first, second = pipe.stages[0].module[1][1], pipe.stages[1].module[1][1]
    assert isinstance(first, DeferredBatchNorm) and first is second
    assert first.stages == {0, 1}
    assert first.running_var is model[1][1].running_var
    assert type(model[1][1]) is nn.BatchNorm1d


def test_per_micro_batch_statistics_would_differ():
    """The tests above can fail: without deferred_batch_norm the running statistics are the
    micro-batches' (several updates per call), far from the reference."""
    make, balance = MODELS["called_twice"]
    pipe = pipetrain.Pipeline(make(), balance, devices=["cpu"] * 2, chunks=4,
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd)
    for x, y in data():
        pipe.train_step(x, y)
    assert apart(pipe.module.state_dict(), reference(make(), data(), 4)) > 1e-2


def _ranks(rank: int, world: int) -> dict:
    """Every case a pair of processes runs (each stage its own process, or under
    "interleaved" stages 1 and 3 both on rank 1), and the refusal of a norm shared across
    processes."""
    out: dict = {}
    for (schedule, checkpoint), chunks in itertools.product(MODES, CHUNKS):
        for name in ("one_stage", "called_twice"):
            out[name, chunks, schedule, checkpoint] = train(name, chunks, schedule, checkpoint,
                                                            devices=None)
    for chunks in (2, 4):
        out["two_stages", chunks, "interleaved", "never"] = train(
            "two_stages", chunks, "interleaved", "never", devices=None
        )
    try:
        train("two_stages", 2, "gpipe", "never", devices=None)
    except ValueError as error:
        out["refused"] = str(error)
    return out


def test_processes_match_plain_training():
    results = values(run_ranks(_ranks, 2, deadline=600))
    for key in results[0]:
        if key == "refused":
            continue
        name, chunks = key[0], key[1]
        expected = reference(MODELS[name][0](), data(), chunks)
        for rank, result in enumerate(results):
            assert apart(result[key], expected) <= TOLERANCE, (rank, key)
    for result in results:
        assert "different processes" in result.get("refused", ""), "not refused"


def test_a_norm_without_running_statistics_trains():
    """track_running_stats=False: nothing to gather or commit, every micro-batch normalised
    with its own statistics, in training and in evaluation alike."""
    torch.manual_seed(0)
    norm = nn.BatchNorm1d(6, track_running_stats=False)
    model = nn.Sequential(nn.Linear(5, 6), norm, nn.ReLU(), norm, nn.Linear(6, 3))
    plain = copy.deepcopy(model)
    pipe = pipetrain.Pipeline(model, [2, 3], devices=["cpu", "cpu"], chunks=2,
                              loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                              deferred_batch_norm=True)
    for x, y in data():
        pipe.train_step(x, y)
    expected = reference(plain, data(), 2)
    assert apart(pipe.module.state_dict(), expected) <= TOLERANCE


def test_the_module_alone_gathers_per_forward_and_call():
    """Without a pipeline: one ``gathering_statistics()`` per micro-batch's forward, which
    calls the norm twice; after ``chunks`` forwards the statistics are plain BatchNorm's after
    its two calls on the whole batch."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4) * 2 + 1
    plain = nn.BatchNorm1d(3, momentum=0.2)
    deferred = DeferredBatchNorm.convert(copy.deepcopy(plain), chunks=2)
    first = plain(x)
    plain(first * 3)
    for part in x.chunk(2):
        assert int(deferred.num_batches_tracked) == 0  # nothing before the last forward ends
        with gathering_statistics():
            deferred(deferred(part) * 3)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(deferred.state_dict()[key], value, rtol=0, atol=TOLERANCE)
