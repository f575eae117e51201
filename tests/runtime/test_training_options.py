"""Global gradient clipping, learning-rate schedules and mixed precision across real processes.

Tolerances:
- fp32 with ``clip_grad_norm`` and ``lr_scheduler``: 1e-5 max abs on every parameter (as in
  test_distributed.py: micro-batches and replicas only reorder the gradient's sums, ~1e-7
  here), and the reported norm within 1e-5 relative of ``clip_grad_norm_``'s (ours sums in
  float64, torch's in fp32). A norm counted twice (a tied weight, a replica) or a clip on one
  stage's norm only moves parameters by 1e-3 or more.
- bf16: 3e-3 max abs on every parameter against the single-process run under
  ``torch.autocast`` (3 SGD steps at lr 0.5 of the tied GPT; the largest update is 0.09).
  bf16 keeps 8 significant bits (relative rounding up to 2^-9 = 2e-3). The pipeline rounds
  where the single process does not: each stage's output is cast to bf16 at the boundary (the
  single process keeps its residual stream in fp32 there), and each micro-batch rounds its own
  partial sums. Measured: 8e-4 (1% of the largest update); a lost micro-batch, a wrong loss
  divisor or a stale weight moves parameters by a sizeable part of an update (> 1e-2). So
  close a run cannot tell bf16 from fp32 by its parameters (the fp32 run is 1.3e-3 away): the
  test checks instead that every Linear ran in bf16 and that activations crossed in bf16.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from examples.models import lm_loss
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import (
    amplified_mlp,
    batches,
    mlp,
    text_batches,
    tied_model,
    tiny_gpt,
    token_batches,
)
from tests.runtime.test_distributed import TOLERANCE

MAX_NORM = 0.5  # below every step's norm in these runs (asserted): the clip is active
STEPS = 3
BF16_TOLERANCE = 3e-3
CASES = {  # model, data, loss, balance
    "mlp": (mlp, batches, nn.functional.cross_entropy, [4, 8]),
    "gpt": (tiny_gpt, text_batches, lm_loss, [2, 3]),  # head tied to the embedding
    "tied": (tied_model, token_batches, nn.functional.cross_entropy, [3, 3]),
}


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def reference(name: str, steps: int = STEPS) -> tuple[dict, list[float], list[float]]:
    """One process: clip_grad_norm_ and the same schedule; state, pre-clip norms, rates."""
    build, data, loss_fn, _ = CASES[name]
    model = build()
    optimizer = sgd(model.parameters())
    schedule = decay(optimizer)
    norms, rates = [], []
    for x, y in data(steps):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    return model.state_dict(), norms, rates


def _clipped(rank: int, world: int, name: str, replicas: int) -> tuple:
    build, data, loss_fn, balance = CASES[name]
    pipe = pipetrain.Pipeline(
        build(), balance, chunks=2, replicas=replicas, loss_fn=loss_fn, optimizer=sgd,
        lr_scheduler=decay, clip_grad_norm=MAX_NORM, timeout=60,
    )
    norms, rates = [], []
    for x, y in data(STEPS):  # each replica takes its share of the global mini-batch
        share = len(x) // replicas
        part = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
        pipe.train_step(x[part], y[part])
        norms.append(pipe.metrics["grad_norm"])
        rates.append(pipe.metrics["lr"])
    return pipe.module.state_dict(), norms, rates


def check_clipped(name: str, results: list[tuple]) -> None:
    expected, expected_norms, expected_rates = reference(name)
    assert min(expected_norms) > MAX_NORM  # every step clips
    assert expected_rates[0] > expected_rates[-1]  # the schedule moves the rate
    for state, norms, rates in results:
        assert norms == pytest.approx(expected_norms, rel=1e-5)
        assert rates == pytest.approx(expected_rates, rel=1e-12)
        for key, value in state.items():
            assert (value - expected[key]).abs().max().item() <= TOLERANCE, key
    assert set().union(*(s.keys() for s, _, _ in results)) == set(expected)


# -- fp16: an overflow on one stage skips the step everywhere -------------------------------------

OVERFLOW_AT, FP16_STEPS, GROWTH = 2, 5, 2


def _overflow(rank: int, world: int, replicas: int) -> list[dict]:
    """fp16 training in which stage 0 of replica 0 alone overflows at step OVERFLOW_AT."""
    model, amplifier = amplified_mlp()
    pipe = pipetrain.Pipeline(
        model, [5, 8], chunks=2, replicas=replicas, precision="fp16", optimizer=sgd,
        loss_fn=nn.functional.cross_entropy, timeout=60,
    )
    assert pipe.scaler is not None
    pipe.scaler.growth_interval = GROWTH
    records = []
    for step, (x, y) in enumerate(batches(FP16_STEPS)):
        share = len(x) // replicas
        part = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
        amplifier.factor = 1e6 if step == OVERFLOW_AT and pipe.placement.replica == 0 else 1.0
        before = {k: v.clone() for k, v in pipe.module.state_dict().items()}
        pipe.train_step(x[part], y[part])
        grads = [p.grad for s in pipe.stages for p in s.module.parameters() if p.grad is not None]
        after = pipe.module.state_dict()
        records.append({
            "skipped": pipe.metrics["skipped_step"],
            "scale": pipe.metrics["loss_scale"],
            "next_scale": pipe.scaler.scale,
            "own_grads_finite": all(bool(torch.isfinite(g).all()) for g in grads),
            "unchanged": all(torch.equal(v, before[k]) for k, v in after.items()),
        })
    return records


def reference_scaler() -> tuple[list[float], list[bool]]:
    """torch.amp.GradScaler in one process on the same model and data: scales, skips."""
    model, amplifier = amplified_mlp()
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH)
    scales, skipped = [], []
    for step, (x, y) in enumerate(batches(FP16_STEPS)):
        amplifier.factor = 1e6 if step == OVERFLOW_AT else 1.0
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scales.append(scaler.get_scale())
        scaler.step(optimizer)
        scaler.update()
        skipped.append(scaler.get_scale() < scales[-1])
    return scales, skipped


def check_overflow(results: list[list[dict]], world: int) -> None:
    scales, skipped = reference_scaler()
    assert skipped == [step == OVERFLOW_AT for step in range(FP16_STEPS)]
    for rank, records in enumerate(results):
        assert [r["skipped"] for r in records] == skipped, rank
        assert [r["scale"] for r in records] == scales, rank
        assert records[OVERFLOW_AT]["next_scale"] == scales[OVERFLOW_AT] / 2, rank
        assert records[OVERFLOW_AT]["unchanged"], rank  # no rank stepped
        assert not any(r["unchanged"] for i, r in enumerate(records) if i != OVERFLOW_AT), rank
    finite = [records[OVERFLOW_AT]["own_grads_finite"] for records in results]
    assert finite[:2] == [False, True]  # the overflow was stage 0's alone; stage 1 skipped too
    if world == 4:  # replica 1's stage 0 got the overflow only through the replica all-reduce
        assert finite[2:] == [False, True]


# -- bf16 -----------------------------------------------------------------------------------------


def bf16_sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def _bf16(rank: int, world: int) -> tuple[dict, list[torch.dtype], set[torch.dtype]]:
    pipe = pipetrain.Pipeline(
        tiny_gpt(), [2, 3], chunks=2, precision="bf16", loss_fn=lm_loss, optimizer=bf16_sgd,
        timeout=60,
    )
    arrived: list[torch.dtype] = []
    if pipe.stage == 1:
        pipe.stages[0].module[0].register_forward_pre_hook(
            lambda _, args: arrived.append(args[0].dtype)
        )
    computed: set[torch.dtype] = set()
    for layer in pipe.module.modules():
        if isinstance(layer, nn.Linear):
            layer.register_forward_hook(lambda _, __, out: computed.add(out.dtype))
    for x, y in text_batches(STEPS):
        pipe.train_step(x, y)
    return pipe.module.state_dict(), arrived, computed


def reference_precision(dtype: torch.dtype) -> dict:
    model = tiny_gpt()
    optimizer = bf16_sgd(model.parameters())
    for x, y in text_batches(STEPS):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=dtype):
            loss = lm_loss(model(x), y)
        loss.backward()
        optimizer.step()
    return model.state_dict()


def check_bf16(results: list[tuple[dict, list, set]]) -> None:
    autocast = reference_precision(torch.bfloat16)
    state = {k: v for s, _, _ in results for k, v in s.items()}
    assert state.keys() == autocast.keys()
    gap = max((state[k] - autocast[k]).abs().max().item() for k in autocast)
    print(f"bf16 pipeline vs single-process autocast: max abs {gap:.2e}")
    assert gap <= BF16_TOLERANCE
    arrived = results[1][1]  # every forward's input on stage 1, recomputations included
    assert len(arrived) >= 2 * STEPS and set(arrived) == {torch.bfloat16}  # crossed in bf16
    assert all(computed == {torch.bfloat16} for _, _, computed in results)  # under autocast


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_bf16_matches_the_same_rounding_in_one_process(schedule):
    """bf16 in two stage threads against one process that rounds where the pipeline does:
    each micro-batch's forward in an autocast region of its own (its weights cast afresh),
    stage 0's output cast to bf16 at the boundary. The pipeline casts each weight once per
    step (kept across the micro-batches' forwards) and must still agree to 1e-6 max abs: the
    casts are bit-identical and the gradient sums only reorder (measured ~2e-9); a lost
    micro-batch or a wrong loss divisor moves parameters by far more (an update here is
    ~1e-2), and so does a weight cast kept from the step before (stale by one update)."""
    from pipetrain.training.precision import to_boundary

    reference, model = tiny_gpt(), tiny_gpt()
    start = [p.detach().clone() for p in reference.parameters()]
    pipe = pipetrain.Pipeline(
        model, [2, 3], chunks=4, devices=["cpu", "cpu"], schedule=schedule, precision="bf16",
        loss_fn=lm_loss, optimizer=bf16_sgd,
    )
    for x, y in text_batches(STEPS):  # all steps first: an autocast region that the
        pipe.train_step(x, y)  # reference ends in this thread would clear a stale cast cache
    optimizer = bf16_sgd(reference.parameters())
    for x, y in text_batches(STEPS):
        optimizer.zero_grad()
        for xi, yi in zip(x.chunk(4), y.chunk(4), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                boundary = to_boundary(reference[:2](xi), torch.bfloat16)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = lm_loss(reference[2:](boundary), yi)
            (loss / 4).backward()
        optimizer.step()
    pairs = list(zip(model.parameters(), reference.parameters(), strict=True))
    assert max((a - b).abs().max().item() for a, b in pairs) <= 1e-6
    moved = zip(start, model.parameters(), strict=True)
    assert max((a - b).abs().max().item() for a, b in moved) > 1e-3  # it trained


# -- resume mid-schedule --------------------------------------------------------------------------

RESUME_STEPS, SAVED_AT = 6, 3


def _resume(rank: int, world: int, folder: str) -> tuple:
    def build(checkpoint_dir: str | None) -> pipetrain.Pipeline:
        return pipetrain.Pipeline(
            mlp(), [4, 8], chunks=2, precision="fp16", loss_fn=nn.functional.cross_entropy,
            optimizer=sgd, lr_scheduler=decay, clip_grad_norm=MAX_NORM, timeout=60,
            checkpoint_dir=checkpoint_dir, checkpoint_every=SAVED_AT,
        )

    def metrics(pipe: pipetrain.Pipeline) -> tuple:
        return pipe.metrics["lr"], pipe.metrics["loss_scale"], pipe.metrics["grad_norm"]

    data = batches(RESUME_STEPS)
    straight = build(None)
    assert straight.scaler is not None
    straight.scaler.growth_interval = 2  # the scale changes before and after the save
    seen = []
    for x, y in data:
        straight.train_step(x, y)
        seen.append(metrics(straight))
    first = build(folder)
    assert first.scaler is not None
    first.scaler.growth_interval = 2
    for x, y in data[:SAVED_AT]:
        first.train_step(x, y)
    resumed = build(folder)  # a fresh pipeline picks the checkpoint up (and its scaler state)
    assert resumed.step == SAVED_AT
    after = []
    for x, y in data[SAVED_AT:]:
        resumed.train_step(x, y)
        after.append(metrics(resumed))
    return straight.module.state_dict(), resumed.module.state_dict(), seen, after


def check_resume(results: list[tuple]) -> None:
    for straight, resumed, seen, after in results:
        assert straight.keys() == resumed.keys()
        for key in straight:
            assert torch.equal(straight[key], resumed[key]), key
        assert after == seen[SAVED_AT:]
        rates = [lr for lr, _, _ in seen]
        assert rates[SAVED_AT - 1] > rates[SAVED_AT] > rates[-1]  # resumed mid-schedule
        assert len({scale for _, scale, _ in seen}) > 1  # the loss scale changed on the way


# -- the runs -------------------------------------------------------------------------------------


def _two_ranks(rank: int, world: int, folder: str) -> dict:
    """Every two-process case in one set of processes (each start costs seconds)."""
    return {
        "mlp": _clipped(rank, world, "mlp", 1),
        "gpt": _clipped(rank, world, "gpt", 1),
        "overflow": _overflow(rank, world, 1),
        "bf16": _bf16(rank, world),
        "resume": _resume(rank, world, folder),
    }


def _four_ranks(rank: int, world: int) -> dict:
    return {
        "mlp": _clipped(rank, world, "mlp", 2),
        "gpt": _clipped(rank, world, "gpt", 2),
        "overflow": _overflow(rank, world, 2),
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    folder = tmp_path_factory.mktemp("checkpoints")
    return values(run_ranks(_two_ranks, 2, str(folder), deadline=240))


def test_clipping_and_schedule_equal_single_process_on_two_stages(two):
    check_clipped("mlp", [r["mlp"] for r in two])


def test_clipping_counts_a_tied_head_once(two):
    check_clipped("gpt", [r["gpt"] for r in two])


def test_fp16_overflow_on_one_stage_skips_the_step_on_every_rank(two):
    check_overflow([r["overflow"] for r in two], 2)


def test_bf16_tracks_single_process_autocast(two):
    check_bf16([r["bf16"] for r in two])


def test_resume_mid_schedule_equals_the_uninterrupted_run(two):
    check_resume([r["resume"] for r in two])


@pytest.mark.slow
def test_clipping_fp16_and_schedule_with_two_replicas():
    results = values(run_ranks(_four_ranks, 4, deadline=300))
    check_clipped("mlp", [r["mlp"] for r in results])
    check_clipped("gpt", [r["gpt"] for r in results])
    check_overflow([r["overflow"] for r in results], 4)


# -- one process, and refused combinations --------------------------------------------------------


def test_clipping_and_schedule_in_one_process_with_a_shared_weight():
    build, data, loss_fn, balance = CASES["tied"]
    pipe = pipetrain.Pipeline(
        build(), balance, chunks=2, devices=["cpu", "cpu"], loss_fn=loss_fn, optimizer=sgd,
        lr_scheduler=decay, clip_grad_norm=MAX_NORM,
    )
    norms = []
    for x, y in data(STEPS):
        pipe.train_step(x, y)
        norms.append(pipe.metrics["grad_norm"])
    expected, expected_norms, _ = reference("tied")
    assert min(expected_norms) > MAX_NORM
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    state = pipe.module.state_dict()
    for key, value in expected.items():
        assert (state[key] - value).abs().max().item() <= TOLERANCE, key


def test_metrics_without_clipping_report_the_rate_and_no_norm():
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], devices=["cpu", "cpu"], loss_fn=nn.functional.cross_entropy,
        optimizer=sgd, lr_scheduler=decay,
    )
    rates = []
    for x, y in batches(2):
        pipe.train_step(x, y)
        rates.append(pipe.metrics["lr"])
        assert pipe.metrics["grad_norm"] is None and "loss_scale" not in pipe.metrics
    assert rates == [0.1, 0.05]


def _pipeline(**options) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(mlp(), [4, 8], loss_fn=nn.functional.cross_entropy, **options)


def test_an_optimizer_instance_asks_for_a_factory():
    with pytest.raises(TypeError, match=r"pass a factory: optimizer=lambda params: torch\.optim"):
        _pipeline(optimizer=torch.optim.SGD(mlp().parameters(), lr=0.1))


def test_a_scheduler_instance_asks_for_a_factory():
    optimizer = torch.optim.SGD(mlp().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="lr_scheduler=lambda optimizer"):
        _pipeline(optimizer=sgd, lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1))


def test_unknown_precision_and_bad_clip_are_refused():
    with pytest.raises(ValueError, match="precision must be one of"):
        _pipeline(optimizer=sgd, precision="fp8")
    with pytest.raises(ValueError, match="clip_grad_norm must be a positive number"):
        _pipeline(optimizer=sgd, clip_grad_norm=0)


@pytest.mark.parametrize("schedule", ["pipedream", "pipedream-2bw"])
def test_fp16_with_an_asynchronous_schedule_names_the_alternative(schedule):
    with pytest.raises(ValueError, match="use precision='bf16'.*or a synchronous schedule"):
        _pipeline(optimizer=sgd, schedule=schedule, precision="fp16")


@pytest.mark.parametrize("schedule, balance", [("interleaved", [3, 3, 3, 3]), ("zb-h1", [4, 8])])
def test_clipping_with_several_stages_per_rank_and_split_backward(schedule, balance):
    pipe = pipetrain.Pipeline(
        mlp(), balance, chunks=4, schedule=schedule, devices=["cpu", "cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, lr_scheduler=decay,
        clip_grad_norm=MAX_NORM,
    )
    norms = []
    for x, y in batches(STEPS):
        pipe.train_step(x, y)
        norms.append(pipe.metrics["grad_norm"])
    expected, expected_norms, _ = reference("mlp")
    assert norms == pytest.approx(expected_norms, rel=1e-5)
    state = pipe.module.state_dict()
    for key, value in expected.items():
        assert (state[key] - value).abs().max().item() <= TOLERANCE, key


def test_an_asynchronous_schedule_steps_the_rate_once_per_update_in_bf16():
    pipe = pipetrain.Pipeline(
        mlp(), [4, 8], chunks=2, schedule="pipedream-2bw", devices=["cpu", "cpu"],
        loss_fn=nn.functional.cross_entropy, optimizer=sgd, lr_scheduler=decay,
        precision="bf16",
    )
    for x, y in batches(4):
        assert torch.isfinite(torch.tensor(pipe.train_step(x, y)))
    pipe.flush()  # every stage has made its 4 updates (one per mini-batch)
    assert [s.optimizer.param_groups[0]["lr"] for s in pipe.stages] == pytest.approx([0.1 / 5] * 2)
