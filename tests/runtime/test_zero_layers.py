"""ZeRO 2 and 3 on the layers that tripped FSDP2 (issue 46), 2 stages x 2 replicas on 4 gloo
processes, each against zero=0 and against single-process training of the whole mini-batch:

* dotted layer names (a ``keyed`` model; pipetrain.hf's Llama) under zero bubble, whose W looks
  up each gathered weight (it resolved the name as a path of attributes);
* a frozen layer and a frozen parameter (a gradient hook on a weight that takes none), and a
  stage holding only a frozen layer and a head tied to the previous stage's embedding (nothing
  of it sharded but the frozen weight, which the backward found freed);
* an embedding and its tied head on one stage (FSDP2 wants one unit for a weight two modules
  hold: the two layers are sharded together);
* at zero 3, a Linear on (batch, sequence, width) and an in-place ReLU of its output on one
  stage (FSDP2's own warning says an in-place op on a sharded module's output may fail or give
  wrong gradients).

AdamW, 3 steps. Tolerances as tests/runtime/test_zero.py's: 1e-6 against zero=0 (the same sums
in another order), 1e-5 against one process (replicas and micro-batches reorder the sums).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.layer_tree import LayerTree
from tests.runtime.harness import run_ranks, values
from tests.runtime.test_zero import _whole, adamw

STEPS = 3
ROWS = 8
AGAINST_ZERO = 1e-6
AGAINST_ONE_PROCESS = 1e-5


def tokens_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def keyed_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return LayerTree([
        ("encoder.in", nn.Linear(6, 8)), ("encoder.act", nn.Tanh()),
        ("decoder.layers.0", nn.Linear(8, 8)), ("decoder.out", nn.Linear(8, 4)),
    ])


def frozen_mlp() -> nn.Sequential:
    """A frozen first layer and, on the next stage, a layer whose weight alone is frozen."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))
    model[0].requires_grad_(False)
    model[2].weight.requires_grad_(False)
    return model


def tied_on_one_stage() -> nn.Sequential:
    """Embedding and tied head both on stage 0, then a layer of its own on stage 1."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(11, 6), nn.Linear(6, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(6, 6), nn.Tanh(), head, nn.Linear(11, 11))


def inplace_after_linear() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(11, 4), nn.Linear(4, 4), nn.ReLU(inplace=True),
                         nn.Linear(4, 11))


def frozen_before_tied_head() -> nn.Sequential:
    """Found by tests/property's ZeRO sample: stage 1 is a frozen Linear and the tied head."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(11, 6), nn.Linear(6, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(6, 6).requires_grad_(False), head)


def vectors() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(ROWS, 6, generator=g), torch.randn(ROWS, 4, generator=g))
            for _ in range(STEPS)]


def token_steps() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 11, (ROWS, 5), generator=g),
             torch.randint(0, 11, (ROWS, 5), generator=g)) for _ in range(STEPS)]


def llama() -> nn.Sequential:
    import pipetrain.hf
    from tests.hf.models import model

    return pipetrain.hf.sequential(model("llama"))


def llama_steps() -> list:
    from tests.hf.models import batch

    return [((ids, mask), labels) for ids, mask, labels in
            (batch(rows=ROWS, length=8, seed=step) for step in range(STEPS))]


def _hf_loss(output, target):
    import pipetrain.hf

    return pipetrain.hf.causal_lm_loss(output, target)


# name -> (model, balance, data, loss, [(schedule, zero), ...])
CASES: dict[str, tuple[Callable[[], nn.Sequential], list[int], Callable[[], list], Callable,
                       list[tuple[str, int]]]] = {
    "keyed": (keyed_mlp, [2, 2], vectors, nn.functional.mse_loss,
              [("zb-h1", 3), ("zb-h2", 2), ("1f1b", 3)]),
    "frozen": (frozen_mlp, [2, 2], vectors, nn.functional.mse_loss,
               [("1f1b", 2), ("1f1b", 3), ("zb-h1", 3)]),
    "tied": (tied_on_one_stage, [4, 1], token_steps, tokens_loss,
             [("1f1b", 2), ("1f1b", 3), ("zb-h2", 3)]),
    "frozen-tied": (frozen_before_tied_head, [1, 2], token_steps, tokens_loss,
                    [("1f1b", 2), ("1f1b", 3), ("zb-h1", 3)]),
    "inplace": (inplace_after_linear, [1, 3], token_steps, tokens_loss,
                [("1f1b", 3), ("zb-h1", 3), ("gpipe", 3)]),
    "llama": (llama, [2, 3], llama_steps, _hf_loss, [("zb-h1", 3), ("zb-h1", 2)]),
}


