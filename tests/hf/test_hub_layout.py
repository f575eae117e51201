"""Hub-layout checkpoints, in and out, for every architecture ``sequential`` accepts.

A tiny model of each causal LM class transformers ships (tests/hf/test_sweep.py's) is saved
with ``save_pretrained``: mixture-of-experts models write one tensor per expert, GPT-NeoX its
head as ``embed_out``, none of which is the model's own key. Read with ``weights=DIR`` into
a pipeline of the model built on the meta device, every tensor equals ``from_pretrained``'s,
bit for bit (the bytes are copied, or fused by transformers' own converters). The pipeline's
checkpoint, written back with ``pipetrain.hf.save`` (``consolidate --hf``), is the directory
``save_pretrained`` wrote: the same keys, the same tensors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import pipetrain
import pipetrain.hf as hf
from tests.hf.models import batch, transformers
from tests.hf.test_sweep import CLASSES, built, sweep
from tests.runtime.harness import run_ranks, values


def saved_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            tensors.update({key: f.get_tensor(key) for key in f.keys()})
    return tensors


def accepted(key: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The tiny model of ``key`` and the same on the meta device; skipped naming why where
    ``sequential`` refuses it (tests/hf/test_sweep.py checks the refusal)."""
    model, meta, _ = built(key)
    try:
        hf.sequential(model)
    except (TypeError, ValueError) as error:
        pytest.skip(f"{CLASSES[key]} is refused by sequential: {error!s:.100}")
    return model, meta


@pytest.mark.parametrize("key", sweep(CLASSES))
def test_a_hub_checkpoint_loads_and_is_written_back_as_it_was(key: str, tmp_path: Path) -> None:
    model, meta = accepted(key)
    hub = tmp_path / "hub"
    try:
        model.save_pretrained(hub)
    except Exception as error:  # transformers' own validation of the tiny config; no pipetrain
        pytest.skip(f"{CLASSES[key]}: save_pretrained refuses the tiny config "
                    f"({type(error).__name__}: {error!s:.100})")
    expected = getattr(transformers, CLASSES[key]).from_pretrained(hub).state_dict()
    layers = hf.sequential(meta)
    half = len(layers) // 2
    pipe = pipetrain.Pipeline(layers, devices=["cpu", "cpu"], balance=[half, len(layers) - half],
                              weights=hub, loss_fn=hf.causal_lm_loss)
    state = pipe.module.state_dict()
    assert list(state) == list(expected)
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    pipe.save(tmp_path / "checkpoint")
    written = saved_tensors(hf.save(tmp_path / "checkpoint", hub, tmp_path / "out"))
    original = saved_tensors(hub)
    assert sorted(written) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(written[name], tensor), name


def test_a_file_of_another_architecture_names_its_file_keys(tmp_path: Path) -> None:
    """Hub keys that no conversion makes into the model's are reported as the file has them."""
    moe, _ = accepted("qwen2_moe")
    moe.save_pretrained(tmp_path)
    _, llama = accepted("llama")
    unexpected = r"unexpected \(\d+\): model\.layers\.0\.mlp\.experts\.0\."
    with pytest.raises(ValueError, match=unexpected):
        pipetrain.Pipeline(hf.sequential(llama), devices=["cpu", "cpu"], balance=[3, 2],
                           weights=tmp_path)


def _rank(rank: int, world: int, folder: str) -> torch.Tensor | None:
    _, meta, _ = built("qwen2_moe")
    pipe = pipetrain.Pipeline(hf.sequential(meta), balance=[3, 2], chunks=2, weights=folder)
    ids, mask, _ = batch()
    return pipe.eval_step((ids, mask))


def test_processes_read_a_moe_hub_checkpoint_stage_by_stage(tmp_path: Path) -> None:
    """Two gloo ranks, each building the model on the meta device and fusing its own experts
    from the hub's per-expert shards: the logits are transformers' (1e-5, fp32: the same
    weights, one process against two)."""
    model, _ = accepted("qwen2_moe")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    first, last = values(run_ranks(_rank, 2, str(tmp_path), deadline=180))
    ids, mask, _ = batch()
    with torch.no_grad():
        expected = model.eval()(ids, attention_mask=mask, use_cache=False).logits
    assert first is None
    assert (last - expected).abs().max() < 1e-5
