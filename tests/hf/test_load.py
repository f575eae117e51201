"""Pipeline(sequential(meta model), weights=DIR) reads a Hugging Face checkpoint directory:
one model.safetensors or shards with their index, tied weights saved once, each stage its own
tensors (bit-exact: the bytes are copied), and one error naming the file for keys that do not
fit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import pipetrain
import pipetrain.hf as hf
from pipetrain.checkpoints.weightfile import WeightFileError
from tests.hf.models import BEFORE_5, LLAMA_LIKE, config, model, transformers, two_stages


def meta(arch: str) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config(arch))


def saved(arch: str, folder: Path, shard: str | None = None) -> dict[str, torch.Tensor]:
    m = model(arch)
    m.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return m.state_dict()


def options(arch: str = "llama") -> dict:
    return dict(balance=two_stages(arch), chunks=2, loss_fn=hf.causal_lm_loss,
                optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))


@pytest.mark.parametrize(("arch", "shard"), [("llama-tied", None), ("qwen3", "20KB"),
                                             ("gpt2", None)])
def test_meta_model_reads_the_directory(arch: str, shard: str | None, tmp_path: Path) -> None:
    expected = saved(arch, tmp_path, shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    pipe = pipetrain.Pipeline(hf.sequential(meta(arch)), devices=["cpu", "cpu"],
                              weights=tmp_path, **options(arch))
    state = pipe.module.state_dict()
    assert list(state) == list(expected)
    for key, value in state.items():
        assert torch.equal(value, expected[key]), key
    ids = torch.randint(0, 64, (2, 5))
    reference = model(arch).eval()
    assert torch.allclose(pipe.eval_step(ids), reference(ids).logits, atol=1e-6)


def test_a_checkpoint_of_another_model_is_refused_in_one_error(tmp_path: Path) -> None:
    other = transformers.Qwen3Config(  # q_norm and k_norm, which llama lacks
        **{**LLAMA_LIKE, "num_hidden_layers": 1, "intermediate_size": 48}, head_dim=8,
    )  # no layer 1, other MLP shapes
    transformers.AutoModelForCausalLM.from_config(other).save_pretrained(tmp_path)
    with pytest.raises(WeightFileError) as error:
        pipetrain.Pipeline(hf.sequential(meta("llama")), devices=["cpu", "cpu"],
                           weights=tmp_path, **options())
    message = str(error.value)
    assert str(tmp_path / "model.safetensors") in message
    assert "unexpected (2): model.layers.0.self_attn.k_norm.weight" in message
    assert "missing (9): model.layers.1." in message
    assert "wrong shape (3): model.layers.0.mlp.down_proj.weight: (32, 48)" in message


def test_a_directory_without_a_checkpoint_is_refused(tmp_path: Path) -> None:
    with pytest.raises(WeightFileError, match="neither model.safetensors"):
        pipetrain.Pipeline(hf.sequential(meta("llama")), devices=["cpu", "cpu"],
                           weights=tmp_path, **options())



def test_buffers_no_checkpoint_holds_are_made_from_the_config(tmp_path: Path) -> None:
    """Gemma's embedding scale is a buffer outside the state_dict: on the meta device it has
    no value and no checkpoint holds it, so ``sequential`` makes it from the config."""
    if BEFORE_5:
        pytest.skip(f"transformers {transformers.__version__}'s Gemma 3 is refused by "
                    "sequential (tests/hf/test_sequential.py)")
    made = transformers.Gemma3TextConfig(**LLAMA_LIKE, head_dim=8, pad_token_id=0)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(made).save_pretrained(tmp_path)
    with torch.device("meta"):
        m = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(tmp_path))
    pipe = pipetrain.Pipeline(hf.sequential(m), devices=["cpu", "cpu"], weights=tmp_path,
                              **options())
    ids = torch.randint(0, 64, (2, 5))
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # the same weights and buffers; the model builds its own mask (sdpa may take its causal
    # path), the pipeline passes one, so the kernels differ in the last bits on some CPUs
    assert torch.allclose(pipe.eval_step(ids), reference(ids).logits, atol=1e-6, rtol=0)
