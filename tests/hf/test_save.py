"""A pipeline checkpoint written back as a Hugging Face directory (pipetrain consolidate --hf,
pipetrain.hf.save): transformers loads it with no missing, unexpected or mismatched key, and
its logits are the pipeline's (fp32, 1e-5: the same weights, one process against two stages)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipetrain
import pipetrain.hf as hf
from pipetrain.tools.cli import main
from tests.hf.models import batch, config, model, transformers


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, Path, torch.Tensor, torch.Tensor]:
    """A tied Llama's directory, the checkpoint of 2 pipeline steps from it, and the
    pipeline's logits on a batch."""
    root = tmp_path_factory.mktemp("trained")
    model("llama-tied").save_pretrained(root / "source")
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config("llama-tied"))
    pipe = pipetrain.Pipeline(
        hf.sequential(meta), balance=[2, 3], chunks=2, devices=["cpu", "cpu"],
        weights=root / "source", loss_fn=hf.causal_lm_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    for step in range(2):
        ids, mask, labels = batch(seed=step)
        pipe.train_step((ids, mask), hf.causal_lm_targets(labels))
    pipe.save(root / "checkpoint")
    ids = batch(seed=5)[0]
    return root / "source", root / "checkpoint", ids, pipe.eval_step(ids)


def loaded(folder: Path) -> torch.nn.Module:
    m, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return m.eval()


def test_cli_writes_shards_transformers_loads(trained, tmp_path: Path, capsys) -> None:
    source, checkpoint, ids, logits = trained
    out = tmp_path / "out"
    assert main(["consolidate", str(checkpoint), "--hf", str(source), "-o", str(out),
                 "--max-shard-size", "20KB"]) == 0
    assert "written to" in capsys.readouterr().out
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1
    assert "lm_head.weight" not in weight_map  # tied: written once, as the embedding
    assert (out / "config.json").is_file()
    m = loaded(out)
    assert m.lm_head.weight is m.model.embed_tokens.weight
    assert (m(ids).logits - logits).abs().max() < 1e-5


def test_python_writes_one_file(trained, tmp_path: Path) -> None:
    source, checkpoint, ids, logits = trained
    out = hf.save(checkpoint, source, tmp_path / "out")
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert (loaded(out)(ids).logits - logits).abs().max() < 1e-5


def test_a_pipeline_resumes_from_the_checkpoint(trained) -> None:
    """The stage files hold HF keys, which pipe.load restores into the keyed layers."""
    source, checkpoint, ids, logits = trained
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config("llama-tied"))
    pipe = pipetrain.Pipeline(
        hf.sequential(meta), balance=[2, 3], chunks=2, devices=["cpu", "cpu"],
        weights=source, loss_fn=hf.causal_lm_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2),
    )
    assert pipe.load(checkpoint) == 2
    assert torch.equal(pipe.eval_step(ids), logits)


def test_refuses_another_models_config_and_a_used_directory(trained, tmp_path: Path) -> None:
    source, checkpoint, _, _ = trained
    config("qwen3").save_pretrained(tmp_path / "qwen3")
    with pytest.raises(ValueError, match=r"does not fit the model .*missing \(4\)"):
        hf.save(checkpoint, tmp_path / "qwen3", tmp_path / "out")
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="not an empty directory"):
        hf.save(checkpoint, source, tmp_path / "used")
