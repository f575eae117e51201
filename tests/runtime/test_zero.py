"""ZeRO 1-3 over each stage's replicas (pipetrain/runtime/sharding.py) against ZeRO 0 and
single-process training, on real gloo processes: AdamW, clipping by the global norm (small
enough to bite) and a LambdaLR schedule, 3 steps.

Tolerances (fp32): 1e-6 against zero=0, whose gradients are the same sums in another order
(reduce-scatter instead of all-reduce) and whose optimizer runs the same arithmetic per element;
1e-5 against single-process training, as test_hybrid.py (replicas also change the order in which
a mini-batch's contributions are summed).
"""

from __future__ import annotations

import contextlib
import re
import warnings

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

import pipetrain
from pipetrain.runtime.fsdp_parts import private
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, text_batches, tied_model, tiny_gpt, token_batches

STEPS = 3
CLIP = 0.5  # the gradients' norm is above it at every step here: the clip changes the answer
AGAINST_ZERO = 1e-6
AGAINST_ONE_PROCESS = 1e-5


def adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def decay(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))


def single_process(model: nn.Module, data: list) -> dict[str, torch.Tensor]:
    """The same steps in one process: the whole batch, clip_grad_norm_, then the step."""
    opt = adamw(model.parameters())
    schedule = decay(opt)
    for x, y in data:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        schedule.step()
    return model.state_dict()


def _whole(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state_dict with every sharded tensor gathered (a collective over its replicas)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in state.items()}


def _train_each_level(
    rank: int, world: int, replicas: int, schedule: str = "1f1b",
    reduce_scatter: str = "step", levels: tuple[int, ...] = (0, 1, 2, 3),
) -> dict[int, dict]:
    """Per zero level: this rank's whole parameters after the steps, the gradient norms, and
    what it sharded (its parameters' and optimizer state's local elements); at 2 and 3 the
    gradients reduce-scattered as ``reduce_scatter`` says."""
    out = {}
    for zero in levels:
        pipe = pipetrain.Pipeline(
            mlp(), [5, 7], chunks=2, schedule=schedule, replicas=replicas, zero=zero,
            loss_fn=nn.functional.cross_entropy, optimizer=adamw, lr_scheduler=decay,
            clip_grad_norm=CLIP, timeout=60,
            reduce_scatter=reduce_scatter if zero >= 2 else "step",
        )
        share = len(batches(1)[0][0]) // replicas
        part = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
        norms = []
        for x, y in batches(STEPS):
            pipe.train_step(x[part], y[part])
            norms.append(pipe.metrics["grad_norm"])
        stage = pipe.stages[0]
        optimizer = stage.optimizer
        assert optimizer is not None
        mine = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
        out[zero] = {
            "state": _whole(pipe.module.state_dict()),
            "norms": norms,
            "weights": sum(
                (p.to_local() if isinstance(p, DTensor) else p).numel()
                for p in stage.module.parameters()
            ),
            "optimizer": sum(
                (t.to_local() if isinstance(t, DTensor) else t).numel()
                for s in mine.state.values() for t in s.values() if t.dim() > 0
            ),
        }
    return out


