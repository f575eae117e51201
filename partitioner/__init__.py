"""Plan a pipeline: split a profiled model into stages and place them on devices.

Pure Python with numpy, networkx and pulp (the last two imported only when planning); never
imports torch, so a 1000-GPU job is planned on a laptop. Units: seconds and bytes everywhere.
"""

import importlib
from typing import TYPE_CHECKING, Any

from partitioner.costs import Problem, inflight, make_problem, problem_from_profile
from partitioner.dp import Split, balance, smallest_cap, solve
from partitioner.errors import (
    InfeasibleError,
    PlanFileError,
    PlanMismatchError,
    PlannerError,
    ProfileError,
    Remedy,
)
from partitioner.plans import Host, Plan, StagePlan
from partitioner.profile import Boundary, LayerCost, Profile, with_fixed_times
from partitioner.units import format_bytes, parse_bandwidth, parse_bytes

# The names below need networkx or pulp, which only planning uses: they load on first use, so
# reading a plan or a profile (all `import pipetrain` needs) does not import either.
_LAZY = {
    "solve_ilp": "partitioner.ilp",
    "load_pipedream": "partitioner.pipedream",
    "parse_graph": "partitioner.pipedream",
    "cut_layers": "partitioner.planner",
    "plan": "partitioner.planner",
    "predict": "partitioner.planner",
    "simulate_split": "partitioner.planner",
    "stage_costs": "partitioner.planner",
    "chain": "partitioner.topology",
    "chain_order": "partitioner.topology",
    "cluster": "partitioner.topology",
}
if TYPE_CHECKING:
    from partitioner.ilp import solve_ilp
    from partitioner.pipedream import load_pipedream, parse_graph
    from partitioner.planner import cut_layers, plan, predict, simulate_split, stage_costs
    from partitioner.topology import chain, chain_order, cluster


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'partitioner' has no attribute {name!r}")


__all__ = [
    "Boundary",
    "Host",
    "InfeasibleError",
    "LayerCost",
    "Plan",
    "PlanFileError",
    "PlanMismatchError",
    "PlannerError",
    "Problem",
    "Profile",
    "ProfileError",
    "Remedy",
    "Split",
    "StagePlan",
    "balance",
    "chain",
    "chain_order",
    "cluster",
    "cut_layers",
    "format_bytes",
    "inflight",
    "load_pipedream",
    "make_problem",
    "parse_bandwidth",
    "parse_bytes",
    "parse_graph",
    "plan",
    "predict",
    "problem_from_profile",
    "simulate_split",
    "smallest_cap",
    "solve",
    "solve_ilp",
    "stage_costs",
    "with_fixed_times",
]
