"""The ``pipetrain`` command: profile a model, plan its pipeline, simulate a schedule, train.

    pipetrain profile examples.models:resnet_like --input-shape 64,3,32,32 -o profile.json
    pipetrain plan profile.json --stages 4 --microbatches 8 --memory 16GiB \
        --bandwidth 25GB/s -o plan.json
    pipetrain plan pipedream:vgg16 --stages 4 --microbatches 8
    pipetrain simulate plan.json
    pipetrain simulate profile.json --balance 3,14 --microbatches 8 --schedule gpipe
    pipetrain train mymodule:task --plan plan.json --steps 100     (see
    pipetrain/tools/cli_train.py)

Exit status 0 on success and 2 on bad input (a file that is missing or malformed, a model that
cannot be imported, an input shape the model rejects, constraints nothing satisfies), with a
one-line message on stderr instead of a traceback. Only ``profile`` and ``train`` run torch code;
planning and simulating use the torch-free ``partitioner`` and ``schedules``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitioner import (
    Host,
    InfeasibleError,
    Plan,
    Profile,
    cut_layers,
    format_bytes,
    load_pipedream,
    parse_bytes,
    predict,
    stage_costs,
)
from pipetrain import __version__
from pipetrain.errors import CheckpointError
from pipetrain.tools.cli_train import add_train_command, json_kwargs
from schedules import Simulation, lookup, names

PROG = "pipetrain"
PIPEDREAM_PREFIX = "pipedream:"
OPTIMIZERS = ("sgd", "momentum", "rmsprop", "adagrad", "adam", "adamw")  # as tools/profiler.py


class UsageError(Exception):
    """Bad input from the command line: reported in one line, exit status 2."""


# -- helpers ------------------------------------------------------------------------------------


def _ints(text: str, what: str) -> list[int]:
    """``"64,3,32,32"`` (or ``64x3x32x32``) as positive integers."""
    parts = [p.strip() for p in text.replace("x", ",").split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{what} must be positive integers separated by commas, got {text!r}")
    return values


def _import_factory(target: str) -> Callable[..., Any]:
    """The function named by ``module.path:function`` or ``path/to/file.py:function``; for
    ``hf:DIR`` (a Hugging Face directory or config JSON), one that builds its layers."""
    if target.startswith("hf:"):
        from pipetrain.hf.task import layers

        return lambda: layers(target.removeprefix("hf:"))
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"expected MODULE:FUNCTION (e.g. examples.models:resnet_like), got {target!r}"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: modules of the current directory
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            if not path.is_file():
                raise UsageError(f"no such file: {module_name}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            assert spec is not None and spec.loader is not None
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except UsageError:
        raise
    except ModuleNotFoundError as error:
        raise UsageError(
            f"cannot import {module_name!r}: {error} (run from the directory that holds it, "
            "or put it on PYTHONPATH)"
        ) from None
    except Exception as error:
        raise UsageError(
            f"importing {module_name!r} failed: {type(error).__name__}: {error}"
        ) from None
    factory: Callable[..., Any] | None = getattr(module, attr, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(
            f"module {module_name!r} has no function {attr!r}; it has: {', '.join(names) or '-'}"
        )
    return factory


def _load_profile(source: str, batch_size: int | None) -> Profile:
    """A profile JSON, a PipeDream graph.txt (by path or ``pipedream:NAME``)."""
    if source.startswith("hf:"):
        raise UsageError(
            f"plan reads a profile; make one of {source} first: pipetrain profile {source} "
            "--meta --input-shape BATCH,SEQ --input-dtype int64 --input-high VOCAB "
            "-o profile.json"
        )
    if source.startswith(PIPEDREAM_PREFIX) or source.endswith(".txt"):
        name = source.removeprefix(PIPEDREAM_PREFIX)
        try:
            return load_pipedream(name, batch_size)
        except FileNotFoundError as error:
            raise UsageError(str(error).strip('"')) from None
    path = Path(source)
    if not path.is_file():
        raise UsageError(
            f"no such file: {source} (give a profile JSON from `pipetrain profile`, a PipeDream "
            "graph.txt or pipedream:NAME)"
        )
    if _format_of(path) == "pipetrain-plan":
        raise UsageError(f"{source} is a plan; give the profile it was made from")
    return Profile.load(path)


def _format_of(path: Path) -> str | None:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return data.get("format") if isinstance(data, dict) else None


def _need_matplotlib(instead: str) -> None:
    """Fail before any work when a picture is asked for but matplotlib is missing."""
    from pipetrain.observe.gantt import pyplot

    try:
        pyplot()
    except ImportError as error:
        raise UsageError(f"{error} (or {instead})") from None


def _save(text: str, path: str) -> None:
    try:
        Path(path).write_text(text + "\n")
    except OSError as error:
        raise UsageError(f"cannot write {path}: {error.strerror or error}") from None


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


# -- profile ------------------------------------------------------------------------------------


def _sample_input(shape: list[int], dtype_name: str, high: int | None, seed: int) -> Any:
    import torch

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


def _profile_table(profile: Profile) -> str:
    rows = [
        f"{'layer':<28} {'forward ms':>10} {'backward ms':>11} {'spread':>7} {'output':>11} "
        f"{'params':>11}"
    ]
    noisy = set(profile.noisy())
    for i, layer in enumerate(profile.layers):
        rows.append(
            f"{layer.name:<28} {_ms(layer.forward):>10} {_ms(layer.backward):>11} "
            f"{layer.spread:>7.0%} {format_bytes(layer.activation_bytes):>11} "
            f"{layer.param_count:>11,}" + (" noisy" if i in noisy else "")
            + (f"  (times of {layer.timed_as})" if layer.timed_as else "")
        )
    total = sum(layer.forward + layer.backward for layer in profile.layers)
    rows.append(
        f"{len(profile.layers)} layers, batch {profile.batch_size}, forward+backward "
        f"{total * 1e3:.3f} ms on {profile.device}"
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


def cmd_profile(args: argparse.Namespace) -> int:
    shape = _ints(args.input_shape, "--input-shape")
    try:
        kwargs = json_kwargs(args.kwargs)
    except ValueError as error:
        raise UsageError(str(error)) from None
    factory = _import_factory(args.model)

    import torch
    from torch import nn

    from pipetrain.tools.meta_profile import profile
    from pipetrain.tools.profiler import ProfileNoiseWarning, noise_message

    threads = args.threads or _threads_per_rank(args.ranks_per_node)
    torch.set_num_threads(threads)
    try:
        with torch.device("meta") if args.meta else contextlib.nullcontext():
            model = factory(**kwargs)
    except Exception as error:
        raise UsageError(
            f"{args.model}(**{kwargs}) failed: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Sequential):
        raise UsageError(f"{args.model} returned a {type(model).__name__}, not an nn.Sequential")
    sample = _sample_input(shape, args.input_dtype, args.input_high, args.seed)
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
            )
    except (ValueError, RuntimeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"profiling failed: {message}") from None
    print(_profile_table(result))
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
    if args.output:
        _save(result.to_json(), args.output)
        print(f"wrote {args.output}")
    return 0


# -- plan ---------------------------------------------------------------------------------------


def describe_plan(plan: Plan) -> str:
    """The plan as printed by ``pipetrain plan``: a summary line and :meth:`Plan.table`."""
    layers = sum(plan.balance)
    recomputing = [t for t, mode in enumerate(plan.checkpoints) if mode == "always"]
    said = f"recomputing on stages {recomputing}" if recomputing else "no stage recomputes"
    head = (
        f"{layers} layers -> {plan.stages} stages, balance {plan.balance}; {plan.schedule}, "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size} samples, checkpoint "
        f"{plan.checkpoint} ({said}), solver "
        f"{plan.solver}; profiled on {plan.device}"
    )
    return head + "\n" + plan.table() + "".join(f"\nnote: {n}" for n in schedule_notes(plan))


def schedule_notes(plan: Plan) -> list[str]:
    """What the prediction assumed of the plan's schedule beyond the profile."""
    notes = []
    if plan.pipeline_ranks < plan.stages:
        notes.append(
            f"{plan.schedule} runs the {plan.stages} stages on {plan.pipeline_ranks} ranks, "
            f"{plan.stages // plan.pipeline_ranks} virtual stages per rank (stage s on rank "
            f"s mod {plan.pipeline_ranks}); train with {plan.pipeline_ranks} devices"
        )
    if lookup(plan.schedule).split_backward:
        notes.append(
            f"{plan.schedule} splits each backward into B (input gradient) and W (weight "
            "gradient); the profile times only the whole backward, so W is taken as half of it "
            "for layers with parameters and 0 for the rest (the zero-bubble paper's B = W)"
        )
    return notes


