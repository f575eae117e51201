"""``Pipeline.generate`` on a plain ``nn.Sequential`` language model (no cache: the whole
sequence is run at each step) against a hand-written argmax loop, in threads and on 2 gloo
ranks; bad arguments and prompts are a ValueError, on every rank; ``eval_step`` as the
validation of a training loop."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import pipetrain
from pipetrain.errors import PeerError
from tests.runtime.harness import run_ranks

VOCAB = 32


class CausalMean(nn.Module):
    """Each position's mean of the positions up to it: a layer that mixes positions, causally."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        return x.cumsum(1) / counts[:, None]


def language_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, 16), CausalMean(), nn.Tanh(),
                         nn.Dropout(0.5), nn.Linear(16, VOCAB))


def greedy(model: nn.Sequential, ids: torch.Tensor, new: int) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids


def prompts() -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, 5), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_threads_greedy_equal_the_argmax_loop(chunks: int, one_thread) -> None:
    pipe = pipetrain.Pipeline(language_model(), balance=[3, 3], chunks=chunks,
                              devices=["cpu", "cpu"])
    got = pipe.generate(prompts(), max_new_tokens=7)
    assert torch.equal(got, greedy(language_model(), prompts(), 7))
    assert torch.equal(pipe.generate(prompts(), max_new_tokens=0), prompts())
    assert all(stage.module.training for stage in pipe.stages)  # eval only while generating


def test_bad_arguments_are_refused(one_thread) -> None:
    pipe = pipetrain.Pipeline(language_model(), balance=[3, 3], chunks=2,
                              devices=["cpu", "cpu"])
    cases = [
        (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
        (dict(max_new_tokens=2.5), "max_new_tokens must be an integer >= 0"),
        (dict(max_new_tokens=2, do_sample=True, temperature=0.0), "temperature"),
        (dict(max_new_tokens=2, do_sample=True, top_k=-1), "top_k must be >= 1"),
        (dict(max_new_tokens=2, do_sample=True, top_p=0.0), "top_p must be in (0, 1]"),
        (dict(max_new_tokens=2, top_p=1.5), "top_p must be in (0, 1]"),
        (dict(max_new_tokens=2, eos_token_id=[2, "x"]), "eos_token_id must be an integer"),
        (dict(), "generate needs max_new_tokens="),
        (dict(input_ids=prompts()[:3], max_new_tokens=2), "chunks=2 does not divide"),
        (dict(input_ids=prompts().float(), max_new_tokens=2), "integer token ids"),
        (dict(input_ids=prompts()[0], max_new_tokens=2), "shape (batch, seq)"),
        (dict(attention_mask=torch.ones(4, 2), max_new_tokens=2), "attention_mask must be"),
    ]
    for arguments, message in cases:
        arguments = {"input_ids": prompts(), **arguments}
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            pipe.generate(**arguments)
    assert torch.equal(pipe.generate(prompts(), max_new_tokens=3),  # refused, not stopped
                       greedy(language_model(), prompts(), 3))


def _rank(rank: int, world: int, refused: bool) -> object:
    pipe = pipetrain.Pipeline(language_model(), balance=[3, 3], chunks=2, timeout=60)
    if refused:  # only the first stage reads the prompt: the other learns why it stopped
        try:
            pipe.generate(prompts()[:3] if rank == 0 else None, max_new_tokens=2)
        except (ValueError, PeerError) as error:
            return type(error).__name__, str(error)
        return "no error"
    return pipe.generate(prompts() if rank == 0 else None, max_new_tokens=7)


def test_processes_greedy_equal_the_argmax_loop() -> None:
    expected = greedy(language_model(), prompts(), 7)
    for status, value in run_ranks(_rank, 2, False, deadline=120):
        assert status == "ok", value
        assert torch.equal(value, expected)


def test_a_refused_prompt_stops_every_rank_at_once() -> None:
    (s0, first), (s1, second) = run_ranks(_rank, 2, True, deadline=50)  # well under timeout
    assert (s0, s1) == ("ok", "ok")
    assert first[0] == "ValueError" and "chunks=2 does not divide" in first[1]
    assert second[0] == "PeerError" and "stage 0 refused its prompt" in second[1]


def test_eval_step_validates_between_train_steps(one_thread) -> None:
    """The README's loop: a validation loss every few steps, training mode kept, and equal
    to the model's own in eval mode."""
    model = language_model()
    pipe = pipetrain.Pipeline(
        model, balance=[3, 3], chunks=2, devices=["cpu", "cpu"],
        loss_fn=lambda out, y: nn.functional.cross_entropy(out.flatten(0, 1), y.flatten()),
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
    )
    ids = prompts()
    held_out = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(2))
    losses = []
    for step in range(6):
        pipe.train_step(ids[:, :-1], ids[:, 1:])
        if step % 2 == 1:
            logits = pipe.eval_step(held_out[:, :-1])
            assert isinstance(logits, torch.Tensor)
            losses.append(float(pipe.config.loss_fn(logits, held_out[:, 1:])))
            assert all(stage.module.training for stage in pipe.stages)
    model.eval()
    with torch.no_grad():
        own = pipe.config.loss_fn(model(held_out[:, :-1]), held_out[:, 1:])
    assert losses[-1] == pytest.approx(float(own), abs=1e-6)
