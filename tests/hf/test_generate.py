"""``Pipeline.generate`` on Hugging Face models: greedy decoding gives transformers' own
``generate(do_sample=False)`` token for token, on left-padded prompts, in one process and on
2 gloo ranks, under chunks 1 and 2; sampling with a seed is reproducible, under any chunks;
top-k and top-p narrow the scores as transformers' warpers do; a model's generation_config
gives the defaults, as it does to transformers' generate."""

from __future__ import annotations

import pytest
import torch

import pipetrain
import pipetrain.hf as hf
from tests.hf.models import model, two_stages
from tests.runtime.harness import run_ranks, values

NEW = 6  # tokens generated


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """4 prompts of 7 tokens, two padded on the left; rows 0 and 1 alike (one micro-batch of
    2 whose rows finish together)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 64, (4, 7), generator=g)
    ids[1] = ids[0]
    mask = torch.ones_like(ids)
    mask[2, :3] = 0
    mask[3, :1] = 0
    return ids, mask


def reference(arch: str, **options: object) -> torch.Tensor:
    m = model(arch).eval()
    m.generation_config.eos_token_id = None  # as pipetrain: no stop unless one is given
    ids, mask = prompts()
    return m.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                      pad_token_id=0, **options)


def pipeline(arch: str, chunks: int, **options: object) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(hf.sequential(model(arch)), balance=two_stages(arch), chunks=chunks,
                              **options)


def eos_of(arch: str) -> int:
    """A token rows 0 and 1 produce second: they stop there, the others go on."""
    return int(reference(arch)[0, 7 + 1])


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "mistral"])
def test_threads_greedy_equal_transformers(arch: str, chunks: int, one_thread) -> None:
    pipe = pipeline(arch, chunks, devices=["cpu", "cpu"])
    ids, mask = prompts()
    got = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW)
    assert torch.equal(got, reference(arch))
    eos = eos_of(arch)
    stopped = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=eos,
                            pad_token_id=0)
    assert torch.equal(stopped, reference(arch, eos_token_id=eos))


def test_sampling_is_reproducible_under_any_chunks(one_thread) -> None:
    ids, mask = prompts()
    drawn = [
        pipeline("llama", chunks, devices=["cpu", "cpu"]).generate(
            ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=5.0,
            seed=seed,
        )
        for chunks, seed in ((1, 7), (2, 7), (2, 8))
    ]
    assert torch.equal(drawn[0], drawn[1])
    assert not torch.equal(drawn[1], drawn[2])  # another seed
    assert not torch.equal(drawn[0], reference("llama"))  # hot: far from greedy
    assert torch.equal(drawn[0][:, :7], ids)


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 5, 1.0), (0.7, None, 0.9), (2.0, 20, 0.5), (1.0, 1, 0.3), (1.3, 50, 0.999),
])
def test_top_k_and_top_p_narrow_as_transformers_warpers(temperature, top_k, top_p) -> None:
    """The same tokens kept, with the same scores, as transformers' temperature, top-k and
    top-p warpers in its order, on random logits of 6 rows."""
    from transformers.generation import logits_process as warpers

    from pipetrain.runtime.prompts import Sampling

    scores = torch.randn(6, 97, generator=torch.Generator().manual_seed(top_k or 0)) * 3
    chain = [warpers.TemperatureLogitsWarper(temperature)]
    chain += [warpers.TopKLogitsWarper(top_k)] if top_k else []
    chain += [warpers.TopPLogitsWarper(top_p)] if top_p < 1 else []
    theirs = warpers.LogitsProcessorList(chain)(torch.zeros(6, 1, dtype=torch.long), scores)
    mine = Sampling(1, True, temperature, top_k=top_k, top_p=top_p).narrowed(scores)
    assert torch.equal(mine.isinf(), theirs.isinf())
    assert torch.equal(mine[~mine.isinf()], theirs[~theirs.isinf()])
    assert (~mine.isinf()).sum(-1).min() >= 1


def test_top_k_of_one_samples_the_greedy_tokens(one_thread) -> None:
    ids, mask = prompts()
    pipe = pipeline("llama", 2, devices=["cpu", "cpu"])
    drawn = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
                          temperature=5.0, top_k=1, seed=3)
    assert torch.equal(drawn, reference("llama"))


def test_a_generation_config_gives_the_defaults_as_to_transformers(one_thread) -> None:
    """``generation_config=model.generation_config``: its max_new_tokens, its eos ids (two,
    as Llama 3 has) and pad id, as transformers' generate reads them; an argument given
    overrides it."""
    m = model("llama").eval()
    eos = eos_of("llama")
    m.generation_config.update(max_new_tokens=NEW, eos_token_id=[eos, 1], pad_token_id=0,
                               do_sample=False)
    ids, mask = prompts()
    pipe = pipetrain.Pipeline(hf.sequential(m), balance=[2, 3], chunks=2, devices=["cpu"] * 2)
    expected = m.generate(ids, attention_mask=mask)
    got = pipe.generate(ids, attention_mask=mask, generation_config=m.generation_config)
    assert torch.equal(got, expected)
    shorter = pipe.generate(ids, attention_mask=mask, generation_config=m.generation_config,
                            max_new_tokens=2)
    assert torch.equal(shorter, expected[:, : 7 + 2])


def test_generation_leaves_training_mode_and_trains_on(one_thread) -> None:
    pipe = pipeline("llama", 2, devices=["cpu", "cpu"], loss_fn=hf.causal_lm_loss,
                    optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    ids, mask = prompts()
    pipe.generate(ids, attention_mask=mask, max_new_tokens=2)
    assert all(stage.module.training for stage in pipe.stages)
    labels = ids.masked_fill(mask == 0, -100)
    assert float(pipe.train_step((ids, mask), labels)) > 0


def _rank(rank: int, world: int) -> dict[str, torch.Tensor]:
    ids, mask = prompts()
    found = {}
    for arch, chunks in (("llama", 1), ("llama", 2), ("gpt2", 2)):
        pipe = pipeline(arch, chunks)
        given = (ids, mask) if rank == 0 else (None, None)  # only the first stage reads them
        found[f"{arch}-{chunks}"] = pipe.generate(given[0], attention_mask=given[1],
                                                  max_new_tokens=NEW)
    found["eos"] = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                 eos_token_id=eos_of("gpt2"), pad_token_id=0)
    found["drawn"] = pipe.generate(ids, attention_mask=mask, max_new_tokens=NEW,
                                   do_sample=True, temperature=5.0, seed=7)
    return found


def test_processes_greedy_equal_transformers(one_thread) -> None:
    """Every rank returns the sequences; sampling draws what one process draws."""
    ranks = values(run_ranks(_rank, 2, deadline=240))
    ids, mask = prompts()
    drawn = pipeline("gpt2", 1, devices=["cpu", "cpu"]).generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, temperature=5.0, seed=7)
    for found in ranks:
        assert torch.equal(found["llama-1"], reference("llama"))
        assert torch.equal(found["llama-2"], reference("llama"))
        assert torch.equal(found["gpt2-2"], reference("gpt2"))
        assert torch.equal(found["eos"], reference("gpt2", eos_token_id=eos_of("gpt2")))
        assert torch.equal(found["drawn"], drawn)