def cmd_plan(args: argparse.Namespace) -> int:
    from partitioner import plan as make_plan

    profile = _load_profile(args.profile, args.batch_size)
    host = _host(args)
    try:
        result = make_plan(
            profile,
            stages=args.stages,
            microbatches=args.microbatches,
            schedule=args.schedule,
            memory=args.memory,
            bandwidth=args.bandwidth,
            devices=args.devices,
            checkpoint=args.checkpoint,
            microbatch_size=args.microbatch_size,
            solver=args.solver,
            cores=host.cores,
            overhead=host.overhead,
            virtual_stages=args.virtual_stages,
            zero=args.zero,
        )
    except InfeasibleError as error:
        message = " ".join(error.for_command_line().split())
        if error.smallest_cap is not None:
            cap = error.smallest_cap
            message += f" -- smallest memory cap that fits: --memory {cap} ({format_bytes(cap)})"
        raise UsageError(f"infeasible: {message}") from None
    print(describe_plan(result))
    if args.zero and any(len(stage.ranks) > 1 for stage in result.per_stage):
        print(f"memory: each replicated stage's share of what zero={args.zero} shards over its "
              f"replicas; train with Pipeline(..., zero={args.zero})")
    if args.output:
        _save(result.to_json(), args.output)
        print(f"wrote {args.output}")
    return 0


