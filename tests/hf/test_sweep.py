"""Every causal LM transformers ships (its auto mapping's ``*ForCausalLM`` classes), built from
its default config made tiny: ``sequential`` either accepts it, and then its logits are the
model's (eager attention, padded rows), or refuses it with a TypeError or ValueError saying
why; never another exception, never accepted and then failing. A class whose tiny config
cannot be built, or whose own forward fails on it, is skipped naming why.

``python -m tests.hf.test_sweep`` prints each class's verdict (docs/hf.md's list)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import pipetrain.hf as hf
from tests.hf.models import VOCAB, batch, transformers

auto = transformers.models.auto
CLASSES = dict(auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
FAST = ("deepseek_v3", "gemma3_text", "gpt2", "gpt_neox", "llama", "mixtral", "qwen2_moe")
"""The classes the fast profile checks, one of each kind: dense, tied head, a head saved under
another name, fused experts, a scaled embedding, latent attention; ``-m sweep`` (CI) checks all."""
MAX_PARAMS = 2_000_000  # what is left large (sub-models, odd names) is skipped, not built
# the usual names of a config's sizes, each set where the config has it
TINY = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    n_embd=32, n_layer=2, n_head=4, n_positions=64, d_model=32, num_layers=2, rotary_dim=4,
    num_experts=4, num_local_experts=4, n_routed_experts=4, moe_num_experts=4,
    num_experts_per_tok=2, moe_k=2, moe_intermediate_size=16,
    shared_expert_intermediate_size=16, n_shared_experts=1, n_group=1, topk_group=1,
    kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
    first_k_dense_replace=1, global_head_dim=8, hidden_size_per_layer_input=8,
    vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=0, ffn_hidden_size=64, n_inner=64,
    ffn_dim=64,
)


def sweep(keys: Any) -> list[Any]:
    """``keys`` sorted as test parameters, those outside FAST marked ``sweep``."""
    return [pytest.param(k, marks=() if k in FAST else pytest.mark.sweep) for k in sorted(keys)]


def tiny(key: str) -> Any:
    """The default config of model type ``key`` with the sizes of TINY, two layers of
    different attention types where it has layer types, token ids within the vocabulary."""
    made = auto.configuration_auto.CONFIG_MAPPING[key]()
    for part in (made, getattr(made, "text_config", None)):
        if part is None:
            continue
        layers = getattr(part, "num_hidden_layers", getattr(part, "num_layers", None))
        for name, value in TINY.items():
            if hasattr(part, name):
                setattr(part, name, value)
        if hasattr(part, "qk_head_dim"):  # multi-head latent attention's derived sizes
            part.qk_head_dim = part.qk_nope_head_dim + part.qk_rope_head_dim
            part.head_dim = part.qk_rope_head_dim
            part.num_key_value_heads = part.num_attention_heads  # keys per head, not grouped
        _two_layers(part, layers)
        for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(part, name, None), int) and getattr(part, name) >= VOCAB:
                setattr(part, name, 0)
    made._attn_implementation = "eager"
    return made


def _two_layers(part: Any, layers: int | None) -> None:
    """The config's per-layer lists for the two layers of TINY (so that it validates, and
    saves): layer types of two kinds where it has two, any other list of one entry per layer
    cut to its first two, GPT-Neo's attention pattern once."""
    types = getattr(part, "layer_types", None)
    if isinstance(types, list) and len(types) > 2:
        part.layer_types = [types[0], next((t for t in types if t != types[0]), types[0])]
    for name, value in list(vars(part).items()):
        if name != "layer_types" and isinstance(value, list) and len(value) == layers:
            setattr(part, name, value[:2])
    if isinstance(getattr(part, "attention_types", None), list):  # [[pattern, repeats]]
        part.attention_types = [[part.attention_types[0][0], 1]]


def built(key: str) -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    """(the model, the same built on the meta device, its logits on ``batch()``), or a skip
    naming why the tiny model cannot be had."""
    try:
        config = tiny(key)
        make = getattr(transformers, CLASSES[key])
        with torch.device("meta"):
            meta = make(config)
        count = sum(p.numel() for p in meta.parameters())
        if count > MAX_PARAMS:
            raise RuntimeError(f"{count:,} parameters even tiny")
        torch.manual_seed(0)
        model = make(config).eval()
        ids, mask, _ = batch()
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits
    except Exception as error:  # any reason the tiny model is not to be had
        pytest.skip(f"{CLASSES[key]}: no tiny model ({type(error).__name__}: {error!s:.120})")
    return model, meta, logits


def verdict(key: str) -> str:
    """"accepted", or "refused: REASON"; an accepted model whose logits differ, or any other
    exception, fails (asserts or raises)."""
    model, meta, expected = built(key)
    try:
        layers = hf.sequential(model)
    except (TypeError, ValueError) as error:
        with pytest.raises(type(error)):  # the same verdict on the meta device
            hf.sequential(meta)
        return f"refused: {error}"
    hf.sequential(meta)
    ids, mask, _ = batch()
    with torch.no_grad():
        logits = layers((ids, mask))
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0), key
    return "accepted"


@pytest.mark.parametrize("key", sweep(CLASSES))
def test_each_causal_lm_is_accepted_exactly_or_refused_naming_why(key: str) -> None:
    result = verdict(key)
    assert result == "accepted" or len(result) > len("refused: ") + 20


if __name__ == "__main__":
    for key in sorted(CLASSES):
        try:
            print(f"{key}\t{CLASSES[key]}\t{verdict(key)[:160]}")
        except pytest.skip.Exception as skipped:
            print(f"{key}\t{CLASSES[key]}\tskipped: {skipped.msg[:160]}")
