"""Fine-tune a Hugging Face causal LM across processes from a plan, and hand it back to
transformers.

    torchrun --nproc_per_node=2 examples/finetune_hf.py
    torchrun --nproc_per_node=2 examples/finetune_hf.py --model DIR   # your own checkpoint

Without --model, rank 0 builds a small byte-level Llama from a config (these machines have no
hub access) and saves it with ``save_pretrained``: it stands in for a downloaded checkpoint
directory. Then rank 0 profiles the model on the meta device (a layer at a time, never the
whole model) and plans the split; every rank builds the model on the meta device, reads its
own stage from the directory, and fine-tunes on the bundled text (bytes as tokens, so the
model needs a vocabulary of at least 256); the checkpoint is written back as a Hugging Face
directory, which transformers loads to generate a sample.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from text import CORPUS  # a sibling: the script's folder is on sys.path, the root need not be

import partitioner
import pipetrain
import pipetrain.hf
from pipetrain.hf.task import layers, text
from pipetrain.tools.meta_profile import profile


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face directory (default: build a small Llama)")
    parser.add_argument("--out", default="finetune-hf", help="folder for everything written")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--microbatch", type=int, default=4, help="windows per micro-batch")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64, help="tokens per window")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=20)
    return parser.parse_args()


def small_llama(folder: Path) -> None:
    """A byte-level Llama of 0.76 M parameters, saved as a Hugging Face directory."""
    import transformers
    from transformers.utils import logging

    logging.disable_progress_bar()

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def main() -> None:
    args = parse_args()
    rank, world = pipetrain.init_distributed()
    out = Path(args.out)
    source = Path(args.model) if args.model else out / "base"
    if rank == 0:
        out.mkdir(exist_ok=True)
        if args.model is None and not (source / "config.json").is_file():
            small_llama(source)
        with torch.device("meta"):
            model = layers(source)
        sample = torch.zeros(args.microbatch, args.seq, dtype=torch.long)
        plan = partitioner.plan(profile(model, sample, repeats=3), stages=world,
                                microbatches=args.microbatches)
        plan.save(out / "plan.json")
        print(plan.table(), flush=True)
    torch.distributed.barrier()
    task = text(str(source), str(CORPUS), batch=args.microbatch * args.microbatches,
                seq=args.seq, lr=args.lr)
    pipe = pipetrain.Pipeline(task.model, plan=out / "plan.json", loss_fn=task.loss_fn,
                              optimizer=task.optimizer, **task.options)
    for step in range(args.steps):
        loss = pipe.train_step(*task.batch(step))
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step}  loss {loss:.3f}", flush=True)
    pipe.save(out / "checkpoint")
    torch.distributed.barrier()
    if rank == 0:
        import transformers

        tuned = pipetrain.hf.save(out / "checkpoint", source, out / "tuned")
        model = transformers.AutoModelForCausalLM.from_pretrained(tuned)
        prompt = torch.tensor([list(b"And Jesus said unto them, ")])
        torch.manual_seed(0)
        generated = model.generate(prompt, max_new_tokens=60, do_sample=True, temperature=0.8,
                                   top_k=0)[0]
        print(f"Hugging Face directory {tuned}; sample (temperature 0.8, seed 0):", flush=True)
        print(bytes(generated.tolist()).decode("utf-8", errors="replace"), flush=True)
    pipetrain.shutdown()


if __name__ == "__main__":
    main()