# -- simulate -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _StageCosts:
    """What ``simulate`` times: per-stage costs from a plan, or from a profile split by hand."""

    schedule: str
    microbatches: int
    size: int | None
    balance: list[int]
    forward: list[float]
    backward: list[float]
    weight: list[float]
    transfer: list[float]
    allreduce: list[float]
    memory: list[int] | None
    host: Host
    virtual_stages: int
    note: str = ""


def _is_plan(source: str) -> bool:
    return (
        not source.startswith(PIPEDREAM_PREFIX)
        and Path(source).is_file()
        and _format_of(Path(source)) == "pipetrain-plan"
    )


def _plan_costs(args: argparse.Namespace) -> _StageCosts:
    """A plan's own split, schedule and micro-batches, overridable from the command line."""
    plan = Plan.load(args.source)
    if args.balance is not None:
        raise UsageError("--balance is for a profile; a plan has its own balance")
    return _StageCosts(
        schedule=args.schedule or plan.schedule,
        microbatches=args.microbatches or plan.microbatches,
        size=plan.microbatch_size,
        balance=plan.balance,
        forward=[s.forward_time for s in plan.per_stage],
        backward=[s.backward_time for s in plan.per_stage],
        weight=[s.weight_time for s in plan.per_stage],
        transfer=[s.transfer_time for s in plan.per_stage[:-1]],
        allreduce=[s.allreduce_time for s in plan.per_stage],
        memory=None,
        host=_host(args, plan.host),
        virtual_stages=plan.stages // plan.pipeline_ranks,
    )


