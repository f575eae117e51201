"""``pipetrain train MODULE:FUNCTION --plan plan.json --steps N``: train a user's model.

FUNCTION returns a :class:`pipetrain.TrainTask`. Started from a shell, the command
launches torchrun on this machine with one process per rank of the plan (``--nproc`` for more:
replicas) and the same arguments; under torchrun (a rank, e.g. ``torchrun --nnodes=2 ... -m
pipetrain train ...`` on a cluster) it trains.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from partitioner import Plan
from pipetrain.checkpoints.restart import check_start
from pipetrain.runtime.distributed import init_distributed, shutdown
from pipetrain.runtime.planning import load_plan
from pipetrain.tools.cli_common import json_kwargs
from pipetrain.tools.cli_models import import_factory
from pipetrain.tools.task import Run, TrainTask, check_batch, train, under_torchrun


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain train``: its arguments."""
    p = sub.add_parser(
        "train",
        help="train MODULE:FUNCTION's model with a plan, one process per rank",
        description="Train the model of the pipetrain.TrainTask that MODULE:FUNCTION returns "
        "(model, loss_fn, optimizer factory, batch(step)) with the plan's split, schedule and "
        "micro-batches. From a shell it starts torchrun with one process per rank; under "
        "torchrun it trains.",
    )
    p.add_argument("task", help="MODULE:FUNCTION (or path/to/file.py:FUNCTION) returning a "
                   "pipetrain.TrainTask")
    p.add_argument("--plan", required=True, help="a plan JSON from `pipetrain plan`")
    p.add_argument("--steps", type=int, required=True, help="train until this many steps are done")
    p.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments for FUNCTION")
    p.add_argument("--checkpoint-dir", help="save here (at the start, every --checkpoint-every "
                   "steps and at the end); resume from it when torchrun restarts the job")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between saves")
    p.add_argument("--resume", action="store_true",
                   help="resume from the newest checkpoint in --checkpoint-dir")
    p.add_argument("--fresh", action="store_true",
                   help="start a new run in a --checkpoint-dir that holds an earlier run's "
                   "checkpoints (they are kept: a run prunes only its own); without it, or "
                   "--resume, such a folder is refused")
    p.add_argument("--log-every", type=int, default=10, help="print the loss every N steps")
    p.add_argument("--nproc", type=int, help="processes to start (default: the plan's ranks; a "
                   "multiple of them adds replicas)")
    p.add_argument("--compile", action="store_true",
                   help="run each layer of every stage through torch.compile "
                   "(Pipeline(compile=True)): a C++ compiler on a CPU, triton on a GPU")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="torchrun restarts after a failure (resuming from --checkpoint-dir)")
    p.set_defaults(run=cmd_train)


def _check(args: argparse.Namespace) -> tuple[Plan, dict[str, Any]]:
    """The plan and FUNCTION's keyword arguments; a ValueError naming the bad option."""
    if args.steps < 1:
        raise ValueError(f"--steps must be at least 1, got {args.steps}")
    if args.resume and args.checkpoint_dir is None:
        raise ValueError("--resume needs --checkpoint-dir (the folder to resume from)")
    if args.fresh and args.checkpoint_dir is None:
        raise ValueError("--fresh needs --checkpoint-dir (the folder to start a new run in)")
    if args.resume and args.fresh:
        raise ValueError("--resume and --fresh exclude each other: resume the run in "
                         "--checkpoint-dir, or start a new one beside it")
    if args.checkpoint_every and args.checkpoint_dir is None:
        raise ValueError("--checkpoint-every needs --checkpoint-dir (where to save)")
    return Plan.load(args.plan), json_kwargs(args.kwargs)


def cmd_train(args: argparse.Namespace) -> int:
    plan, kwargs = _check(args)
    factory = import_factory(args.task)
    if not under_torchrun():
        _task(args.task, factory, kwargs, plan, _processes(args, plan))
        if args.checkpoint_dir is not None:  # an earlier run's checkpoints: refused here
            check_start(args.checkpoint_dir, args.resume, args.fresh)
        return _launch(args, plan)
    rank, world = init_distributed()
    task = _task(args.task, factory, kwargs, plan, world)
    run = Run(args.steps, args.checkpoint_dir, args.checkpoint_every, args.resume,
              args.log_every, args.fresh, args.compile)
    loss = train(task, plan, run, world, rank)
    if rank == 0:
        ending = f", last loss {loss:.4f}" if loss is not None else " (nothing left to train)"
        saved = f"; checkpoint in {args.checkpoint_dir}" if args.checkpoint_dir else ""
        print(f"trained to step {args.steps}{ending}{saved}", flush=True)
    shutdown()


def _processes(args: argparse.Namespace, plan: Plan) -> int:
    """--nproc, else the plan's ranks in every copy of its pipeline."""
    return int(args.nproc or plan.pipeline_ranks * plan.data_parallel)


def _task(target: str, factory: Callable[..., Any], kwargs: dict[str, Any], plan: Plan,
          world: int) -> Any:
    """FUNCTION's TrainTask, checked against the plan (its model's layers, the size of step 0's
    batch for ``world`` ranks): the launcher checks it before any process starts."""
    task = factory(**kwargs)
    if not isinstance(task, TrainTask):
        raise ValueError(
            f"{target} returned a {type(task).__name__}, not a pipetrain.TrainTask: return "
            "TrainTask(model, loss_fn, optimizer, batch)"
        )
    load_plan(plan, task.model)
    if world % plan.pipeline_ranks:
        raise ValueError(f"the plan runs {plan.pipeline_ranks} ranks per pipeline but {world} "
                         f"ranks were asked for: start a multiple of {plan.pipeline_ranks}")
    replicas = world // plan.pipeline_ranks
    expected = plan.microbatches * plan.microbatch_size * replicas
    check_batch(*task.batch(0), 0, expected, plan, replicas)
    return task


def _launch(args: argparse.Namespace, plan: Plan) -> int:
    """Run this very command under torchrun on this machine; its exit status."""
    return subprocess.call(torchrun_command(args, plan))


def torchrun_command(args: argparse.Namespace, plan: Plan) -> list[str]:
    """torchrun starting this command once per process. ``--nproc`` is said to torchrun and
    left out of the ranks' arguments: torchrun's parser reads every option, the script's too,
    and takes ``--nproc`` for an ambiguous abbreviation of its ``--nproc-per-node``."""
    argv, value_of_nproc = [], False
    for arg in args.argv:
        if value_of_nproc or arg.startswith("--nproc="):
            value_of_nproc = False
        elif arg == "--nproc":
            value_of_nproc = True
        else:
            argv.append(arg)
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc_per_node={_processes(args, plan)}", f"--max-restarts={args.max_restarts}",
        "-m", "pipetrain", *argv,
    ]
