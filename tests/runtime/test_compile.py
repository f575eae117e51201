"""``compile=True`` (pipetrain/runtime/compiled.py): every layer of a compiled stage runs
compiled code, and the pipeline trains as the uncompiled one and as one process, under 1F1B,
GPipe, zero bubble (zb-h1, zbv: a compiled stage backpropagates whole in B, its W finds the
weight gradients made), recomputation, 2 gloo processes and ZeRO 2 and 3 over 2 replicas.

Tolerance (fp32): test_distributed.py's TOLERANCE, 1e-5, on parameters and losses. Inductor
fuses a layer's operations and orders their float sums its own way (LayerNorm's mean and
variance, softmax, the reductions of a matmul's fused epilogue), so compiled results differ from
eager ones in the last bits (measured here: at most 1.4e-8 on parameters after 3 steps, 2.4e-7
on a loss of 3.5); 1e-5 is the bound every runtime equality test holds. Compiled dropout draws
its own masks (inductor's random numbers), so with dropout a compiled run is compared with
itself: recomputed against kept, zero bubble against 1F1B, where the draws must replay exactly.

Compiling on 2 shared cores takes seconds per kind of layer: the models are tiny and the tests
that compile more than one model are marked slow.
"""

from __future__ import annotations

from dataclasses import make_dataclass

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

import pipetrain
from examples.models import lm_loss
from pipetrain.runtime.compiled import inductor_refusal
from pipetrain.runtime.stage import Stage
from pipetrain.tools.cli import build_parser
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import batches, mlp, reference, sgd, text_batches, tiny_gpt
from tests.runtime.test_distributed import TOLERANCE

REFUSAL = inductor_refusal(torch.device("cpu"))
needs_inductor = pytest.mark.skipif(REFUSAL is not None, reason=f"inductor cannot run: {REFUSAL}")
STEPS, CHUNKS = 3, 4
CASES = {  # model, data, loss
    "mlp": (mlp, batches, nn.functional.cross_entropy),
    "gpt": (tiny_gpt, text_batches, lm_loss),  # embedding, attention, head tied to it
}
SCHEDULES = {  # (schedule, recompute): each model's balance
    ("1f1b", "never"): {"mlp": [4, 8], "gpt": [2, 3]},
    ("gpipe", "except_last"): {"mlp": [4, 8], "gpt": [2, 3]},
    ("zb-h1", "never"): {"mlp": [4, 8], "gpt": [2, 3]},
    ("zbv", "never"): {"mlp": [3, 3, 3, 3], "gpt": [1, 1, 2, 1]},  # 4 stages on 2 ranks
    ("1f1b", "always"): {"mlp": [4, 8], "gpt": [2, 3]},
}


class Probe(nn.Linear):
    """A Linear that counts the calls it runs eagerly: torch.compile traces the count's branch
    out (``is_compiling()`` is True while it traces, and nothing else of the module's state is
    read, so no guard on it makes dynamo recompile or fall back), so a compiled layer counts
    none."""

    def __init__(self, width: int):
        super().__init__(width, width)
        self.eager_calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling():
            self.eager_calls += 1
        return super().forward(x)


def _probed() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Probe(12), nn.Tanh(), Probe(12), nn.Linear(12, 5))


def _train(model: nn.Sequential, balance: list[int], data, loss_fn, **options) -> dict:
    """Train in threads, one per rank: the state, the losses and the pipeline."""
    ranks = 2
    pipe = pipetrain.Pipeline(
        model, balance, chunks=CHUNKS, devices=["cpu"] * ranks, loss_fn=loss_fn, optimizer=sgd,
        timeout=600, **options,
    )
    losses = [float(pipe.train_step(x, y)) for x, y in data]
    return {"state": pipe.module.state_dict(), "losses": losses, "pipe": pipe}


def _assert_close(got: dict, expected_state: dict, expected_losses: list[float]) -> None:
    assert got["state"].keys() == expected_state.keys()  # compiling renames no parameter
    for key, value in got["state"].items():
        diff = (value - expected_state[key]).abs().max().item()
        assert diff <= TOLERANCE, f"{key} differs by {diff}"
    assert got["losses"] == pytest.approx(expected_losses, abs=TOLERANCE)


