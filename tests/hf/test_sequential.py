"""pipetrain.hf.sequential and causal_lm_loss against the transformers model itself: the same
state_dict keys, the same logits (exactly: the same modules run the same ops), the same loss
(1e-6: the token-weighted loss only reorders a sum and one division), eager and sdpa alike."""

from __future__ import annotations

import pytest
import torch

import pipetrain.hf as hf
from tests.hf.models import (
    BEFORE_5,
    LLAMA_LIKE,
    REFUSED_BEFORE_5,
    VOCAB,
    batch,
    declared,
    model,
    transformers,
)

ARCHS = [
    declared(a) for a in ("llama", "llama-tied", "qwen3", "mistral", "gpt2", "gptj", "codegen")
]


@pytest.mark.parametrize("arch", ARCHS)
def test_keys_are_the_models_and_load_strictly(arch: str) -> None:
    m = model(arch)
    layers = hf.sequential(m)
    assert list(layers.state_dict()) == list(m.state_dict())
    blocks = [i for i, name in enumerate(layers.names) if ".layers." in name or ".h." in name]
    assert list(layers[blocks[0]:blocks[-1] + 1].state_dict()) == [
        k for k in m.state_dict() if ".layers." in k or ".h." in k
    ]
    other = model(arch, seed=1)
    layers.load_state_dict(other.state_dict())  # strict: every key, no others
    for key, value in other.state_dict().items():
        assert torch.equal(m.state_dict()[key], value), key
    tail = layers[-2:]  # the norm and the head: no layer named "model" here
    tail.load_state_dict(tail.state_dict())
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "model.x.weight"'):
        tail.load_state_dict({**tail.state_dict(), "model.x.weight": torch.zeros(1)})


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_logits_and_loss_are_the_models(arch: str, attn: str) -> None:
    m = model(arch, attn).eval()
    ids, mask, labels = batch()
    expected = m(ids, attention_mask=mask, labels=labels, use_cache=False)
    logits = hf.sequential(m)((ids, mask))
    assert torch.equal(logits, expected.logits)
    loss = hf.causal_lm_loss(logits, hf.causal_lm_targets(labels))
    assert abs(loss.item() - expected.loss.item()) < 1e-6
    assert abs(hf.causal_lm_loss(logits, labels).item() - expected.loss.item()) < 1e-6


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_eager_and_sdpa_give_the_same_loss(arch: str) -> None:
    """Right padding: with left padding a pad position's query sees no key at all, and
    transformers' eager and sdpa give such rows different values (the model itself does),
    which the loss counts where the next token is real."""
    ids, mask, labels = batch(left=False)
    losses = [
        hf.causal_lm_loss(hf.sequential(model(arch, attn))((ids, mask)), labels).item()
        for attn in ("eager", "sdpa")
    ]
    assert abs(losses[0] - losses[1]) < 1e-5


def test_token_weighted_across_micro_batches() -> None:
    """Micro-batches with different numbers of counted tokens: the pipeline's mean of
    per-micro-batch losses (each as causal_lm_loss returns it) is the whole batch's token
    mean, not the mean of micro-batch means."""
    m = model("llama").eval()
    ids, mask, labels = batch(rows=4)
    labels[:2, 3:] = -100  # the first micro-batch counts far fewer tokens
    logits = hf.sequential(m)((ids, mask))
    whole = hf.causal_lm_loss(logits, labels)
    targets = hf.causal_lm_targets(labels)
    parts = [hf.causal_lm_loss(logits[i:i + 2], (targets[0][i:i + 2], targets[1][i:i + 2]))
             for i in (0, 2)]
    means = [hf.causal_lm_loss(logits[i:i + 2], labels[i:i + 2]) for i in (0, 2)]
    assert abs((sum(parts) / 2).item() - whole.item()) < 1e-6
    assert abs((sum(means) / 2).item() - whole.item()) > 1e-3  # the wrong weighting differs


def test_refuses_a_model_it_cannot_cut() -> None:
    with pytest.raises(TypeError, match="ForCausalLM"):
        hf.sequential(torch.nn.Linear(2, 2))


MORE = ["Qwen2", "Gemma", "Gemma3Text", "Phi", "Phi3", "Olmo2", "Mixtral", "Granite"]


