"""Why a compiled stage runs its whole backward in B under zero bubble: the time of a split
backward (B: input gradients, then W: weight gradients) of compiled blocks against one whole
backward, with eager blocks beside them, on one thread.

A compiled layer's backward is one autograd node (AOTAutograd's compiled backward) that makes
its input and weight gradients together: B runs all of it to get the input gradients, and W
runs all of it again for the weight gradients. That second run needs the graph kept
(``retain_graph=True``), which torch refuses where the compiled backward reuses its saved
activations' memory ("donated buffers"), so this script turns donated buffers off to time it.

    python benchmarks/compile_split.py          # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch._functorch.config as functorch_config
from gpt_throughput import _imports
from timing import rotation

MICROBATCH, CONTEXT, BLOCKS = 4, 128, 3


def _passes(layers: list[Callable[..., torch.Tensor]], weights: list[torch.Tensor],
            x: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The forward with a whole backward, and with B then W, through ``layers``."""

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        start = x.clone().requires_grad_()
        out = start
        for layer in layers:
            out = layer(out)
        return start, out

    def whole() -> None:
        start, out = forward()
        torch.autograd.backward([out], [torch.ones_like(out)], inputs=[start, *weights])

    def split() -> None:
        start, out = forward()
        grad = torch.ones_like(out)
        torch.autograd.grad([out], [start], [grad], retain_graph=True)  # B
        torch.autograd.backward([out], [grad], inputs=weights)  # W

    return {"whole backward": whole, "B then W": split}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    functorch_config.donated_buffer = False  # else the compiled "B then W" is refused
    models, _ = _imports()
    blocks = list(models.gpt()[1 : 1 + BLOCKS])
    weights = [p for block in blocks for p in block.parameters()]
    x = torch.randn(MICROBATCH, CONTEXT, blocks[0].norm1.normalized_shape[0])
    compiled = [torch.compile(block) for block in blocks]
    runs = {f"{mode}, {name}": run
            for mode, layers in (("eager", blocks), ("compiled", compiled))
            for name, run in _passes(layers, weights, x).items()}
    for run in runs.values():  # warm-up: compiles
        run()
        run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in rotation(list(runs), r):
            for _ in range(args.repeats):
                start = time.perf_counter()
                runs[name]()
                times[name].append(time.perf_counter() - start)
    print(f"{BLOCKS} GPT blocks (dim 128), micro-batch {MICROBATCH} x {CONTEXT}, one thread, "
          f"torch {torch.__version__}; forward and backward, median of "
          f"{args.rounds * args.repeats}")
    for name, values in times.items():
        print(f"{name:<28}{statistics.median(values) * 1e3:>8.1f} ms")


if __name__ == "__main__":
    main()
