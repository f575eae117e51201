"""A layer's name is a name, not a path: a model whose layers are keyed with dots
(pipetrain.hf's "model.layers.0", a ``keyed`` model) trains under every schedule exactly as the
same layers under positional names ("0", "1", ...) do.

torch resolves a dotted parameter name as a path of attributes (``functional_call``,
``get_parameter``), so every place the runtime swaps or looks up a weight by name tripped on
such keys: the asynchronous schedules' weight versions (pipedream, pipedream-2bw) failed at the
first forward. Each case here trains the two namings side by side (threads of one process, 2
ranks, 3 steps) and wants bit-identical parameters: the same layers run the same arithmetic in
the same order, so any difference is the naming's. ZeRO 2/3 with dotted names is in
test_zero_layers.py (it needs replicas: gloo processes).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.layer_tree import LayerTree
from schedules.registry import lookup, names

STEPS = 3
ASYNCHRONOUS = {  # the weight-version kinds, each its own path through the runtime
    "stash": dict(weight_prediction=None, delay_compensation=None),
    "stale": dict(weight_prediction=None, delay_compensation=None, weight_stashing=False),
    "predict": dict(weight_prediction="momentum", delay_compensation=None),
}


def keyed_mlp(seed: int = 0) -> LayerTree:
    """Five layers under dotted, nested-looking names."""
    torch.manual_seed(seed)
    return LayerTree([
        ("encoder.in", nn.Linear(6, 8)), ("encoder.act", nn.Tanh()),
        ("decoder.layers.0", nn.Linear(8, 8)), ("decoder.layers.1", nn.Linear(8, 8)),
        ("decoder.out", nn.Linear(8, 4)),
    ])


def mlp_data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g))
            for _ in range(STEPS)]


def llama(seed: int = 0) -> nn.Sequential:
    hf_models = pytest.importorskip(
        "tests.hf.models", reason="transformers is not installed (pip install -e '.[hf]')"
    )
    import pipetrain.hf

    return pipetrain.hf.sequential(hf_models.model("llama", seed=seed))


def llama_data() -> list[tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]]:
    from tests.hf.models import batch

    steps = [batch(rows=4, length=8, seed=step) for step in range(STEPS)]
    return [((ids, mask), labels) for ids, mask, labels in steps]


def positional(model: LayerTree) -> LayerTree:
    """The same layers (these objects) and their glue under positions as names."""
    by_position = {name: str(i) for i, name in enumerate(model.names)}
    return LayerTree(((by_position[n], layer) for n, layer in model.positions()),
                     {by_position[n]: glue for n, glue in model.glue.items()})


def train(model: nn.Sequential, schedule: str, data: list, loss_fn: Callable,
          **options: object) -> list[torch.Tensor]:
    """The parameters, in layer order, after the steps on 2 ranks (threads)."""
    stages = 2 * (lookup(schedule).stages_per_rank or (2 if lookup(schedule).multi_stage_per_rank
                                                        else 1))
    layers = len(model)
    balance = [layers // stages + (s < layers % stages) for s in range(stages)]
    pipe = pipetrain.Pipeline(
        model, balance, chunks=4 if stages > 2 else 2, schedule=schedule, loss_fn=loss_fn,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        devices=["cpu", "cpu"], **options,
    )
    for x, y in data:
        pipe.train_step(x, y)
    return [p.detach().clone() for layer in model for p in layer.parameters()]


def assert_identical(dotted: list[torch.Tensor], plain: list[torch.Tensor]) -> None:
    assert dotted and len(dotted) == len(plain)
    for i, (a, b) in enumerate(zip(dotted, plain, strict=True)):
        assert torch.equal(a, b), f"parameter {i} differs by {(a - b).abs().max().item()}"


def _options(schedule: str) -> list[tuple[str, dict]]:
    if lookup(schedule).asynchronous:
        return [(f"{schedule}-{kind}", options) for kind, options in ASYNCHRONOUS.items()]
    return [(schedule, {})]


CASES = [pytest.param(schedule, options, id=name)
         for schedule in names() for name, options in _options(schedule)]


def assert_names_change_nothing(build: Callable[[], nn.Sequential], data: list,
                                loss_fn: Callable, schedule: str, options: dict) -> None:
    """``build()``'s model trained as built and with its layers named by position."""
    dotted = train(build(), schedule, data, loss_fn, **options)
    plain = train(positional(build()), schedule, data, loss_fn, **options)
    assert_identical(dotted, plain)


@pytest.mark.parametrize(("schedule", "options"), CASES)
def test_a_keyed_mlp_trains_as_the_same_layers_named_by_position(schedule, options):
    assert_names_change_nothing(keyed_mlp, mlp_data(), nn.functional.mse_loss, schedule,
                                options)


@pytest.mark.parametrize(("schedule", "options"), CASES)
def test_a_hugging_face_llama_trains_as_the_same_layers_named_by_position(schedule, options):
    import pipetrain.hf

    assert_names_change_nothing(llama, llama_data(), pipetrain.hf.causal_lm_loss, schedule,
                                options)


def test_the_asynchronous_schedules_move_a_keyed_model():
    """The comparison above is not of two runs that both stood still."""
    before = [p.detach().clone() for p in keyed_mlp().parameters()]
    after = train(keyed_mlp(), "pipedream", mlp_data(), nn.functional.mse_loss,
                  **ASYNCHRONOUS["stash"])
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