def _train(rank: int, world: int, names: list[str]) -> dict[str, dict]:
    """Per case and (schedule, zero), and at zero 0: this rank's whole parameters."""
    out: dict[str, dict] = {}
    for name in names:
        build, balance, data, loss, runs = CASES[name]
        for schedule, zero in [(runs[0][0], 0), *runs]:
            pipe = pipetrain.Pipeline(
                build(), balance, chunks=2, schedule=schedule, replicas=2, zero=zero,
                loss_fn=loss, optimizer=adamw, timeout=60,
            )
            share = slice(pipe.placement.replica * ROWS // 2,
                          (pipe.placement.replica + 1) * ROWS // 2)
            for x, y in data():
                x = tuple(t[share] for t in x) if isinstance(x, tuple) else x[share]
                pipe.train_step(x, y[share])
            out[f"{name} {schedule} {zero}"] = _whole(pipe.module.state_dict())
    return out


def one_process(name: str) -> dict[str, torch.Tensor]:
    """The same steps on the whole mini-batch in one process (the model's own forward)."""
    build, _, data, loss, _ = CASES[name]
    model = build()
    optimizer = adamw(model.parameters())
    for x, y in data():
        optimizer.zero_grad()
        loss(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def trained() -> dict[str, list[dict]]:
    plain = ["keyed", "frozen", "frozen-tied", "tied", "inplace"]
    try:
        import tests.hf.models  # noqa: F401
        names = [*plain, "llama"]
    except pytest.skip.Exception:
        names = plain
    return {"runs": values(run_ranks(_train, 4, names, deadline=300))}


def _check(trained: dict, name: str, against_one_process: bool = True) -> None:
    runs = trained["runs"]
    if not any(key.startswith(name + " ") for key in runs[0]):
        pytest.skip("transformers is not installed (pip install -e '.[hf]')")
    expected = one_process(name) if against_one_process else None
    _, _, _, _, levels = CASES[name]
    compared = 0
    for got in runs:
        baseline = got[f"{name} {levels[0][0]} 0"]
        for schedule, zero in levels:
            state = got[f"{name} {schedule} {zero}"]
            assert state.keys() == baseline.keys()
            for key, value in state.items():
                assert (value - baseline[key]).abs().max().item() <= AGAINST_ZERO, (
                    f"{schedule} zero={zero}: {key}")
                if expected is not None:
                    assert (value - expected[key]).abs().max().item() <= AGAINST_ONE_PROCESS, (
                        f"{schedule} zero={zero} against one process: {key}")
                compared += 1
    assert compared


def test_dotted_layer_names_train_at_zero_2_and_3_under_zero_bubble(trained):
    _check(trained, "keyed")


def test_a_frozen_layer_and_a_frozen_parameter_train_at_zero_2_and_3(trained):
    _check(trained, "frozen")
    for got in trained["runs"]:  # the frozen ones did not move
        state, start = got["frozen 1f1b 3"], frozen_mlp().state_dict()
        for key in ("0.weight", "0.bias", "2.weight"):
            if key in state:
                assert torch.equal(state[key], start[key]), key


def test_a_stage_of_a_frozen_layer_and_a_head_tied_across_stages_trains_at_zero_2_and_3(trained):
    _check(trained, "frozen-tied")


def test_an_embedding_and_its_tied_head_on_one_stage_train_at_zero_2_and_3(trained):
    _check(trained, "tied")
    for got in trained["runs"]:
        state = got["tied 1f1b 3"]
        if "0.weight" in state:
            assert torch.equal(state["0.weight"], state["3.weight"])


def test_an_in_place_activation_of_a_sharded_linear_output_trains_at_zero_3(trained):
    _check(trained, "inplace")


def test_a_hugging_face_llama_trains_under_zero_bubble_at_zero_2_and_3(trained):
    _check(trained, "llama", against_one_process=False)  # zero=0's llama: tests/hf
