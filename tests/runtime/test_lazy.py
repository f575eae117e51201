"""Models built on the meta device, across real gloo processes: each rank materializes only its
own layers, initialized by the per-layer rule, or reads them from a whole-model file.

The reference is the same model built eagerly (examples.models.gpt, which initializes by the
same rule through pipetrain.init_layers) and trained in one process on the same mini-batches.
Tolerance 1e-6 (fp32): the initial weights must be bit-identical (the rule does not depend on
the split); after 3 SGD steps only the summation order of the micro-batches' gradients differs
(about 1e-7); a layer initialized from the wrong seed, or a tied head not equal to the
embedding, is off by 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import pipetrain
import pipetrain.tools.cli
from examples.models import gpt, lm_loss
from pipetrain.checkpoints import weightfile
from tests.runtime.harness import run_ranks, values
from tests.runtime.models import text_batches

SHAPE = dict(vocab=32, dim=16, blocks=6, heads=2, context=8)  # 8 layers: embedding, 6, head
STEPS, TOLERANCE = 3, 1e-6


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(seed: int = 0) -> tuple[dict, dict]:
    """The eager model's initial and trained state, in one process."""
    model = gpt(**SHAPE, seed=seed)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = sgd(model.parameters())
    for x, y in text_batches(STEPS):
        optimizer.zero_grad()
        lm_loss(model(x), y).backward()
        optimizer.step()
    return initial, model.state_dict()


def _train_meta(rank: int, world: int, balance: list[int], schedule: str,
                weights: str | None, folder: str | None) -> tuple[dict, dict]:
    model = gpt(**SHAPE, seed=0, device="meta")
    pipe = pipetrain.Pipeline(
        model, balance, chunks=4, schedule=schedule, loss_fn=lm_loss, optimizer=sgd,
        init_seed=None if weights else 0, weights=weights,
    )
    here = pipe.module
    assert all(not t.is_meta for t in here.state_dict().values())
    initial = {k: v.clone() for k, v in here.state_dict().items()}
    for x, y in text_batches(STEPS):
        pipe.train_step(x, y)
    if folder is not None:
        pipe.save(folder)
    return initial, pipe.module.state_dict()


def merged(results: list[tuple[dict, dict]], which: int) -> dict:
    out: dict = {}
    for result in results:
        out.update(result[which])
    return out


def assert_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        difference = (got[key] - want[key]).abs().max().item()
        assert difference <= TOLERANCE, f"{key}: off by {difference}"


@pytest.mark.parametrize(
    "world, balance, schedule",
    [(2, [3, 5], "1f1b"), (2, [5, 3], "1f1b"), (4, [1] * 8, "interleaved")],
    ids=["2ranks-1f1b-3+5", "2ranks-1f1b-5+3", "4ranks-interleaved"],
)
def test_meta_pipeline_trains_like_one_process(world, balance, schedule) -> None:
    """The tied head (on the last rank) and the embedding (on the first) start equal, every
    layer starts as the eager model's under either balance (so two balances give the same
    weights), and 3 steps end where single-process training ends."""
    initial, trained = reference()
    results = values(run_ranks(_train_meta, world, balance, schedule, None, None, deadline=180))
    assert_close(merged(results, 0), initial)
    for key in initial:  # not merely close: the rule does not depend on the split
        assert torch.equal(merged(results, 0)[key], initial[key]), key
    assert_close(merged(results, 1), trained)


def test_consolidate_then_load_per_stage(tmp_path: Path) -> None:
    """A meta pipeline loads a whole-model safetensors file and a .pt file (each rank its own
    stage) exactly, trains, saves; `pipetrain consolidate -o x.safetensors` (stage by stage)
    then loads under another balance with identical parameters."""
    eager = gpt(**SHAPE, seed=5)
    state = eager.state_dict()
    pt, st = tmp_path / "model.pt", tmp_path / "model.safetensors"
    torch.save(state, pt)
    weightfile.write_safetensors(st, {k: (v.dtype, tuple(v.shape)) for k, v in state.items()},
                                 state.items())
    folder = tmp_path / "checkpoints"
    results = values(run_ranks(_load_train_save, 2, str(st), str(pt), str(folder)))
    for which in (0, 1):  # from the safetensors file, from the .pt file
        for key in state:
            assert torch.equal(merged(results, which)[key], state[key]), key
    saved = merged(results, 2)
    whole = tmp_path / "trained.safetensors"
    assert pipetrain.tools.cli.main(["consolidate", str(folder), "-o", str(whole)]) == 0
    reloaded = merged(values(run_ranks(_initial_from, 2, [6, 2], str(whole))), 0)
    assert reloaded.keys() == saved.keys()
    for key in saved:
        assert torch.equal(reloaded[key], saved[key]), key


def _load_train_save(rank: int, world: int, st: str, pt: str, folder: str) -> tuple[dict, ...]:
    from_pt = _initial_from(rank, world, [3, 5], pt)[0]
    initial, trained = _train_meta(rank, world, [3, 5], "1f1b", st, folder)
    return initial, from_pt, trained


def _initial_from(rank: int, world: int, balance: list[int], weights: str) -> tuple[dict]:
    pipe = pipetrain.Pipeline(gpt(**SHAPE, device="meta"), balance, weights=weights)
    return ({k: v.clone() for k, v in pipe.module.state_dict().items()},)


def test_meta_model_without_seed_or_weights_is_refused() -> None:
    with pytest.raises(ValueError, match="init_seed=.*weights="):
        pipetrain.Pipeline(gpt(**SHAPE, device="meta"), [4, 4], devices=["cpu", "cpu"])


def test_threads_tied_weight_is_one_tensor() -> None:
    """With every stage in this process, the embedding and the head share one materialized
    tensor, as in the eager model."""
    pipe = pipetrain.Pipeline(gpt(**SHAPE, device="meta"), [3, 5], devices=["cpu", "cpu"],
                              init_seed=0)
    embedding, head = pipe.stages[0].module[0], pipe.stages[1].module[-1]
    assert isinstance(head.project, nn.Linear)
    assert embedding.tokens.weight is head.project.weight


def test_meta_tied_weight_on_one_rank_is_stepped_once() -> None:
    """One torchrun rank holding both stages that share the tied embedding/head of a meta
    model: the first of them steps the materialized weight, once per step, as in one process
    (its ownership is decided on the tensors the stages hold, not on the meta ones)."""
    initial, trained = reference()
    results = values(run_ranks(_train_meta, 1, [4, 4], "interleaved", None, None, deadline=120))
    assert_close(merged(results, 0), initial)
    assert_close(merged(results, 1), trained)