def _profile_costs(args: argparse.Namespace) -> _StageCosts:
    """A profile split by --balance, costed by the planner's model."""
    profile = _load_profile(args.source, args.batch_size)
    if args.balance is None:
        raise UsageError("simulating a profile needs --balance (layers per stage, e.g. 3,5)")
    balance = _ints(args.balance, "--balance")
    if args.microbatches is None:
        raise UsageError("simulating a profile needs --microbatches")
    schedule = args.schedule or "1f1b"
    size = args.microbatch_size or profile.batch_size
    costs = stage_costs(
        profile,
        balance,
        microbatches=args.microbatches,
        schedule=schedule,
        microbatch_size=size,
        checkpoint=args.checkpoint,
        bandwidth=args.bandwidth,
        virtual_stages=args.virtual_stages,
    )
    refused = [c for c in cut_layers(balance) if not profile.cut_allowed(c)]
    note = (
        f"note: the profile does not allow a cut after layer(s) {refused} (too many "
        "tensors cross there); the planner would not choose this split"
        if refused
        else ""
    )
    return _StageCosts(
        schedule=schedule,
        microbatches=args.microbatches,
        size=size,
        balance=balance,
        forward=[s.forward for s in costs],
        backward=[s.backward for s in costs],
        weight=[s.weight for s in costs],
        transfer=[s.message for s in costs[:-1]],
        allreduce=[0.0] * len(costs),
        memory=[s.memory for s in costs],
        host=_host(args),
        virtual_stages=args.virtual_stages,
        note=note,
    )


