"""``pipetrain plan PROFILE --stages S --microbatches M``: split a profiled model into stages.

The planner (``partitioner.plan``) finds the split; this module reads the command line and
prints the plan with what its prediction assumed.
"""

from __future__ import annotations

import argparse

from partitioner import InfeasibleError, Plan, format_bytes, plan
from partitioner.costs import pipeline_schedule
from pipetrain.tools.cli_common import (
    UsageError,
    add_planning_options,
    bytes_arg,
    host,
    load_profile,
    save,
)
from pipetrain.tools.cli_search import cmd_search
from schedules import DEFAULT_SCHEDULE, Schedule, lookup, names


def describe_plan(plan: Plan) -> str:
    """The plan as printed by ``pipetrain plan``: a summary line and :meth:`Plan.table`."""
    layers = sum(plan.balance)
    recomputing = [t for t, mode in enumerate(plan.checkpoints) if mode == "always"]
    said = f"recomputing on stages {recomputing}" if recomputing else "no stage recomputes"
    head = (
        f"{layers} layers -> {plan.stages} stage{'s' if plan.stages != 1 else ''}, balance "
        f"{plan.balance}; {plan.schedule}, "
        f"{plan.microbatches} micro-batch{'es' if plan.microbatches != 1 else ''} of "
        f"{plan.microbatch_size} sample{'s' if plan.microbatch_size != 1 else ''}, checkpoint "
        f"{plan.checkpoint} ({said}), solver "
        f"{plan.solver}; profiled on {plan.device}"
    )
    return head + "\n" + plan.table() + "".join(f"\nnote: {n}" for n in schedule_notes(plan))


def _built(plan: Plan) -> Schedule:
    """The plan's schedule, built as the planner did."""
    virtual = plan.stages // plan.pipeline_ranks
    return pipeline_schedule(plan.schedule, plan.stages, plan.microbatches, virtual)


def schedule_notes(plan: Plan) -> list[str]:
    """What the prediction assumed of the plan's schedule beyond the profile."""
    notes = []
    if plan.pipeline_ranks < plan.stages:
        notes.append(
            f"{plan.schedule} runs the {plan.stages} stages on {plan.pipeline_ranks} ranks, "
            f"{plan.stages // plan.pipeline_ranks} virtual stages per rank ("
            f"{_built(plan).placement_text()}); train with "
            f"{plan.pipeline_ranks * plan.data_parallel} devices"
        )
    if lookup(plan.schedule).split_backward:
        notes.append(
            f"{plan.schedule} splits each backward into B (input gradient) and W (weight "
            "gradient); the profile times only the whole backward, so W is taken as half of it "
            "for layers with parameters and 0 for the rest (the zero-bubble paper's B = W)"
        )
    return notes


def cmd_plan(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile, args.batch_size)
    if args.stages is None or args.microbatches is None:
        return cmd_search(profile, args, describe_plan)
    if args.explain:
        raise UsageError("--explain shows the search's frontier: leave out --stages or "
                         "--microbatches to search")
    on = host(args)
    zero = args.zero or 0
    try:
        result = plan(
            profile,
            stages=args.stages,
            microbatches=args.microbatches,
            schedule=args.schedule or DEFAULT_SCHEDULE,
            memory=args.memory,
            bandwidth=args.bandwidth,
            devices=args.devices,
            checkpoint=args.checkpoint,
            microbatch_size=args.microbatch_size,
            solver=args.solver,
            cores=on.cores,
            overhead=on.overhead,
            virtual_stages=args.virtual_stages,
            zero=zero,
            reduce_scatter=args.reduce_scatter,
        )
    except InfeasibleError as error:
        message = " ".join(error.for_command_line().split())
        if error.smallest_cap is not None:
            cap = error.smallest_cap
            message += f" -- smallest memory cap that fits: --memory {cap} ({format_bytes(cap)})"
        raise UsageError(f"infeasible: {message}") from None
    print(describe_plan(result))
    if zero and any(len(stage.ranks) > 1 for stage in result.per_stage):
        train = f"zero={zero}"
        if zero >= 2:
            train += f", reduce_scatter={result.reduce_scatter!r}"
            print(f"reduce_scatter: {result.reduce_scatter} (gradients "
                  + ("sharded, a reduce-scatter per micro-batch)" if result.reduce_scatter
                     == "microbatch" else "whole during the step, one reduce-scatter)"))
        print(f"memory: each replicated stage's share of what zero={zero} shards over its "
              f"replicas; train with Pipeline(..., {train})")
    if args.output:
        save(result.to_json(), args.output)
        print(f"wrote {args.output}")
    return 0


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``pipetrain plan``: its arguments."""
    p = sub.add_parser(
        "plan",
        help="split a profiled model into pipeline stages, or plan the whole run",
        description="With --stages and --microbatches: find the split with the least "
        "bottleneck under the memory cap and print its predicted step. Without either (with "
        "--devices N --batch-size B): search the pipeline ranks x data-parallel copies, the "
        "schedule, the micro-batch count and the ZeRO level for the fastest plan that fits, "
        "honouring those fixed by --stages, --microbatches, --schedule or --zero. PROFILE: a "
        "JSON from `pipetrain profile`, a PipeDream graph.txt, or pipedream:NAME for a bundled "
        "one (alexnet, vgg16, gnmt, resnet50, ...).",
    )
    p.add_argument("profile")
    p.add_argument("--stages", type=int,
                   help="pipeline stages (in a search: ranks per copy of the pipeline)")
    p.add_argument("--microbatches", type=int, help="micro-batches per step")
    p.add_argument("--schedule", choices=names(),
                   help=f"the schedule (default {DEFAULT_SCHEDULE}; in a search: every one)")
    p.add_argument("--memory", type=bytes_arg, help="per device, e.g. 16GiB")
    p.add_argument(
        "--devices",
        type=int,
        help="devices in all (more than --stages replicates stages in data parallel)",
    )
    p.add_argument(
        "--zero",
        type=int,
        choices=[0, 1, 2, 3],
        help="what each replicated stage shards over its replicas, as Pipeline(zero=): 1 the "
        "optimizer state, 2 also the gradients, 3 also the weights (default 0: nothing; in a "
        "search: every level)",
    )
    p.add_argument(
        "--reduce-scatter",
        default="auto",
        choices=["auto", "step", "microbatch"],
        help="at --zero 2 and 3, when each stage reduce-scatters its gradients, as "
        "Pipeline(reduce_scatter=): step (whole gradients through the step, one reduce-scatter), "
        "microbatch (their shards, a reduce-scatter per micro-batch), auto (default: the faster "
        "plan that fits)",
    )
    p.add_argument("--solver", default="auto", choices=["auto", "dp", "ilp"])
    p.add_argument(
        "--checkpoint",
        default="auto",
        choices=["never", "auto", "always"],
        help="activation recomputation: auto (default) recomputes on the stages whose memory "
        "cap needs it, always on every stage, never on none",
    )
    add_planning_options(p)
    p.add_argument("-o", "--output", help="write the plan JSON here")
    p.add_argument("--explain", action="store_true",
                   help="in a search: also print the time-vs-memory frontier it searched")
    p.set_defaults(run=cmd_plan)
