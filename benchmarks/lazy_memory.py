"""Each rank's peak resident memory when building a pipeline: eager against meta-device models.

    PYTHONPATH=. python benchmarks/lazy_memory.py            # GPT of 1.01 GB of fp32 weights
    PYTHONPATH=. python benchmarks/lazy_memory.py --dim 256 --blocks 4   # a quick look

Two gloo ranks (fresh processes for every row) build a 2-stage ``Pipeline`` of the example GPT
(examples.models.gpt, head tied to the embedding), split evenly:

- eager: every rank builds the whole model (as before meta-device support), then its stage;
- lazy: the model is built on the meta device, each rank materializes its own layers
  (``init_seed``);
- lazy + safetensors / lazy + .pt: each rank reads its own layers from a whole-model file
  (the first written by ``pipetrain consolidate -o x.safetensors`` stage by stage from the lazy
  run's checkpoint, the second by ``consolidate -o x.pt``, which holds the model whole).

A rank's growth is its peak resident set (VmHWM in /proc/self/status) after building the
pipeline minus its resident set (VmRSS) just before building, as a share of the whole model's
weight bytes; the consolidating process is measured the same way. Goal: lazy rows at most 60 %
(a rank's half plus overhead), eager 100 % or more. Memory does not depend on timing, so one
run per row is shown.
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

import pipetrain
import pipetrain.tools.cli
from examples.models import gpt

MODES = ("eager", "lazy", "lazy + safetensors", "lazy + .pt")


def status(field: str) -> int:
    """A /proc/self/status field (VmRSS, VmHWM), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def shape(args: argparse.Namespace) -> dict:
    return dict(vocab=256, dim=args.dim, blocks=args.blocks, heads=args.heads, context=128)


def _rank(rank: int, port: int, mode: str, args: argparse.Namespace, folder: str,
          results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=600))
    layers = args.blocks + 2
    balance = [layers - layers // 2, layers // 2]
    before = status("VmRSS")
    if mode == "eager":
        pipe = pipetrain.Pipeline(gpt(**shape(args), seed=0), balance)
    else:
        weights = {"lazy + safetensors": "model.safetensors", "lazy + .pt": "model.pt"}.get(mode)
        pipe = pipetrain.Pipeline(
            gpt(**shape(args), device="meta"), balance,
            init_seed=None if weights else 0,
            weights=str(Path(folder) / weights) if weights else None,
        )
    peak = status("VmHWM")
    if mode == "lazy":
        pipe.save(Path(folder) / "checkpoint")
    dist.barrier()
    results.put((rank, before, peak))
    dist.destroy_process_group()


def _consolidate(rank: int, output: str, folder: str, results: mp.Queue) -> None:
    before = status("VmRSS")
    pipetrain.tools.cli.main(["consolidate", str(Path(folder) / "checkpoint"), "-o", output])
    results.put((rank, before, status("VmHWM")))


def measure(target, count: int, *args) -> list[tuple[int, int, int]]:
    """Run ``target(rank, *args, queue)`` in ``count`` fresh processes; their (rank, before,
    peak), by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, *args, results)) for r in range(count)]
    for p in procs:
        p.start()
    out = sorted(results.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"a measuring process failed (exit code {p.exitcode})")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--heads", type=int, default=16)
    args = parser.parse_args()
    weights = sum(t.numel() * t.element_size()
                  for t in gpt(**shape(args), device="meta").parameters())
    print(f"GPT dim {args.dim}, {args.blocks} blocks: {weights / 1e9:.2f} GB of fp32 weights; "
          "2 ranks, even split")
    print(f"{'construction':<26} {'rank':>4} {'RSS before MiB':>14} {'peak MiB':>9} "
          f"{'growth MiB':>10} {'of weights':>10}")
    with tempfile.TemporaryDirectory() as folder:
        rows = []
        for mode in ("lazy", "consolidate -> safetensors", "consolidate -> .pt", "eager",
                     "lazy + safetensors", "lazy + .pt"):
            if mode.startswith("consolidate"):
                name = "model.safetensors" if "safetensors" in mode else "model.pt"
                found = measure(_consolidate, 1, str(Path(folder) / name), folder)
            else:
                found = measure(_rank, 2, free_port(), mode, args, folder)
            for rank, before, peak in found:
                growth = peak - before
                rows.append(f"{mode:<26} {rank:>4} {before / 2**20:>14,.0f} "
                            f"{peak / 2**20:>9,.0f} {growth / 2**20:>10,.0f} "
                            f"{growth / weights:>10.0%}")
                print(rows[-1], flush=True)


if __name__ == "__main__":
    main()