def _simulation_table(c: _StageCosts, result: Simulation) -> list[str]:
    """One row per stage, then the predicted step."""
    header = (
        f"{'stage':>5} {'layers':>11} {'forward ms':>10} {'backward ms':>11} {'send ms':>8} "
        f"{'busy ms':>9} {'bubble':>7} {'peak in-flight':>14}"
    )
    if c.memory is not None:
        header += f" {'memory':>11}"
    rows = [header]
    start = 0
    ranks = len(result.busy)  # fewer than the stages under "interleaved"
    for t, count in enumerate(c.balance):
        rank = t % ranks
        row = (
            f"{t:>5} {start:>5}-{start + count - 1:<5} {_ms(c.forward[t]):>10} "
            f"{_ms(c.backward[t]):>11} {_ms(c.transfer[t]) if t < len(c.transfer) else '-':>8} "
            f"{_ms(result.busy[rank]):>9} {result.stage_bubble(rank):>7.1%} "
            f"{result.peak_inflight[rank]:>14}"
        )
        if c.memory is not None:
            row += f" {format_bytes(c.memory[t]):>11}"
        rows.append(row)
        start += count
    rows.append(
        f"predicted step time {_ms(result.step_time)} ms, bubble fraction "
        f"{result.bubble_fraction:.1%}"
        + (
            f", {c.microbatches * c.size / result.step_time:,.1f} samples/s"
            if c.size and result.step_time > 0
            else ""
        )
        + c.host.describe()
    )
    if ranks < len(c.balance):
        rows.append(
            f"busy, bubble and peak in-flight are those of the stage's rank (stage s runs on "
            f"rank s mod {ranks})"
        )
        rows.append(f"peak in-flight micro-batches per rank: {list(result.peak_inflight)}")
    else:
        rows.append(f"peak in-flight micro-batches per stage: {list(result.peak_inflight)}")
    if c.note:
        rows.append(c.note)
    return rows


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.png:
        _need_matplotlib("leave out --png")
    c = _plan_costs(args) if _is_plan(args.source) else _profile_costs(args)
    try:
        result = predict(
            c.schedule, c.microbatches, c.forward, c.backward, c.transfer, c.allreduce, c.host,
            weight=c.weight, virtual_stages=c.virtual_stages,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(
        f"{c.schedule}, {len(c.balance)} stages, balance {c.balance}, {c.microbatches} "
        "micro-batches" + (f" of {c.size} samples" if c.size else "")
    )
    rows = _simulation_table(c, result)
    if args.png:
        from pipetrain.observe.gantt import draw

        picture = draw([(f"simulated {c.schedule}", result.timeline)], args.png)
        rows.append(f"timeline picture: {picture}")
    print("\n".join(rows))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    """Merge a run's per-rank traces; draw the measured step beside its simulated twin."""
    from pipetrain.observe.trace import report

    if not args.no_png:
        _need_matplotlib("pass --no-png")
    result = report(args.folder, png=not args.no_png, step=args.step)
    print(
        f"{result['ranks']} ranks, {result['steps']} steps traced (0..{result['steps'] - 1}); "
        f"step {result['step']}: measured "
        f"bubble {result['measured_bubble']:.1%}, simulated {result['simulated_bubble']:.1%} "
        "(the simulated twin: the schedule timed with this step's measured compute, runtime "
        "overhead, message latency and the ranks' entry times)"
    )
    overheads = ", ".join(f"{o * 1e3:.3f}" for o in result["overhead"])
    print(f"runtime overhead per action, ms per rank: {overheads} (for `plan --overhead-ms`)")
    print(f"Chrome/Perfetto trace: {result['trace']}")
    if "picture" in result:
        print(f"timeline picture: {result['picture']}")
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Save the newest checkpoint in a folder as one plain state_dict of the whole model:
    safetensors (written a stage at a time) for a .safetensors output, else torch.save."""
    import warnings

    import torch

    from pipetrain.checkpoints.checkpointing import consolidate, consolidate_safetensors

    output = Path(args.output)
    if not output.parent.is_dir():
        raise UsageError(f"{output.parent} does not exist; create it or write elsewhere (-o)")
    with warnings.catch_warnings(record=True) as fell_back:
        warnings.simplefilter("always")
        if args.hf is not None:
            from pipetrain.hf.save import save

            save(args.folder, args.hf, output, args.max_shard_size)
            count = len(list(output.glob("*.safetensors")))
            print(f"Hugging Face checkpoint ({count} safetensors file(s)) written to {output}")
            return 0
        if output.suffix == ".safetensors":
            count = consolidate_safetensors(args.folder, output)
        else:
            state = consolidate(args.folder)
            torch.save(state, output)
            count = len(state)
    for warning in fell_back:  # e.g. a bad `latest`: say which checkpoint was read, on one line
        print(f"{PROG} consolidate: warning: {warning.message}", file=sys.stderr)
    print(f"{count} tensors of the whole model written to {args.output}")
    return 0


# -- the parser ---------------------------------------------------------------------------------


def _add_planning_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-size",
        type=int,
        help="mini-batch size of a PipeDream graph.txt (inferred for image models)",
    )
    p.add_argument(
        "--microbatch-size",
        type=int,
        help="samples per micro-batch; times scale linearly from the profile's batch "
        "(default: the profile's batch size)",
    )
    p.add_argument("--bandwidth", help="between consecutive stages, e.g. 25GB/s or 100Gbit/s")
    p.add_argument(
        "--cores",
        type=int,
        help="the stages are processes sharing this many cores of one host (a CPU machine): "
        "predict with processor sharing, messages as copies at --bandwidth",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        default=2,
        help="under --schedule interleaved: stages per rank, so ranks = stages / this "
        "(default 2)",
    )
    p.add_argument(
        "--overhead-ms",
        type=float,
        help="the runtime's own time per action, as `pipetrain trace` reports it (default 0)",
    )


def _host(args: argparse.Namespace, default: Host | None = None) -> Host:
    """The --cores / --overhead-ms a prediction assumes (each defaulting to ``default``'s)."""
    default = default or Host()
    try:
        return Host(
            default.cores if args.cores is None else args.cores,
            default.overhead if args.overhead_ms is None else args.overhead_ms / 1e3,
        )
    except ValueError as error:
        raise UsageError(str(error)) from None


def _add_profile_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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
    p.add_argument("-o", "--output", help="write the profile JSON here")
    p.set_defaults(run=cmd_profile)


def _add_plan_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain plan``: its arguments."""
    p = sub.add_parser(
        "plan",
        help="split a profiled model into pipeline stages",
        description="Find the split with the least bottleneck under the memory cap and print "
        "its predicted step. PROFILE: a JSON from `pipetrain profile`, a PipeDream graph.txt, "
        "or pipedream:NAME for a bundled one (alexnet, vgg16, gnmt, resnet50, ...).",
    )
    p.add_argument("profile")
    p.add_argument("--stages", type=int, required=True)
    p.add_argument("--microbatches", type=int, required=True, help="micro-batches per step")
    p.add_argument("--schedule", default="1f1b", choices=names())
    p.add_argument("--memory", type=_bytes_arg, help="per device, e.g. 16GiB")
    p.add_argument(
        "--devices",
        type=int,
        help="devices in all (more than --stages replicates stages in data parallel)",
    )
    p.add_argument(
        "--zero",
        type=int,
        default=0,
        choices=[0, 1, 2, 3],
        help="what each replicated stage shards over its replicas, as Pipeline(zero=): 1 the "
        "optimizer state, 2 also the gradients, 3 also the weights (default 0: nothing)",
    )
    p.add_argument("--solver", default="auto", choices=["auto", "dp", "ilp"])
    p.add_argument(
        "--checkpoint",
        default="auto",
        choices=["never", "auto", "always"],
        help="activation recomputation: auto (default) recomputes on the stages whose memory "
        "cap needs it, always on every stage, never on none",
    )
    _add_planning_options(p)
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.set_defaults(run=cmd_plan)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Profile, plan and simulate pipeline-parallel training."
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _add_profile_command(sub)
    _add_plan_command(sub)

    p = sub.add_parser(
        "simulate",
        help="time a schedule for a plan, or for a profile split by --balance",
        description="Predict the step time, bubble fraction and peak in-flight micro-batches "
        "per stage. SOURCE: a plan JSON (its split, schedule and micro-batches, overridable), "
        "or a profile (JSON, graph.txt, pipedream:NAME) with --balance and --microbatches.",
    )
    p.add_argument("source")
    p.add_argument("--balance", help="layers per stage, e.g. 3,5 (for a profile)")
    p.add_argument("--microbatches", type=int)
    p.add_argument("--schedule", choices=names(), help="default: the plan's, or 1f1b")
    p.add_argument("--png", help="draw the simulated timeline here (needs matplotlib)")
    p.add_argument(
        "--checkpoint",
        default="never",
        choices=["never", "always"],
        help="for a profile: every stage recomputes its activations in backward, or none "
        "(default: never)",
    )
    _add_planning_options(p)
    p.set_defaults(run=cmd_simulate)

    p = sub.add_parser(
        "trace",
        help="merge a traced run into a Chrome trace and a timeline picture",
        description="FOLDER holds trace-rank*.json from Pipeline(trace=FOLDER) or "
        "PIPETRAIN_TRACE=FOLDER. Writes FOLDER/trace.json (Chrome/Perfetto) and "
        "FOLDER/timeline.png (the measured step above its simulated twin).",
    )
    p.add_argument("folder")
    p.add_argument(
        "--step", type=int, default=-1, help="which traced step to draw, from 0 (-1: the last)"
    )
    p.add_argument("--no-png", action="store_true", help="skip the picture")
    p.set_defaults(run=cmd_trace)

    p = sub.add_parser(
        "consolidate",
        help="turn a pipeline checkpoint into one plain state_dict",
        description="Read the newest checkpoint in FOLDER (from Pipeline.save or "
        "checkpoint_dir=...) and save the whole model's state_dict, loadable into the original "
        "nn.Sequential (or by Pipeline(weights=...), each rank reading its own stage). A "
        ".safetensors output is written one stage at a time, never the whole model in memory.",
    )
    p.add_argument("folder")
    p.add_argument(
        "-o", "--output", required=True,
        help="FILE.safetensors (safetensors, stage by stage) or any other name (torch.save); "
        "with --hf, a new directory",
    )
    p.add_argument(
        "--hf", metavar="CONFIG_DIR",
        help="write a Hugging Face checkpoint directory (config.json and the tokenizer files "
        "of CONFIG_DIR, safetensors shards, tied weights once) that "
        "AutoModelForCausalLM.from_pretrained loads; needs pipetrain[hf]",
    )
    p.add_argument("--max-shard-size", default="5GB", help="with --hf: bytes per shard")
    p.set_defaults(run=cmd_consolidate)
    add_train_command(sub, _import_factory)
    return parser


def _bytes_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command in ``argv`` (default: the process's arguments); return the exit status
    (2 for bad input, with a one-line message on stderr)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error argparse has already printed
        return exit_.code if isinstance(exit_.code, int) else 2
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train` passes them to torchrun
    try:
        return int(args.run(args))
    except (UsageError, ValueError, OSError, CheckpointError) as error:
        # ValueError covers the planner's ProfileError, PlanFileError and InfeasibleError.
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"{PROG} {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
