"""``pipetrain profile MODULE:FUNCTION --input-shape ...``: time a model layer by layer.

Builds FUNCTION's nn.Sequential (on the meta device with ``--meta``, one layer at a time),
runs a random input of ``--input-shape`` through it and prints, and with ``-o`` writes, the
profile the planner reads (pipetrain/tools/profiler.py, meta_profile.py).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch

from partitioner import Profile, format_bytes
from pipetrain.layer_tree import LayerTree, layer_tree
from pipetrain.tools.cli_common import PROG, UsageError, ints, json_kwargs, ms, save
from pipetrain.tools.cli_models import import_factory
from pipetrain.tools.meta_profile import profile
from pipetrain.tools.profiler import ProfileNoiseWarning, noise_message

OPTIMIZERS = ("sgd", "momentum", "rmsprop", "adagrad", "adam", "adamw")  # as tools/profiler.py


def sample_input(shape: list[int], dtype_name: str, high: int | None, seed: int) -> Any:
    """A random input of ``shape``: normal floats, or integers 0..``high``-1."""
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"unknown --input-dtype {dtype_name!r}; e.g. float32, bfloat16, int64")
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if high is None or high < 1:
        raise UsageError(
            f"an integer input ({dtype_name}) needs --input-high N (values are drawn from "
            "0..N-1, e.g. N = the vocabulary size)"
        )
    return torch.randint(0, high, shape, generator=g, dtype=dtype)


def profile_table(result: Profile) -> str:
    """The profile as ``pipetrain profile`` prints it: a row per layer, then the totals."""
    rows = [
        f"{'layer':<28} {'forward ms':>10} {'backward ms':>11} {'spread':>7} {'output':>11} "
        f"{'params':>11}"
    ]
    noisy = set(result.noisy())
    for i, layer in enumerate(result.layers):
        rows.append(
            f"{layer.name:<28} {ms(layer.forward):>10} {ms(layer.backward):>11} "
            f"{layer.spread:>7.0%} {format_bytes(layer.activation_bytes):>11} "
            f"{layer.param_count:>11,}" + (" noisy" if i in noisy else "")
            + (f"  (times of {layer.timed_as})" if layer.timed_as else "")
        )
    total = sum(layer.forward + layer.backward for layer in result.layers)
    rows.append(
        f"{len(result.layers)} layers, batch {result.batch_size}, forward+backward "
        f"{total * 1e3:.3f} ms on {result.device}"
    )
    return "\n".join(rows)


def _cores() -> int:
    """The processors this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _threads_per_rank(ranks_per_node: int) -> int:
    """What one of ``ranks_per_node`` training ranks gets of this machine's cores (as
    ``pipetrain.runtime.distributed.pin_to_cores`` slices them)."""
    if ranks_per_node < 1:
        raise UsageError(f"--ranks-per-node must be at least 1, got {ranks_per_node}")
    return max(1, _cores() // ranks_per_node)


def _factory(args: argparse.Namespace) -> tuple[Callable[..., Any], dict[str, Any]]:
    """FUNCTION and its ``--kwargs``."""
    try:
        kwargs = json_kwargs(args.kwargs)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return import_factory(args.model), kwargs


def _build(args: argparse.Namespace, factory: Callable[..., Any],
           kwargs: dict[str, Any]) -> LayerTree:
    """FUNCTION's model, on the meta device under ``--meta``."""
    try:
        with torch.device("meta") if args.meta else contextlib.nullcontext():
            model = factory(**kwargs)
    except Exception as error:
        raise UsageError(
            f"{args.model}(**{kwargs}) failed: {type(error).__name__}: {error}"
        ) from None
    try:
        return layer_tree(model, f"pipetrain profile {args.model}")
    except TypeError as error:
        raise UsageError(str(error)) from None


def cmd_profile(args: argparse.Namespace) -> int:
    shape = ints(args.input_shape, "--input-shape")
    factory, kwargs = _factory(args)
    threads = args.threads or _threads_per_rank(args.ranks_per_node)
    torch.set_num_threads(threads)
    model = _build(args, factory, kwargs)
    sample = sample_input(shape, args.input_dtype, args.input_high, args.seed)
    try:
        with warnings.catch_warnings():  # said below, in flags
            warnings.simplefilter("ignore", ProfileNoiseWarning)
            result = profile(
                model,
                sample,
                optimizer=args.optimizer,
                warmup=args.warmup,
                repeats=args.repeats,
                device=args.device,
                reuse_times=args.reuse_times,
                flops_per_second=args.flops_per_second,
            )
    except (ValueError, RuntimeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"profiling failed: {message}") from None
    print(profile_table(result))
    if args.flops_per_second is not None:  # counted, not timed: no threads, no noise
        return _saved(result, args.output)
    print(
        f"{threads} torch threads"
        + ("" if args.threads else f" (the {_cores()} cores / --ranks-per-node "
           f"{args.ranks_per_node}: what a rank of training gets; --threads to change)")
    )
    said = noise_message(
        result, args.repeats, f"more repeats (--repeats {max(2 * args.repeats, 10)})",
        "fewer --threads" if threads > 1 else "other ranks' work stopped",
    )
    if said is not None:
        print(f"{PROG} profile: warning: {said}", file=sys.stderr)
    return _saved(result, args.output)


def _saved(result: Profile, output: str | None) -> int:
    """Write the profile where ``--output`` says; the exit status."""
    if output:
        save(result.to_json(), output)
        print(f"wrote {output}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain profile``: its arguments."""
    p = sub.add_parser(
        "profile",
        help="measure a model layer by layer",
        description="Build MODULE:FUNCTION's nn.Sequential, run a random input of "
        "--input-shape through it and time every layer's forward and backward.",
    )
    p.add_argument(
        "model",
        help="MODULE:FUNCTION returning an nn.Sequential "
        "(e.g. examples.models:resnet_like, or path/to/file.py:make_model), or hf:DIR, a "
        "Hugging Face causal LM's directory or config JSON (pipetrain.hf.sequential of it)",
    )
    p.add_argument("--input-shape", required=True, help="e.g. 64,3,32,32 (dimension 0: batch)")
    p.add_argument("--input-dtype", default="float32", help="float32 (default), int64, ...")
    p.add_argument("--input-high", type=int, help="integer inputs are drawn from 0..N-1")
    p.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for FUNCTION")
    p.add_argument(
        "--optimizer",
        default="adam",
        choices=OPTIMIZERS,
        help="sets the optimizer state per parameter (default: adam, 2x)",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed runs per layer (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per layer (median; 5)")
    p.add_argument("--device", help="e.g. cuda:0 (default: cpu)")
    p.add_argument(
        "--threads",
        type=int,
        help="torch threads (default: the cores / --ranks-per-node, what each rank of training "
        "gets)",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        help="training ranks (stages) that will share this machine, for the default --threads "
        "(default: $LOCAL_WORLD_SIZE, else 1)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random input")
    p.add_argument(
        "--meta",
        action="store_true",
        help="build the model on the meta device (no memory) and time one layer at a time, "
        "for a model larger than this machine's memory",
    )
    p.add_argument(
        "--reuse-times",
        action="store_true",
        help="with --meta: time a run of identical layers once (the profile names the layer "
        "whose times each reuses)",
    )
    p.add_argument(
        "--flops-per-second",
        type=float,
        help="with --meta: build and time nothing; each layer's times are its FLOPs (counted "
        "on the meta device) at this rate, e.g. 4e14 for a GPU sustaining 400 TFLOP/s: an "
        "estimate for planning on devices this machine lacks",
    )
    p.add_argument("-o", "--output", help="write the profile JSON here")
    p.set_defaults(run=cmd_profile)
