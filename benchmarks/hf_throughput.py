"""Hugging Face Llama throughput: tokens/s on 2 CPU ranks, pipetrain against the same split
hand-built as torch.distributed.pipelining stages with Schedule1F1B, side by side in one run.

Model: a byte-level Llama from a config (hidden 128, 4 decoder layers, 4 heads, 2 key-value
heads, vocabulary 256, head untied: 0.79 M parameters), fp32, sdpa attention; batch 16 x 128
tokens of the bundled text (no padding) in 4 micro-batches, AdamW, 1F1B, no clip, one torch
thread per rank, each rank pinned to its core. The same split for both: embedding + 2 blocks |
2 blocks + norm + head.

pipetrain's side is what a user writes: ``Pipeline(pipetrain.hf.sequential(model), [3, 4],
loss_fn=pipetrain.hf.causal_lm_loss, ...)`` and ``train_step((ids, mask),
causal_lm_targets(labels))``. torch's side is what its user must write by hand (the stage
modules below: embedding, rotary positions and causal mask, blocks, norm and head, the loss
with the label shift), since its tracer does not capture these models whole. Each block in
pipetrain builds its own mask and rotary table from the mask and positions that travel with
the activations; torch's hand-built stages build them once per stage and pass nothing but the
hidden states (no padding support).

Variants alternate round by round; a step's time is the slowest rank's; the table gives the
median over all timed steps and "vs torch" torch's median step over pipetrain's (above 1:
pipetrain is faster).

    python benchmarks/hf_throughput.py                 # a few minutes on 2 cores
    python benchmarks/hf_throughput.py --rounds 5 --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from ranks import spawn_ranks
from timing import round_robin
from torch import nn

ROOT = str(Path(__file__).resolve().parents[1])
BATCH, CHUNKS, SEQ, RANKS = 16, 4, 128, 2
BALANCE = [3, 4]  # embedding + 2 blocks | 2 blocks + norm + head


def llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    return transformers.AutoModelForCausalLM.from_config(config)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1)


# user code (pipetrain): what training through pipetrain takes, the model built
class _Pipetrain:
    def __init__(self, ids: torch.Tensor):
        import pipetrain
        import pipetrain.hf

        self.pipe = pipetrain.Pipeline(
            pipetrain.hf.sequential(llama()), BALANCE, chunks=CHUNKS, timeout=300,
            loss_fn=pipetrain.hf.causal_lm_loss, optimizer=_adamw,
        )
        self.x = (ids, torch.ones_like(ids))
        self.y = pipetrain.hf.causal_lm_targets(ids)

    def step(self) -> None:
        self.pipe.train_step(self.x, self.y)
# end of user code (pipetrain)


# user code (torch): the stage modules, the loss, the schedule's set-up and step
class _FirstStage(nn.Module):
    def __init__(self, model, blocks: int):
        super().__init__()
        self.embed, self.rotary = model.model.embed_tokens, model.model.rotary_emb
        self.blocks, self.config = model.model.layers[:blocks], model.config

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _run_blocks(self, self.embed(ids))


class _LastStage(nn.Module):
    def __init__(self, model, blocks: int):
        super().__init__()
        self.rotary, self.config = model.model.rotary_emb, model.config
        self.blocks, self.norm = model.model.layers[blocks:], model.model.norm
        self.head = model.lm_head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(_run_blocks(self, hidden)))


def _run_blocks(stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    from transformers.masking_utils import create_causal_mask

    positions = torch.arange(hidden.shape[1]).unsqueeze(0)
    mask = create_causal_mask(config=stage.config, inputs_embeds=hidden, attention_mask=None,
                              cache=None, position_ids=positions)
    cos_sin = stage.rotary(hidden, positions)
    for block in stage.blocks:
        hidden = block(hidden, attention_mask=mask, position_embeddings=cos_sin,
                       position_ids=positions)
    return hidden


def _torch_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    shifted = nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), shifted.flatten())


class _Torch:
    def __init__(self, rank: int, ids: torch.Tensor):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        model = llama()
        blocks = BALANCE[0] - 1
        module = _FirstStage(model, blocks) if rank == 0 else _LastStage(model, blocks)
        stage = PipelineStage(module, rank, RANKS, torch.device("cpu"))
        self.opt = _adamw(module.parameters())
        self.schedule = Schedule1F1B(stage, n_microbatches=CHUNKS, loss_fn=_torch_loss)
        self.rank, self.ids = rank, ids

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=False)
        if self.rank == 0:
            self.schedule.step(self.ids)
        else:
            self.schedule.step(target=self.ids, losses=[])
        self.opt.step()
# end of user code (torch)


def user_lines(library: str) -> int:
    """The non-blank lines of this file between the markers of ``library``'s user code."""
    lines = Path(__file__).read_text().splitlines()
    start = lines.index(next(x for x in lines if x.startswith(f"# user code ({library})")))
    end = lines.index(f"# end of user code ({library})")
    return sum(1 for x in lines[start + 1:end] if x.strip() and not x.lstrip().startswith("#"))


def _rank(rank: int, port: int, rounds: int, steps: int, results) -> None:

    from pipetrain.runtime.distributed import pin_to_cores

    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from examples.text import load_corpus, training_batches

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    pin_to_cores(rank, RANKS)
    dist.init_process_group("gloo", rank=rank, world_size=RANKS, timeout=timedelta(seconds=600))
    train, _ = load_corpus()
    ids, _ = next(training_batches(train, BATCH, SEQ, seed=0))
    variants = {"pipetrain": _Pipetrain(ids), "torch": _Torch(rank, ids)}
    for variant in variants.values():  # warm-up (torch's first step infers shapes)
        for _ in range(2):
            variant.step()
    times = round_robin({name: v.step for name, v in variants.items()}, rounds, steps)
    dist.barrier()
    if rank == 0:
        results.put({name: statistics.median(values) for name, values in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant per round")
    args = parser.parse_args()
    print(f"Llama 0.79 M parameters, batch {BATCH} x {SEQ} tokens in {CHUNKS} micro-batches, "
          f"1F1B fp32, {RANKS} ranks pinned, {os.cpu_count()} cores; median of "
          f"{args.rounds * args.steps} steps per variant")
    medians = spawn_ranks(_rank, RANKS, args.rounds, args.steps)
    ours, theirs = medians["pipetrain"], medians["torch"]
    tokens = BATCH * SEQ
    print(f"{'':<11}{'tokens/s':>10}{'user lines':>12}")
    for name, median in (("pipetrain", ours), ("torch", theirs)):
        print(f"{name:<11}{tokens / median:>10,.0f}{user_lines(name):>12}")
    print(f"pipetrain vs torch: {theirs / ours:.2f}x")


if __name__ == "__main__":
    main()