@pytest.mark.parametrize("name", MORE)
def test_more_architectures_with_a_plan_give_the_models_logits(name: str) -> None:
    """Dropout after the embedding (Phi), rotary tables per attention type (Gemma 3),
    mixtures of experts (Mixtral): the config's plan and the model's own modules cover them."""
    made = getattr(transformers, f"{name}Config")(**LLAMA_LIKE, pad_token_id=0)
    made._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(made).eval()
    ids, mask, _ = batch()
    if BEFORE_5 and name in ("Gemma", "Gemma3Text"):  # scaling, rotary tables outside blocks
        with pytest.raises(TypeError, match=REFUSED_BEFORE_5):
            hf.sequential(m)
        return
    layers = hf.sequential(m)
    assert list(layers.state_dict()) == list(m.state_dict())
    assert torch.equal(layers((ids, mask)), m(ids, attention_mask=mask, use_cache=False).logits)


@pytest.mark.parametrize(("name", "setting"), [("Gemma2", {}),
                                                ("Granite", {"embedding_multiplier": 2.0})])
def test_scaling_outside_the_modules_is_refused(name: str, setting: dict) -> None:
    made = getattr(transformers, f"{name}Config")(**LLAMA_LIKE, pad_token_id=0, **setting)
    with pytest.raises(TypeError, match="scales the embeddings or the logits"):
        hf.sequential(transformers.AutoModelForCausalLM.from_config(made))


def test_a_stages_blocks_build_the_mask_once_and_drop_it_with_the_batch() -> None:
    m = model("mistral").eval()  # sliding-window masks
    layers = hf.sequential(m)
    calls = []
    blocks = [layers.glue[name] for name in layers.names if ".layers." in name]
    for block in blocks:
        build = block.mask
        block.mask = lambda *a, build=build: calls.append(1) or build(*a)
    ids, mask, _ = batch()
    logits = layers((ids, mask))
    assert torch.equal(logits, m(ids, attention_mask=mask, use_cache=False).logits)
    assert len(calls) == 1  # two blocks, one mask
    shared = blocks[0].shared
    assert shared._entries  # held while the batch's mask lives
    del mask, logits
    assert not shared._entries


@pytest.mark.parametrize("name", ["Starcoder2", "Glm4"])
def test_a_window_is_used_as_the_models_forward_uses_it(name: str) -> None:
    """Both configs store sliding_window=3 without layer types: Starcoder2's forward builds
    sliding-window masks, Glm4's ignores the window (causal). 9 tokens: a window of 3 shows."""
    made = getattr(transformers, f"{name}Config")(**LLAMA_LIKE, pad_token_id=0, sliding_window=3)
    made._attn_implementation = "eager"
    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(made).eval()
    ids, mask, _ = batch()
    assert torch.equal(hf.sequential(m)((ids, mask)),
                       m(ids, attention_mask=mask, use_cache=False).logits)


@pytest.mark.parametrize("built", ["bert", "t5"])
def test_a_model_that_is_no_causal_lm_is_refused_as_such(built: str) -> None:
    """BERT (a masked LM: its head sits inside ``cls``) and T5 (an encoder-decoder) are named
    as no causal LM, not met by an unpacking error."""
    if built == "bert":
        m = transformers.BertForMaskedLM(transformers.BertConfig(
            vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=16))
        why = "its base model and head are not its children"
    else:
        m = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2))
        why = "an encoder-decoder"
    with pytest.raises(TypeError, match=f"is not one \\({why}\\).*AutoModelForCausalLM"):
        hf.sequential(m)


def test_blocks_needing_per_layer_inputs_are_refused() -> None:
    """Gemma 4's blocks take per-layer inputs (and key/value states shared across layers) that
    its base model makes outside them: refused at ``sequential``, not failing in a forward."""
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Gemma 4")
    made = transformers.Gemma4TextConfig(
        **LLAMA_LIKE, head_dim=8, global_head_dim=8, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, layer_types=["sliding_attention", "full_attention"],
        pad_token_id=0,
    )
    with pytest.raises(TypeError, match="Gemma4TextDecoderLayer .* takes per_layer_input, "
                                        "shared_kv_states: .* does not carry"):
        hf.sequential(transformers.AutoModelForCausalLM.from_config(made))


def test_a_plan_without_the_final_norm_says_what_it_lists() -> None:
    made = transformers.LlamaConfig(**LLAMA_LIKE)
    made.base_model_pp_plan = {k: v for k, v in made.base_model_pp_plan.items() if k != "norm"}
    with pytest.raises(TypeError) as error:
        hf.sequential(transformers.AutoModelForCausalLM.from_config(made))
    message = str(error.value)
    assert "base_model_pp_plan lists ['embed_tokens', 'layers']: after the blocks 'layers' " \
           "it needs one entry, the final norm, and has nothing" in message
    assert "declares no" not in message
