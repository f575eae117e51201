"""What a prediction of one step simulates: each stage's costs per micro-batch, read from a
plan or costed by the planner's model for a profile split by hand (``pipetrain simulate``).

No torch; the prediction itself is :func:`partitioner.planner.predict`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from partitioner.costs import pipeline_schedule
from partitioner.planner import cut_layers, predict, stage_costs
from partitioner.plans import Host, Plan
from partitioner.profile import Profile
from schedules import DEFAULT_SCHEDULE, Schedule, Simulation


@dataclass(frozen=True)
class StageTimes:
    """Per-stage costs of one pipeline and how it runs: seconds per micro-batch (``weight``:
    the part of ``backward`` a split backward runs as W), ``transfer`` per boundary,
    ``memory`` in bytes per stage where the cost model gives it (None for a plan's)."""

    schedule: str
    microbatches: int
    microbatch_size: int | None
    balance: list[int]
    forward: list[float]
    backward: list[float]
    weight: list[float]
    transfer: list[float]
    allreduce: list[float]
    memory: list[int] | None
    host: Host = field(default_factory=Host)
    virtual_stages: int = 2
    refused_cuts: list[int] = field(default_factory=list)  # cuts the profile does not allow

    @property
    def built(self) -> Schedule:
        """The schedule these costs run under, as the prediction builds it."""
        return pipeline_schedule(self.schedule, len(self.balance), self.microbatches,
                                 self.virtual_stages)

    def predict(self) -> Simulation:
        """The planner's prediction of one step with these costs."""
        return predict(
            self.schedule, self.microbatches, self.forward, self.backward, self.transfer,
            self.allreduce, self.host, weight=self.weight, virtual_stages=self.virtual_stages,
        )


def of_plan(
    plan: Plan, schedule: str | None = None, microbatches: int | None = None,
    host: Host | None = None,
) -> StageTimes:
    """A plan's own split and costs, run under ``schedule`` with ``microbatches`` on ``host``
    (each defaulting to the plan's)."""
    return StageTimes(
        schedule=schedule or plan.schedule,
        microbatches=microbatches or plan.microbatches,
        microbatch_size=plan.microbatch_size,
        balance=plan.balance,
        forward=[s.forward_time for s in plan.per_stage],
        backward=[s.backward_time for s in plan.per_stage],
        weight=[s.weight_time for s in plan.per_stage],
        transfer=[s.transfer_time for s in plan.per_stage[:-1]],
        allreduce=[s.allreduce_time for s in plan.per_stage],
        memory=None,
        host=host or plan.host,
        virtual_stages=plan.stages // plan.pipeline_ranks,
    )


def of_split(
    profile: Profile,
    balance: Sequence[int],
    *,
    microbatches: int,
    schedule: str = DEFAULT_SCHEDULE,
    microbatch_size: int | None = None,
    checkpoint: str = "never",
    bandwidth: float | str | None = None,
    virtual_stages: int = 2,
    host: Host | None = None,
) -> StageTimes:
    """The split ``balance`` of ``profile`` costed by the planner's model
    (:func:`partitioner.planner.stage_costs`), micro-batches of ``microbatch_size`` samples
    (default: the profile's batch), no data-parallel all-reduce."""
    size = microbatch_size or profile.batch_size
    costs = stage_costs(
        profile, balance, microbatches=microbatches, schedule=schedule, microbatch_size=size,
        checkpoint=checkpoint, bandwidth=bandwidth, virtual_stages=virtual_stages,
    )
    return StageTimes(
        schedule=schedule,
        microbatches=microbatches,
        microbatch_size=size,
        balance=list(balance),
        forward=[s.forward for s in costs],
        backward=[s.backward for s in costs],
        weight=[s.weight for s in costs],
        transfer=[s.message for s in costs[:-1]],
        allreduce=[0.0] * len(costs),
        memory=[s.memory for s in costs],
        host=host or Host(),
        virtual_stages=virtual_stages,
        refused_cuts=[c for c in cut_layers(balance) if not profile.cut_allowed(c)],
    )