@needs_inductor
def test_a_compiled_stage_runs_compiled_code_and_trains_as_one_process(one_thread):
    """compile=[True, False]: stage 0's layers run compiled, stage 1's eagerly, and the
    parameters and losses are plain training's."""
    model, data = _probed(), batches(STEPS)
    got = _train(model, [2, 2], data, nn.functional.cross_entropy, compile=[True, False])
    _assert_close(got, *reference(_probed(), data))
    assert model[0].eager_calls == 0  # stage 0: compiled
    assert model[2].eager_calls == STEPS * CHUNKS  # stage 1: eager, each micro-batch
    assert [bool(s.module.calls) for s in got["pipe"].stages] == [True, False]


@needs_inductor
def test_under_zero_bubble_a_compiled_stage_leaves_its_w_nothing_to_do(monkeypatch, one_thread):
    """zb-h1: an eager stage's B leaves the weight gradients to its W; a compiled one's B
    makes them (its layers' backward is one compiled call), so no W has work; both train
    as one process."""
    pending: dict[bool, list[bool]] = {True: [], False: []}
    backward = Stage.backward

    def noted(stage, microbatch, grads, loss_scale=1.0):
        found = backward(stage, microbatch, grads, loss_scale)
        pending[bool(stage.module.calls)].append(stage.weights_pending(microbatch))
        return found

    monkeypatch.setattr(Stage, "backward", noted)
    data = batches(STEPS)
    got = _train(_probed(), [2, 2], data, nn.functional.cross_entropy, schedule="zb-h1",
                 compile=[True, False])
    _assert_close(got, *reference(_probed(), data))
    assert pending[True] and not any(pending[True])  # compiled: whole in B
    assert pending[False] and all(pending[False])  # eager: W pending after each B


def test_what_compile_cannot_run_with_is_refused_with_the_fix(monkeypatch):
    """A value that is no bool, a list of the wrong length, CUDA graphs beside it, and a
    machine where inductor has no C++ compiler: refused at construction, naming the fix."""

    def build(**options) -> pipetrain.Pipeline:
        return pipetrain.Pipeline(mlp(), [4, 8], devices=["cpu", "cpu"], **options)

    with pytest.raises(TypeError, match="compile must be True, False or a list of one bool"):
        build(compile="yes")
    with pytest.raises(ValueError, match="compile lists 3 values for 2 stages"):
        build(compile=[True, False, True])
    with pytest.raises(ValueError, match="pass one of cuda_graphs= and compile="):
        build(compile=True, cuda_graphs="auto")

    def no_compiler() -> str:
        raise RuntimeError("no working C++ compiler found")

    monkeypatch.setattr("torch._inductor.cpp_builder.get_cpp_compiler", no_compiler)
    with pytest.raises(ValueError, match=r"stage 1: compile=True on cpu needs a C\+\+ compiler "
                                         r"for inductor's CPU backend.*install g\+\+"):
        build(compile=[False, True])
    build(compile=False)  # nothing to compile: no compiler needed


def test_pipetrain_train_compile_reaches_the_pipeline(monkeypatch):
    """``pipetrain train --compile`` is Run(compile=True), which sets Pipeline(compile=True)
    over the task's own options."""
    from pipetrain.tools import task as task_module

    args = build_parser().parse_args(["train", "m:f", "--plan", "p.json", "--steps", "1",
                                      "--compile"])
    assert args.compile and not build_parser().parse_args(
        ["train", "m:f", "--plan", "p.json", "--steps", "1"]).compile
    given: dict = {}

    class Stop(Exception):
        pass

    def pipeline(model, **options):
        given.update(options)
        raise Stop

    monkeypatch.setattr(task_module, "Pipeline", pipeline)
    train_task = pipetrain.TrainTask(mlp(), nn.functional.cross_entropy, sgd,
                                     lambda step: batches(1)[0], {"compile": False})
    plan = make_dataclass("Plan", [("pipeline_ranks", int), ("data_parallel", int)])(2, 1)
    with pytest.raises(Stop):
        task_module.train(train_task, plan, task_module.Run(1, compile=True), 2, 0)
    assert given["compile"] is True


