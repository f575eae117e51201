"""Plan a pipeline: split a profiled model into stages and place them on devices.

Pure Python with numpy, networkx and pulp; never imports torch, so a 1000-GPU job is planned on a
laptop. Units: seconds and bytes everywhere.
"""

from partitioner.costs import Problem, inflight, make_problem, problem_from_profile
from partitioner.dp import Split, balance, smallest_cap, solve
from partitioner.errors import (
    InfeasibleError,
    PlanFileError,
    PlanMismatchError,
    PlannerError,
    ProfileError,
)
from partitioner.ilp import solve_ilp
from partitioner.pipedream import load_pipedream, parse_graph
from partitioner.planner import cut_layers, plan, predict, simulate_split, stage_costs
from partitioner.plans import Host, Plan, StagePlan
from partitioner.profile import Boundary, LayerCost, Profile
from partitioner.topology import chain, chain_order, cluster
from partitioner.units import format_bytes, parse_bandwidth, parse_bytes

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
]
