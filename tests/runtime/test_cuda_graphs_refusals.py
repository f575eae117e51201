"""What ``Pipeline(cuda_graphs=...)`` refuses, checked on the CPU (the graphs themselves are
tested on a GPU in tests/gpu/test_cuda_graphs.py): each refusal names its reason and the fix,
``"auto"`` trains eagerly instead, and a failed capture is reported as such."""

from __future__ import annotations

import gc
from contextlib import nullcontext

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.errors import StageError
from pipetrain.runtime.config import PipelineConfig
from pipetrain.runtime.cuda_graphs import MAX_SIGNATURES, StageGraphs, slots_needed, stage_refusal
from pipetrain.runtime.rng import StageRng
from pipetrain.runtime.stage import Stage, StageOptions
from schedules import build
from tests.runtime.models import batches, mlp, sgd


def _pipe(**options) -> pipetrain.Pipeline:
    options.setdefault("devices", ["cpu", "cpu"])
    return pipetrain.Pipeline(
        mlp(), [4, 8], chunks=4, loss_fn=nn.functional.cross_entropy, optimizer=sgd, **options
    )


def test_cpu_stages_are_refused_at_construction():
    with pytest.raises(ValueError, match="cuda_graphs=True needs CUDA devices; stage 0 is on cpu"):
        _pipe(cuda_graphs=True)


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"schedule": "pipedream"}, "asynchronous"),
        ({"schedule": "zb-h1"}, "splits the backward"),
        ({"recompute": "always"}, "recomputes forwards inside the backward"),
        ({"recompute": "except_last", "schedule": "gpipe"}, "recompute='never'"),
        ({"track_memory": True}, "track_memory"),
        ({"deferred_batch_norm": True}, "deferred_batch_norm"),
    ],
)
def test_what_cannot_be_captured_is_refused_with_the_reason(options, reason):
    with pytest.raises(ValueError, match=reason) as refused:
        _pipe(cuda_graphs=True, **options)
    assert "cuda_graphs='auto'" in str(refused.value)  # and the fix


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="cuda_graphs must be False, True or 'auto'"):
        _pipe(cuda_graphs="yes")


def test_hooks_are_refused():
    module = nn.Sequential(nn.Linear(2, 2))
    module[0].register_forward_hook(lambda *args: None)
    reason = stage_refusal(0, torch.device("cuda:0"), module)
    assert reason is not None and "hooks" in reason


def test_graphs_keep_activations_by_default():
    resolved = PipelineConfig.resolve(mlp(), [4, 8], schedule="gpipe", cuda_graphs="auto")
    assert resolved.recompute == "never"
    assert PipelineConfig.resolve(mlp(), [4, 8], schedule="gpipe").recompute == "except_last"


def test_auto_on_cpu_trains_eagerly_as_without():
    results = []
    for graphs in ("auto", False):
        torch.manual_seed(0)
        pipe = _pipe(cuda_graphs=graphs, schedule="1f1b")
        for x, y in batches(2):
            pipe.train_step(x, y)
        assert all(stage.graphs is None for stage in pipe.stages)
        results.append(pipe.module.state_dict())
    for key, value in results[0].items():
        assert torch.equal(value, results[1][key]), key


@pytest.mark.parametrize(
    ("schedule", "expected"), [("gpipe", [4, 4]), ("1f1b", [2, 1]), ("interleaved", [4, 3, 2, 1])]
)
def test_slots_cover_the_micro_batches_in_flight(schedule, expected):
    stages = len(expected)
    built = build(schedule, stages, 4, ranks=2 if schedule == "interleaved" else stages)
    assert [slots_needed(built, s) for s in range(stages)] == expected


def _graphs(strict: bool, slots: int = 1) -> StageGraphs:
    module = nn.Sequential(nn.Linear(3, 3))
    return StageGraphs(
        0, torch.device("cpu"), module, lambda value, target: module(value),
        StageRng(0, torch.device("cpu")), slots=slots, strict=strict,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a capture that fails without CUDA")
def test_a_failed_capture_names_the_stage_and_the_fix():
    strict, auto = _graphs(True), _graphs(False)
    for graphs in (strict, auto):
        out = graphs.forward(0, torch.randn(2, 3), None)  # eager: its shape is noted
        assert out.shape == (2, 3) and graphs.captured == 0
    with pytest.raises(StageError, match="stage 0: capturing its CUDA graph failed") as failed:
        strict.capture_pending()
    assert "cuda_graphs='auto'" in str(failed.value)
    auto.capture_pending()  # "auto": eager from now on
    assert auto.eager_only and auto.captured == 0


def test_too_many_shapes_are_refused_under_true():
    graphs = _graphs(True)
    for width in range(1, MAX_SIGNATURES + 1):
        graphs.forward(0, torch.randn(width, 3), None)
    with pytest.raises(ValueError, match="pad the inputs to a few fixed shapes"):
        graphs.forward(0, torch.randn(MAX_SIGNATURES + 1, 3), None)


def test_each_slot_captures_on_inputs_of_its_own(monkeypatch):
    """Regression (GPipe on a GPU trained to other parameters than eager): every slot was
    captured with the same sample tensors as make_graphed_callables' static inputs, into which
    each replay copies its micro-batch and which the backward graph reads (a Linear's input, the
    loss's target), so all but the last micro-batch in flight backpropagated another one's
    inputs. Checked on the CPU by recording what each capture is given (torch's own capture
    needs CUDA; tests/gpu/test_cuda_graphs.py checks the trained parameters); also that the
    garbage collector is held during captures and running again after."""
    captures = []

    def record(capturable, sample, **options):
        captures.append((sample, options.get("pool"), gc.isenabled()))
        return capturable

    monkeypatch.setattr(torch.cuda, "make_graphed_callables", record)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: (0, len(captures)))
    monkeypatch.setattr(torch.cuda, "device", lambda device: nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs = _graphs(True, slots=3)
    x = torch.randn(2, 3)
    graphs.forward(0, x, None)  # eager: its shape is noted
    graphs.capture_pending()
    assert graphs.captured == 1 and len(captures) == 3
    inputs = [sample[0] for sample, _, _ in captures]
    assert len({t.data_ptr() for t in inputs}) == 3, "slots share their static inputs"
    assert all(torch.equal(t, x) for t in inputs)
    assert len({pool for _, pool, _ in captures}) == 3, "each slot has a memory pool of its own"
    assert not any(collecting for _, _, collecting in captures) and gc.isenabled()


def test_a_stage_built_to_recompute_refuses_graphs():
    """Pipeline refuses cuda_graphs with recomputation (above); a Stage built directly to
    recompute refuses them too, rather than replay a forward its backward would run again."""
    stage = Stage(mlp(), 0, 1, 0, torch.device("cpu"), sgd, nn.functional.cross_entropy,
                  options=StageOptions(recompute_below=2))
    with pytest.raises(ValueError, match="stage 0: CUDA graphs cannot replay a recomputed"):
        stage.use_graphs(2, strict=True)
    assert stage.graphs is None and stage.recompute_below == 2
