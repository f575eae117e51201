"""Generated models trained by every synchronous schedule give the parameters of plain
single-process training.

tests/property/model_space.py draws the model from a vocabulary of what users write (Linear,
Conv1d, Embedding with a tied head, LayerNorm, BatchNorm, Dropout, in-place ReLU after views and
at a stage's start, parameterless reshapes, detached paths, frozen layers and parameters, layers
returning tuples, their input or views, residual blocks, a module used twice in one stage or in
two, a Parameter shared by modules of one stage or of two) and the set-up: balance (1-4 stages),
micro-batches (1-4), every synchronous schedule in the registry (interleaved with 1 or 2 ranks,
several stages per rank), a checkpoint (recompute) mode per stage, SGD with momentum or AdamW,
a gradient clip on or off, 1-3 steps, layers named by position or with dots ("layers.0", as
pipetrain.hf's). Stages run as threads (``devices=["cpu", ...]``); a fixed sample of 2-rank
cases runs in 2 gloo processes, and another on 2 stages x 2 replicas at ZeRO 2 or 3 in 4
(without BatchNorm and Dropout, whose statistics and masks follow each replica's rows).

Tolerance: 1e-5 on every parameter and loss, fp32. The pipeline sums the same products as plain
training in another order (per micro-batch, per stage), which moves results by about 1e-7 after
3 steps; a lost, doubled or misplaced gradient moves them by 1e-4 or more (one step at lr 0.01).

The AdamW trap: a gradient that is mathematically zero (a bias before a norm over the same axis,
e.g. a Conv1d's per-channel bias before a LayerNorm over that channel's values, or a Linear's
bias before BatchNorm) is summation-order noise of about 1e-9, which AdamW at its default
eps=1e-8 turns into a step of about the learning rate; plain training itself then moves 1e-2
when only the order of a sum changes. AdamW here uses eps=1e-3, so such noise moves a
parameter by lr * noise / eps < 1e-7, while real gradients (1e-3 and up) still take Adam's
normalised steps; the generator does not avoid these layer orders.

The reference (model_space.train_reference) sums the micro-batches' gradients (each loss
divided by the micro-batch count, as the pipeline does), so BatchNorm normalises each
micro-batch by its own statistics on both sides, and draws each stage's dropout masks from the
stage's own random stream, seeded as the pipeline seeds it. A case that plain training itself
refuses (an in-place op on a value autograd saved) is rejected, not counted.

Deterministic: hypothesis runs derandomized without a database, so CI draws the same cases;
failures it found are kept as named tests in test_regressions.py. The default run tries
FAST_EXAMPLES cases in threads and PROCESS_SAMPLE in processes; ``-m slow`` tries
LONG_EXAMPLES and LONG_PROCESS_SAMPLE, and checks and prints how many of its draws exercise
each feature.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st

from tests.property.model_space import (
    BATCH,
    SCHEDULES,
    Case,
    RandomChooser,
    draw_case,
    features,
    largest_difference,
    norm_across_ranks,
    train_pipeline,
    train_reference,
)
from tests.runtime.harness import run_ranks, values

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
FAST_EXAMPLES = 300
LONG_EXAMPLES = 3000
PROCESS_SAMPLE = 6
LONG_PROCESS_SAMPLE = 60
SAMPLE_SEED = 0  # the process sample's cases are RandomChooser(SAMPLE_SEED + k)'s
ZERO_SAMPLE = 4
LONG_ZERO_SAMPLE = 30
ZERO_SEED = 1000  # the ZeRO sample's, RandomChooser(ZERO_SEED + k)'s
REPLICAS = 2
REPLICA_VARIES = frozenset({"batchnorm", "dropout"})  # their statistics, masks: per replica


class HypothesisChooser:
    """The generator's choices drawn by hypothesis (which then shrinks a failing case)."""

    def __init__(self, draw: st.DrawFn):
        self.draw = draw

    def integer(self, low: int, high: int) -> int:
        return self.draw(st.integers(low, high))

    def choice(self, options: Any) -> Any:
        return self.draw(st.sampled_from(list(options)))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    case = draw_case(HypothesisChooser(draw))
    return dataclasses.replace(case, dotted=draw(st.booleans()))