@needs_inductor
@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize(("schedule", "recompute"), list(SCHEDULES))
def test_compiled_training_equals_uncompiled_and_one_process(one_thread, name, schedule,
                                                             recompute):
    build, batch, loss_fn = CASES[name]
    data, balance = batch(STEPS), SCHEDULES[schedule, recompute][name]
    options = {"schedule": schedule, "recompute": recompute}
    eager = _train(build(), balance, data, loss_fn, **options)
    compiled = _train(build(), balance, data, loss_fn, compile=True, **options)
    _assert_close(compiled, eager["state"], eager["losses"])
    _assert_close(compiled, *reference(build(), data, loss_fn=loss_fn))


@needs_inductor
@pytest.mark.slow
def test_compiled_dropout_replays_under_recomputation_and_zero_bubble(one_thread):
    """Seeded dropout (p=0.2): the compiled run that recomputes every forward, and the one
    under zb-h1, draw the masks of the compiled 1F1B run that keeps its activations."""
    data = text_batches(STEPS)

    def run(**options) -> dict:
        torch.manual_seed(5)  # each stage's random stream
        return _train(tiny_gpt(dropout=0.2), [2, 3], data, lm_loss, compile=True, **options)

    kept = run()
    for other in (run(recompute="always"), run(schedule="zb-h1")):
        _assert_close(other, kept["state"], kept["losses"])
    torch.manual_seed(5)
    eager = _train(tiny_gpt(dropout=0.2), [2, 3], data, lm_loss)  # the check can fail:
    assert eager["losses"] != pytest.approx(kept["losses"], abs=TOLERANCE)  # other masks


def _in_processes(rank: int, world: int, schedule: str) -> dict:
    model, data = tiny_gpt(), text_batches(STEPS)
    pipe = pipetrain.Pipeline(model, [2, 3], chunks=CHUNKS, schedule=schedule, loss_fn=lm_loss,
                              optimizer=sgd, compile=True, timeout=600)
    losses = [float(pipe.train_step(x, y)) for x, y in data]
    return {"state": pipe.module.state_dict(), "losses": losses}


@needs_inductor
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_compiled_stages_in_two_gloo_processes_train_as_one_process(schedule):
    expected = reference(tiny_gpt(), text_batches(STEPS), loss_fn=lm_loss)
    ranks = values(run_ranks(_in_processes, 2, schedule, deadline=600))
    whole = {"state": {k: v for r in ranks for k, v in r["state"].items()},
             "losses": ranks[0]["losses"]}
    _assert_close(whole, *expected)


def _sharded(rank: int, world: int, zero: int, schedule: str) -> dict:
    """One stage, 2 replicas sharding it (FSDP2 at zero 2 and 3), each layer compiled."""
    pipe = pipetrain.Pipeline(mlp(), [12], chunks=2, schedule=schedule, replicas=world,
                              zero=zero, loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                              compile=True, timeout=600)
    losses = []
    for x, y in batches(STEPS):
        mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        losses.append(float(pipe.train_step(x[mine], y[mine])))
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v
             for k, v in pipe.module.state_dict().items()}
    return {"state": state, "losses": losses}


@needs_inductor
@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
@pytest.mark.parametrize("zero", [2, 3])
def test_compiled_layers_sharded_by_fsdp2_train_as_one_process(zero, schedule):
    """As torchtitan: FSDP2 shards each layer, torch.compile compiles each; the replicas'
    mean loss is plain training's on the whole batch."""
    state, losses = reference(mlp(), batches(STEPS))
    ranks = values(run_ranks(_sharded, 2, zero, schedule, deadline=600))
    mean = [sum(step) / len(ranks) for step in zip(*(r["losses"] for r in ranks), strict=True)]
    for rank in ranks:
        _assert_close({"state": rank["state"], "losses": mean}, state, losses)