def _check(results: list[dict[int, dict]], replicas: int) -> None:
    expected = single_process(mlp(), batches(STEPS))
    for ranks in results:
        base = ranks[0]
        assert min(base["norms"]) > CLIP  # the clip was in force at every step
        for zero in (1, 2, 3):
            got = ranks[zero]
            assert got["norms"] == pytest.approx(base["norms"], rel=1e-6)
            for key, value in got["state"].items():
                assert (value - base["state"][key]).abs().max().item() <= AGAINST_ZERO, (zero, key)
                assert (value - expected[key]).abs().max().item() <= AGAINST_ONE_PROCESS, key
        # what each level shards, on this rank: ZeroRedundancyOptimizer partitions whole
        # parameters; FSDP2 every parameter's dim 0, and between steps it holds only the
        # shards at zero 2 too (zero 3 differs in the step, when weights are gathered)
        assert base["optimizer"] == 2 * base["weights"]  # AdamW: two moments per weight
        assert ranks[1]["weights"] == base["weights"]
        assert ranks[1]["optimizer"] < base["optimizer"]
        for zero in (2, 3):
            assert ranks[zero]["weights"] < base["weights"]
            assert ranks[zero]["optimizer"] == 2 * ranks[zero]["weights"]
    keys = set().union(*(r[3]["state"].keys() for r in results))
    assert keys == set(expected)


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_zero_1_2_3_train_as_zero_0_and_one_process_on_2_stages_x_2_replicas(schedule):
    """Under 1F1B, and under the split-backward schedules, whose W makes the weight
    gradients after B: at zero 2 and 3 FSDP2 reduce-scatters after the stage's last W."""
    results = values(run_ranks(_train_each_level, 4, 2, schedule, deadline=400))
    _check(results, 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1", "zb-h2"])
def test_zero_1_2_3_train_as_zero_0_and_one_process_on_2_stages_x_4_replicas(schedule):
    results = values(run_ranks(_train_each_level, 8, 4, schedule, deadline=900))
    _check(results, 4)


def _per_microbatch_and_step(
    rank: int, world: int, schedule: str
) -> dict[int | str, dict]:
    """Every level with zero 2 and 3 reduce-scattering each micro-batch, and zero 2 and 3
    reducing once per step (keys "step 2", "step 3")."""
    out: dict[int | str, dict] = dict(
        _train_each_level(rank, world, 2, schedule, reduce_scatter="microbatch")
    )
    for zero, got in _train_each_level(rank, world, 2, schedule, levels=(2, 3)).items():
        out[f"step {zero}"] = got
    return out


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_a_reduce_scatter_per_microbatch_trains_as_once_per_step_and_one_process(schedule):
    """reduce_scatter="microbatch" at zero 2 and 3, 2 stages x 2 replicas (2 micro-batch
    reductions a stage and step instead of 1; under zb-h1 one after each W): the parameters
    of zero 0, of "step" and of one process."""
    results = values(run_ranks(_per_microbatch_and_step, 4, schedule, deadline=400))
    _check(results, 2)
    for ranks in results:
        for zero in (2, 3):
            assert ranks[zero]["norms"] == pytest.approx(ranks[f"step {zero}"]["norms"],
                                                         rel=1e-6)
            for key, value in ranks[zero]["state"].items():
                step = ranks[f"step {zero}"]["state"][key]
                assert (value - step).abs().max().item() <= AGAINST_ZERO, (zero, key)


def _reduced_when(rank: int, world: int) -> dict[str, list[bool]]:
    """Per zero 2 and 3 and mode, on 2 stages x 2 replicas (1F1B, 2 micro-batches): after
    each backward of the second step, whether stage 0's sharded gradients hold anything yet
    (zeroed in place at the step's start, they change only when a reduce-scatter adds in)."""
    out = {}
    for zero in (2, 3):
        for mode in ("step", "microbatch"):
            pipe = pipetrain.Pipeline(
                mlp(), [5, 7], chunks=2, replicas=2, zero=zero, reduce_scatter=mode,
                loss_fn=nn.functional.cross_entropy, optimizer=adamw, timeout=60,
            )
            stage, seen = pipe.stages[0], []
            backward = stage.backward
            assert stage.optimizer is not None
            # the module holds the gathered weights during a step at zero 2: the optimizer's
            shards = [p for g in stage.optimizer.param_groups for p in g["params"]
                      if isinstance(p, DTensor)]

            def noting(*args, backward=backward, shards=shards, seen=seen):
                found = backward(*args)
                seen.append(any(p.grad.to_local().abs().sum().item() > 0  # the shards
                                for p in shards if p.grad is not None))
                return found

            stage.backward = noting
            data = batches(2)
            _steps(pipe, data[:1])
            seen.clear()
            _steps(pipe, data[1:])
            if stage.index == 0:
                out[f"{zero} {mode}"] = list(seen)
    return out


def test_reduce_scatter_microbatch_reduces_at_every_backward_and_step_at_the_last():
    results = [got for got in values(run_ranks(_reduced_when, 4, deadline=300)) if got]
    assert len(results) == 2  # stage 0's ranks, one per replica
    for got in results:
        for zero in (2, 3):
            assert got[f"{zero} step"] == [False, True], zero
            assert got[f"{zero} microbatch"] == [True, True], zero


def test_reduce_scatter_is_refused_where_nothing_is_reduce_scattered():
    for zero in (0, 1):
        with pytest.raises(ValueError, match="pass zero=2 or 3 with it"):
            pipetrain.Pipeline(mlp(), [5, 7], zero=zero, reduce_scatter="microbatch")
    with pytest.raises(ValueError, match="reduce_scatter must be 'step'"):
        pipetrain.Pipeline(mlp(), [5, 7], zero=2, reduce_scatter="layer")


def _pipeline(zero: int, balance: list[int], replicas: int, seed: int = 0) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(
        mlp(seed=seed), balance, chunks=2, schedule="1f1b", replicas=replicas, zero=zero,
        loss_fn=nn.functional.cross_entropy, optimizer=adamw, lr_scheduler=decay,
        clip_grad_norm=CLIP, timeout=60,
    )


def _steps(pipe: pipetrain.Pipeline, data: list) -> None:
    replicas = pipe.placement.replicas
    for x, y in data:
        share = len(x) // replicas
        part = slice(pipe.placement.replica * share, (pipe.placement.replica + 1) * share)
        pipe.train_step(x[part], y[part])


def _resume(rank: int, world: int, folder: str) -> dict[str, dict]:
    """zero=3 on 2 stages x 2 replicas: 4 steps straight, and 2 steps saved then resumed (a
    model of other weights loads the checkpoint) for 2 more at zero 3, at zero 1, and on 4
    stages x 1 replica; the checkpoint consolidated."""
    data = batches(4)
    straight = _pipeline(3, [5, 7], 2)
    _steps(straight, data)
    saving = _pipeline(3, [5, 7], 2)
    _steps(saving, data[:2])
    saved = _whole(saving.module.state_dict())
    saving.save(folder)
    out = {"straight": _whole(straight.module.state_dict()), "saved": saved}
    for name, zero, balance, replicas in (
        ("zero 3", 3, [5, 7], 2), ("zero 1", 1, [5, 7], 2), ("4 x 1", 2, [3, 3, 3, 3], 1),
    ):
        resumed = _pipeline(zero, balance, replicas, seed=7)
        assert resumed.load(folder) == 2
        _steps(resumed, data[2:])
        out[name] = _whole(resumed.module.state_dict())
        if zero == 1:  # ZeroRedundancyOptimizer's state, gathered to the first replica
            resumed.save(folder + "-zero1")
            loaded = _pipeline(0, [5, 7], 2, seed=7)
            assert loaded.load(folder + "-zero1") == 4
            out["zero 1 saved"] = (_optimizer(resumed), _optimizer(loaded))
    if rank == 0:
        out["consolidated"] = pipetrain.consolidate(folder)
    return out


def _optimizer(pipe: pipetrain.Pipeline) -> dict[str, torch.Tensor]:
    """The first stage's whole optimizer state by parameter name (zero 0 or 1; a collective
    at 1)."""
    stage = pipe.stages[0]
    optimizer = stage.optimizer
    assert optimizer is not None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        optimizer.consolidate_state_dict(to=0)
        if pipe.placement.replica > 0:
            return {}
    names = [n for n, _ in stage.module.named_parameters()]
    state = optimizer.state_dict()["state"]
    return {f"{names[i]}.{k}": v for i, s in state.items() for k, v in s.items()}


def test_a_sharded_checkpoint_resumes_bit_identical_and_under_other_replicas_and_zero(tmp_path):
    results = values(run_ranks(_resume, 4, str(tmp_path / "ckpt"), deadline=400))
    for got in results:
        for key, value in got["zero 3"].items():  # the same sums in the same order: equal
            assert torch.equal(value, got["straight"][key]), key
        for key, value in got["zero 1"].items():
            assert (value - got["straight"][key]).abs().max().item() <= AGAINST_ZERO, key
        kept, loaded = got["zero 1 saved"]
        for key, value in kept.items():  # the first replica gathered the whole state
            assert torch.equal(value, loaded[key]), key
    assert results[0]["zero 1 saved"][0].keys() == results[0]["zero 1 saved"][1].keys()
    whole = {k: v for got in results for k, v in got["straight"].items()}
    for got in results:  # 4 stages x 1 replica: another order of the batch's sums
        for key, value in got["4 x 1"].items():
            assert (value - whole[key]).abs().max().item() <= AGAINST_ONE_PROCESS, key
    saved = {k: v for got in results for k, v in got["saved"].items()}
    consolidated = results[0]["consolidated"]
    assert consolidated.keys() == saved.keys()
    for key, value in consolidated.items():
        assert torch.equal(value, saved[key]), key


def _options(rank: int, world: int, folder: str) -> dict[str, dict]:
    """Per variant, each level's whole parameters, skip flags and an evaluation's output after
    3 steps on 2 x 2 ranks."""
    data = batches(STEPS)
    weights = f"{folder}/weights.pt"  # a whole-model file every rank reads its layers from
    if rank == 0:
        torch.save(mlp(seed=5).state_dict(), weights)
    torch.distributed.barrier()
    poisoned = [(x.clone(), y) for x, y in data]
    poisoned[1][0][0, 0] = float("nan")  # the first replica's share of step 2: skipped
    variants = {  # name: (options, balance, data, levels)
        "gpipe": (dict(schedule="gpipe"), [5, 7], data, (0, 3)),
        "interleaved": (dict(schedule="interleaved", chunks=4), [3, 3, 3, 3], data, (0, 3)),
        "bf16": (dict(precision="bf16"), [5, 7], data, (0, 3)),
        "fp16": (dict(precision="fp16"), [5, 7], data, (0, 3)),
        "skip": (dict(), [5, 7], poisoned, (0, 3)),
        "zero bubble": (dict(schedule="zb-h1"), [5, 7], data, (0, 1, 3)),
        # W backpropagates the recomputed stage again, through the gathered weights
        "zero bubble recomputed": (dict(schedule="zb-h1", recompute="always"), [5, 7],
                                   data, (0, 3)),
        "lazy": (dict(init_seed=3), [5, 7], data, (0, 3)),
        "lazy from a file": (dict(weights=weights), [5, 7], data, (0, 3)),
    }
    out = {}
    for name, (options, balance, steps, levels) in variants.items():
        for zero in levels:
            lazy = "init_seed" in options or "weights" in options
            with torch.device("meta") if lazy else contextlib.nullcontext():
                model = mlp()
            pipe = pipetrain.Pipeline(
                model, balance, **{"chunks": 2, "schedule": "1f1b", **options}, replicas=2,
                zero=zero, loss_fn=nn.functional.cross_entropy, optimizer=adamw,
                lr_scheduler=decay, clip_grad_norm=CLIP, timeout=60,
            )
            skipped = []
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for x, y in steps:
                    _steps(pipe, [(x, y)])
                    skipped.append(bool(pipe.metrics["skipped_step"]))
            out[f"{name} {zero}"] = {
                "state": _whole(pipe.module.state_dict()), "skipped": skipped,
                "eval": pipe.eval_step(data[0][0]),
            }
    return out


def test_zero_under_gpipe_interleaved_bf16_fp16_lazy_zb_and_a_skipped_step_trains_as_zero_0(
    tmp_path,
):
    """zero=3 (and zero=1 under zb-h1) against zero=0, 1e-6, and the same evaluation
    output: under GPipe, interleaved stages, bf16 and fp16 autocast (the same casts of the
    same weights; fp16's loss scale unscales the shards), a meta-device model materialized
    per stage (by the init rule, or from a weights file; at zero 3 a layer at a time, each
    sharded before the next), a step whose non-finite loss skips it on every rank, and zb-h1
    with every micro-batch recomputed (its W backpropagates the stage's outputs again)."""
    results = values(run_ranks(_options, 4, str(tmp_path), deadline=900))
    for got in results:
        names = {key.rsplit(" ", 1)[0] for key in got}
        assert len(names) == 9
        levels = [key.rsplit(" ", 1) for key in got if not key.endswith(" 0")]
        assert len(levels) == 10
        for name, level in levels:
            base, sharded = got[f"{name} 0"], got[f"{name} {level}"]
            assert sharded["skipped"] == base["skipped"]
            assert base["skipped"] == ([False, True, False] if name == "skip" else [False] * 3)
            for key, value in sharded["state"].items():
                assert (value - base["state"][key]).abs().max().item() <= AGAINST_ZERO, (name, key)
            if base["eval"] is not None:  # on the last stage's ranks
                assert (sharded["eval"] - base["eval"]).abs().max().item() <= AGAINST_ZERO, name


def _refusals(rank: int, world: int) -> list[str]:
    """What each unsupported combination raises, on 2 stages x 2 replicas."""
    attempts = [(mlp(), [5, 7], dict(zero=2, cuda_graphs=True))]
    messages = []
    for model, balance, options in attempts:
        with pytest.raises(ValueError) as error:
            pipetrain.Pipeline(model, balance, replicas=2, loss_fn=nn.functional.cross_entropy,
                               optimizer=adamw, timeout=60, **options)
        messages.append(str(error.value))
    return messages


def _tied(rank: int, world: int) -> dict[int | str, dict]:
    """A weight tied across the two stages (embedding and head), zero 0 to 3, 3 steps: the
    whole parameters, the gradient norms, and whether the tied copy stayed whole here; and
    zero 0 and 3 on a model built on the meta device, under interleaved stages and under
    zb-h2."""
    out: dict[int | str, dict] = {}
    for zero in (0, 1, 2, 3):
        pipe = pipetrain.Pipeline(
            tied_model(), [3, 3], chunks=2, replicas=2, zero=zero,
            loss_fn=nn.functional.cross_entropy, optimizer=adamw, lr_scheduler=decay,
            clip_grad_norm=CLIP, timeout=60,
        )
        norms = []
        for step in token_batches(STEPS):
            _steps(pipe, [step])
            norms.append(pipe.metrics["grad_norm"])
        state = pipe.module.state_dict()
        tied = state.get("0.weight", state.get("5.weight"))
        out[zero] = {"state": _whole(state), "norms": norms,
                     "tied whole": not isinstance(tied, DTensor),
                     "sharded": any(isinstance(v, DTensor) for v in state.values())}
    variants = {  # built on the meta device, each rank making its stage (init_seed); and
        # interleaved: the embedding on stage 0 (rank 0), the head on stage 3 (rank 1)
        "meta": ([3, 3], dict(init_seed=3)),
        "interleaved": ([1, 2, 2, 1], dict(schedule="interleaved", chunks=4)),
        "zero bubble": ([3, 3], dict(schedule="zb-h2")),  # the tie's all-reduce, W, FSDP2
    }
    for name, (balance, options) in variants.items():
        for zero in (0, 3):
            with torch.device("meta") if name == "meta" else contextlib.nullcontext():
                model = tied_model()
            pipe = pipetrain.Pipeline(
                model, balance, **{"chunks": 2, **options}, replicas=2, zero=zero,
                loss_fn=nn.functional.cross_entropy, optimizer=adamw, lr_scheduler=decay,
                clip_grad_norm=CLIP, timeout=60,
            )
            _steps(pipe, token_batches(STEPS))
            out[f"{name} {zero}"] = _whole(pipe.module.state_dict())
    return out


def test_a_weight_tied_across_stages_trains_at_zero_1_2_3_as_at_zero_0_and_one_process():
    """The embedding (stage 0) and the head (stage 1) share a weight: at zero 2 and 3 each
    copy stays whole on its replicas, its gradient summed over both stages' ranks of both
    replicas, while the rest of each stage is sharded; both copies equal zero 0's (1e-6) and
    single-process training's (1e-5). Built on the meta device, under interleaved stages and
    under zb-h2, zero 3 equals zero 0 too."""
    expected = single_process(tied_model(), token_batches(STEPS))
    results = values(run_ranks(_tied, 4, deadline=400))
    for got in results:
        assert min(got[0]["norms"]) > CLIP
        assert "0.weight" in got[0]["state"] or "5.weight" in got[0]["state"]
        for zero in (1, 2, 3):
            assert got[zero]["norms"] == pytest.approx(got[0]["norms"], rel=1e-6)
            for key, value in got[zero]["state"].items():  # each stage's copy of the tie too
                assert (value - got[0]["state"][key]).abs().max().item() <= AGAINST_ZERO, key
                assert (value - expected[key]).abs().max().item() <= AGAINST_ONE_PROCESS, key
        for zero in (2, 3):
            assert got[zero]["tied whole"] and got[zero]["sharded"]
        for name in ("meta", "interleaved", "zero bubble"):
            for key, value in got[f"{name} 3"].items():
                assert (value - got[f"{name} 0"][key]).abs().max().item() <= AGAINST_ZERO, key
        for key, value in got["interleaved 0"].items():  # another split, the same training
            assert (value - expected[key]).abs().max().item() <= AGAINST_ONE_PROCESS, key
    stage_0 = [got for got in results if "0.weight" in got[0]["state"]]
    stage_1 = [got for got in results if "5.weight" in got[0]["state"]]
    for a, b in zip(stage_0, stage_1, strict=True):  # the two copies are one weight
        assert torch.equal(a[3]["state"]["0.weight"], b[3]["state"]["5.weight"])


def test_what_zero_cannot_shard_yet_is_refused_with_the_reason():
    for (graphs,) in values(run_ranks(_refusals, 4, deadline=300)):
        assert "zero=2 with cuda_graphs is not supported" in graphs
        assert "zero=1" in graphs
    for bad in (4, -1, True, "3"):
        with pytest.raises(ValueError, match="zero must be 0"):
            pipetrain.Pipeline(mlp(), [5, 7], devices=["cpu", "cpu"], zero=bad)


def _ledger_peaks(rank: int, world: int) -> dict[int, list[int]]:
    peaks = {}
    for zero in (0, 1, 2, 3):
        pipe = pipetrain.Pipeline(
            tiny_gpt(), [len(tiny_gpt())], chunks=2, replicas=2, zero=zero, loss_fn=_lm_loss,
            optimizer=adamw, track_memory=True,
        )
        x, y = text_batches(1)[0]
        pipe.train_step(x, y)
        peaks[zero] = [stage.ledger.peak_bytes for stage in pipe.stages]
    return peaks


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def test_track_memory_counts_the_same_activations_at_every_zero_level():
    """Sharding moves weights, not activations: the ledger (``track_memory``) sees the same
    saved bytes at zero 0-3. At 2 and 3 it raised on FSDP2's sharded weights, and the
    gathered weights the forward saves are weights, not activations."""
    for peaks in values(run_ranks(_ledger_peaks, 2, deadline=300)):
        assert peaks[0][0] > 0
        assert peaks[1] == peaks[2] == peaks[3] == peaks[0]


def test_without_replicas_zero_changes_nothing():
    """One process, two stages: no replica to shard over; the parameters are zero=0's."""
    states = []
    for zero in (0, 3):
        pipe = pipetrain.Pipeline(
            mlp(), [5, 7], devices=["cpu", "cpu"], chunks=2, zero=zero,
            loss_fn=nn.functional.cross_entropy, optimizer=adamw, clip_grad_norm=CLIP,
        )
        _steps(pipe, batches(STEPS))
        states.append(pipe.module.state_dict())
    for key, value in states[1].items():
        assert not isinstance(value, DTensor) and torch.equal(value, states[0][key]), key


def test_fsdp2_state_missing_from_another_torch_is_an_error_naming_the_version():
    """A split backward at zero 2 and 3 reads FSDP2 state that torch keeps private: where a
    torch lacks it, the error says which part, which torch, and what runs instead."""
    with pytest.raises(RuntimeError, match=re.escape(f"torch {torch.__version__} lacks")):
        private(object(), "_fsdp_param_groups")
