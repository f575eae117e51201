"""Tiny Hugging Face causal LMs built from configs (no hub access here), and padded batches."""

from __future__ import annotations

import pytest

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[hf]')"
)

import torch  # noqa: E402

VOCAB = 64
# transformers 4.x (4.56): what pipetrain/hf/compat.py refuses there, naming the newer release
BEFORE_5 = int(transformers.__version__.split(".")[0]) < 5
REFUSED_BEFORE_5 = r"with transformers 4\.\d+\.\d+: .*install transformers>=5\.20"
LLAMA_LIKE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)


def declared(arch: str) -> object:
    """``arch`` as a test parameter, skipped (with the reason) where this transformers' config
    of it declares no pp plan: GPT-J's and CodeGen's came after 5.20, and without one
    pipetrain refuses them (tests/hf/test_sweep.py holds the refusal)."""
    name = {"gptj": "GPTJConfig", "codegen": "CodeGenConfig"}.get(arch)
    if name is None or getattr(transformers, name).base_model_pp_plan:
        return arch
    reason = f"transformers {transformers.__version__}'s {name} declares no base_model_pp_plan"
    return pytest.param(arch, marks=pytest.mark.skip(reason=reason))


def config(arch: str, attn: str = "sdpa") -> object:
    """A tiny config of ``arch``: "llama", "llama-tied", "qwen3", "mistral", "gpt2", "gptj"
    or "codegen" (the last two: rotary on 4 of each head's 8 dimensions)."""
    t = transformers
    if arch == "gpt2":
        return t.GPT2Config(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0,
            eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            attn_implementation=attn,
        )
    if arch in ("gptj", "codegen"):
        made = getattr(t, {"gptj": "GPTJConfig", "codegen": "CodeGenConfig"}[arch])(
            vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
            bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        )
        # transformers before 5.2x has no sdpa path for these two: eager, the one every
        # version has
        made._attn_implementation = "eager"
        return made
    made = {
        "llama": lambda: t.LlamaConfig(**LLAMA_LIKE),
        "llama-tied": lambda: t.LlamaConfig(**LLAMA_LIKE, tie_word_embeddings=True),
        "qwen3": lambda: t.Qwen3Config(**LLAMA_LIKE, head_dim=8),
        "mistral": lambda: t.MistralConfig(**LLAMA_LIKE, sliding_window=4),
    }[arch]()
    made._attn_implementation = attn
    return made


def model(arch: str, attn: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config(arch, attn))


def two_stages(arch: str) -> list[int]:
    """Layers per stage for 2 stages split after the first block: the modules before the
    blocks and block 0, then the rest (GPT-2 has three layers before its blocks, Llama one)."""
    import pipetrain.hf

    names = pipetrain.hf.sequential(model(arch)).names
    first = next(i for i, name in enumerate(names) if name.endswith((".layers.0", ".h.0")))
    return [first + 1, len(names) - first - 1]


def batch(
    rows: int = 4, length: int = 9, seed: int = 0, left: bool = True,
) -> tuple[torch.Tensor, ...]:
    """(input_ids, attention_mask, labels): right padding in one row, left padding in another
    (unless not ``left``), labels -100 on padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - 3:] = 0
    if left:
        mask[-1, :2] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels
