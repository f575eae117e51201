"""Each rank's resident growth while building a pipeline of a Hugging Face model from its
checkpoint directory, against the bytes of its own stage.

    PYTHONPATH=. python benchmarks/hf_load_memory.py                 # Llama of 0.43 GB fp32
    PYTHONPATH=. python benchmarks/hf_load_memory.py --hidden 256 --layers 4   # a quick look

A Llama is built from a config (no hub access) and saved with ``save_pretrained`` (sharded at
``--shard``); then two gloo ranks (fresh processes) each build it on the meta device and a
2-stage ``Pipeline(pipetrain.hf.sequential(meta), weights=DIR)``. A rank's growth is its peak
resident set (VmHWM) after building minus its resident set (VmRSS) just before; its stage's
bytes are those of the tensors it holds. Goal: growth at most 1.25x the stage's bytes (each
rank reads only its own tensors, straight into its parameters). Memory does not depend on
timing, so one run is shown.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from ranks import free_port


def status(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def config(args: argparse.Namespace):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64, tie_word_embeddings=False,
    )


def _rank(rank: int, port: int, args: argparse.Namespace, folder: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    import transformers

    import pipetrain
    import pipetrain.hf as hf

    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config(args))
    layers = hf.sequential(meta)
    balance = [len(layers) // 2, len(layers) - len(layers) // 2]
    before = status("VmRSS")
    pipe = pipetrain.Pipeline(layers, balance, weights=folder)
    peak = status("VmHWM")
    tensors = {id(t): t for t in pipe.module.state_dict().values()}.values()
    stage = sum(t.numel() * t.element_size() for t in tensors)
    dist.barrier()
    results.put((rank, before, peak, stage))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--shard", default="100MB", help="max_shard_size of save_pretrained")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as folder:
        model = AutoModelForCausalLM.from_config(config(args))
        model.save_pretrained(folder, max_shard_size=args.shard)
        total = sum(p.numel() * p.element_size() for p in model.parameters())
        shards = len(list(Path(folder).glob("*.safetensors")))
        del model
        print(f"Llama hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: "
              f"{total / 1e9:.2f} GB fp32 in {shards} shard(s); 2 gloo ranks, 2 stages")
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        port = free_port()
        procs = [ctx.Process(target=_rank, args=(r, port, args, folder, results))
                 for r in range(2)]
        for p in procs:
            p.start()
        found = sorted(results.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(timeout=60)
            if p.exitcode != 0:
                raise SystemExit(f"a rank failed (exit code {p.exitcode})")
    print(f"{'rank':>4} {'RSS before MiB':>14} {'peak MiB':>9} {'growth MiB':>10} "
          f"{'stage MiB':>9} {'growth/stage':>12}")
    for rank, before, peak, stage in found:
        growth = peak - before
        print(f"{rank:>4} {before / 2**20:>14,.0f} {peak / 2**20:>9,.0f} {growth / 2**20:>10,.0f} "
              f"{stage / 2**20:>9,.0f} {growth / stage:>11.2f}x")


if __name__ == "__main__":
    main()