def reference_or_reject(case: Case) -> dict[str, Any]:
    """Plain training's result; a case that plain training itself refuses is not a case."""
    try:
        return train_reference(case)
    except RuntimeError as error:
        if "inplace" not in str(error):
            raise
        reject()


def assert_trains_like_one_process(case: Case, per_rank: list[dict[str, Any]],
                                   expected: dict[str, Any]) -> None:
    worst, where = largest_difference(per_rank, expected)
    assert worst <= TOLERANCE, f"{where} differs from plain training by {worst:.3g} in {case}"


def check_threads(case: Case) -> None:
    """``case`` trained with stages as threads equals plain training."""
    expected = reference_or_reject(case)
    assert_trains_like_one_process(case, [train_pipeline(case)], expected)


def _fast(test: Any) -> Any:
    return settings(
        max_examples=FAST_EXAMPLES, derandomize=True, database=None, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )(test)


@_fast
@given(cases())
def test_threads_train_like_one_process(case):
    check_threads(case)


@pytest.mark.slow
@settings(
    max_examples=LONG_EXAMPLES, derandomize=True, database=None, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(cases())
def test_threads_train_like_one_process_long(case):
    check_threads(case)


@pytest.mark.slow
def test_report_features_of_the_long_profile(capsys):
    """Every feature the docstring promises, and no other, occurs in at least LONG_MINIMUM of
    the long profile's number of draws; prints the cases per feature."""
    seen = drawn_features(LONG_EXAMPLES)
    with capsys.disabled():
        print(f"\ncases per feature ({LONG_EXAMPLES} examples drawn):")
        for feature, count in sorted(seen.items()):
            print(f"  {count:6d}  {feature}")
    assert set(seen) == PROMISED, (
        f"never drawn: {sorted(PROMISED - set(seen))}; "
        f"not promised: {sorted(set(seen) - PROMISED)}"
    )
    rare = {feature: count for feature, count in seen.items() if count < LONG_MINIMUM}
    assert not rare, f"drawn fewer than {LONG_MINIMUM} times: {rare}"


def process_sample(count: int, zero: bool = False) -> list[tuple[Case, dict[str, Any]]]:
    """``count`` 2-rank cases from fixed seeds (every other one with dotted layer names), with
    plain training's result; cases plain training or the pipeline refuses (a BatchNorm used on
    two ranks) are passed over. ``zero``: each stage on REPLICAS replicas at ZeRO 2 or 3 (in
    turn, reduce-scattering once per step or per micro-batch), without what varies per replica,
    with micro-batches that split each replica's rows."""
    sample: list[tuple[Case, dict[str, Any]]] = []
    seed = ZERO_SEED if zero else SAMPLE_SEED
    while len(sample) < count:
        drawn = draw_case(RandomChooser(seed), ranks=2,
                          leave_out=REPLICA_VARIES if zero else frozenset())
        case = dataclasses.replace(drawn, dotted=bool(seed % 2))
        if zero:
            case = dataclasses.replace(  # each level with each reduce-scatter, in turn
                case, replicas=REPLICAS, zero=2 + len(sample) % 2,
                reduce_scatter=("step", "microbatch")[len(sample) // 2 % 2])
        seed += 1
        if norm_across_ranks(case) or (BATCH // case.replicas) % case.chunks:
            continue
        try:
            sample.append((case, train_reference(case)))
        except RuntimeError as error:
            if "inplace" not in str(error):
                raise
    return sample


def _train_all(rank: int, world: int, sample: list[Case]) -> list[dict[str, Any]]:
    """Every case in turn on this rank; the first that fails ends the run (the ranks' later
    messages would not pair up), its error in place of its result."""
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    for case in sample:
        try:
            results.append(train_pipeline(case, devices=False, timeout=20))
        except Exception as error:
            results.append({"error": f"{type(error).__name__}: {error}"})
            break
    return results


def train_in_processes(sample: list[Case], world: int = 2) -> list[list[dict[str, Any]]]:
    """Each rank's results of :func:`_train_all` over ``sample`` in ``world`` gloo processes;
    fails naming the rank that raised or died (which ends the run for the others too) and,
    where one died, the first case that kills a rank when trained alone."""
    results = run_ranks(_train_all, world, sample, deadline=60 + 10 * len(sample))
    died = [f"rank {r} died (exit code {v})" for r, (s, v) in enumerate(results) if s == "died"]
    if died and len(sample) > 1:  # which case killed it: each alone until one dies again
        for case in sample:
            train_in_processes([case], world)
    assert not died, f"{died} training {sample}"
    return values(results)


def check_processes(count: int, zero: bool = False) -> None:
    sample = process_sample(count, zero)
    per_rank = train_in_processes([c for c, _ in sample], 2 * (REPLICAS if zero else 1))
    for k, (case, expected) in enumerate(sample):
        results = [r[k] for r in per_rank]
        errors = [r["error"] for r in results if "error" in r]
        assert not errors, f"{case} failed in processes: {errors}"
        assert_trains_like_one_process(case, results, expected)


def test_processes_train_like_one_process():
    check_processes(PROCESS_SAMPLE)


@pytest.mark.slow
def test_processes_train_like_one_process_long():
    check_processes(LONG_PROCESS_SAMPLE)


def test_processes_at_zero_2_and_3_train_like_one_process():
    check_processes(ZERO_SAMPLE, zero=True)


@pytest.mark.slow
def test_processes_at_zero_2_and_3_train_like_one_process_long():
    check_processes(LONG_ZERO_SAMPLE, zero=True)


PROMISED = {
    "Linear", "Conv1d", "Embedding with a tied head", "LayerNorm", "BatchNorm (deferred)",
    "Dropout", "GELU", "in-place ReLU", "in-place after a view", "in-place at a stage's start",
    "in-place first layer", "reshape: Flatten", "reshape: view", "reshape: slice",
    "reshape: transpose", "detached path", "frozen layer", "frozen parameter",
    "layer returning a tuple", "layer returning its own input", "layer returning views",
    "residual block", "module used twice in one stage", "module used twice in two stages",
    "BatchNorm used twice in one stage", "BatchNorm used twice in two stages",
    "Parameter shared by modules", "Parameter shared in one stage",
    "Parameter shared in two stages", "tied head in one stage", "tied head in two stages",
    "several stages per rank", "clip on", "clip off", "optimizer sgd", "optimizer adamw",
    "checkpoint never", "checkpoint except_last", "checkpoint always",
    "dotted layer names", "positional layer names", *(f"schedule {name}" for name in SCHEDULES),
    *(f"{n} stage(s)" for n in range(1, 5)), *(f"chunks {n}" for n in range(1, 5)),
    *(f"{n} step(s)" for n in range(1, 4)),
}
"""The vocabulary and set-ups the module docstring promises, as model_space.features names
them."""
LONG_MINIMUM = 30  # the long profile's fewest cases of any one feature (about 60 are drawn)


def drawn_features(examples: int) -> Counter[str]:
    """Cases per feature among ``examples`` of hypothesis' draws of the cases strategy (no
    training; derandomized: the same in every run)."""
    seen: Counter[str] = Counter()

    @settings(max_examples=examples, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
    @given(cases())
    def draw(case: Case) -> None:
        seen.update(features(case))

    draw()
    return seen


def test_the_generator_reaches_every_feature():
    """Every feature the docstring promises occurs among the fast profile's number of draws."""
    seen = drawn_features(FAST_EXAMPLES)
    assert PROMISED <= set(seen), f"never drawn: {sorted(PROMISED - set(seen))}"
