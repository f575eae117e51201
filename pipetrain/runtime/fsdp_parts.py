"""The parts of FSDP2 that ZeRO 2 and 3 (:mod:`pipetrain.runtime.sharding`) read beyond its
public API, on every torch pipetrain claims (2.9 through the newest).

torch keeps these private and renames them between releases: this module is the one place
that knows each release's names, keyed on what the running torch has (a release is known by
its parts, so a backport or a nightly is read right too), and tests/runtime/test_fsdp_parts.py,
run on each torch CI runs, proves every part is there. A part a future torch drops is an
error naming the part, the torch and what runs instead, not an AttributeError mid-step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard


def private(owner: object, name: str) -> Any:
    """``owner.name``; its absence is an error naming the part and the torch."""
    try:
        return getattr(owner, name)
    except AttributeError as error:
        raise RuntimeError(
            f"zero=2|3 needs FSDP2's {name!r} of {type(owner).__name__} (for a split-backward "
            f"schedule's reduce and for weights without gradients), which torch "
            f"{torch.__version__} lacks (pipetrain reads torch 2.9 through 2.14's): use zero=1"
        ) from error


def state(module: nn.Module) -> Any:
    """FSDP2's state of a ``fully_shard``ed ``module``."""
    return private(fully_shard, "state")(module)


def param_groups(own: Any) -> list[Any]:
    """The parameter groups of an FSDP2 state: a list on newer torch, one group (or None)
    through torch 2.10."""
    if hasattr(own, "_fsdp_param_groups"):
        return list(own._fsdp_param_groups)
    group = private(own, "_fsdp_param_group")
    return [] if group is None else [group]


def all_states(module: nn.Module) -> list[Any]:
    """Every FSDP2 state under the root ``module`` (the root's own included)."""
    return list(private(private(state(module), "_state_ctx"), "all_states"))


def reduce_unused_weights(module: nn.Module) -> None:
    """Have every reduce-scatter under ``module`` reduce all of its group's weights, with
    zeros for those this replica made no gradient for, so every replica's reduce-scatters have
    the same sizes. Newer torch does it itself (``set_reduce_scatter_unused_params``); on older
    ones each group's ``post_backward`` first gives such weights a zero gradient."""
    if isinstance(module, FSDPModule) and hasattr(module, "set_reduce_scatter_unused_params"):
        module.set_reduce_scatter_unused_params(True)
        return
    for part in module.modules():
        if isinstance(part, FSDPModule):
            for group in param_groups(state(part)):
                group.post_backward = _zero_filling(group, private(group, "post_backward"))


# FSDP2's parameter-group methods that run or wait for its collectives: the all-gather of the
# weights (issued, awaited), the reduce-scatter of the gradients (issued; awaited at the end)
COLLECTIVES = {
    "unshard": "FSDP2's all-gather of the sharded weights",
    "wait_for_unshard": "FSDP2's all-gather of the sharded weights",
    "post_backward": "FSDP2's reduce-scatter of the gradients",
    "finalize_backward": "FSDP2's reduce-scatter of the gradients",
}


def name_collective_failures(
    module: nn.Module, bounded: Callable[[str, Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace each collective method of COLLECTIVES of every FSDP2 parameter group under
    ``module`` by ``bounded(what, method)`` (what the collective is, the method), which names
    the replica lost in it (collectives.Collectives.bounded)."""
    for part in module.modules():
        if isinstance(part, FSDPModule):
            for group in param_groups(state(part)):
                for name, what in COLLECTIVES.items():
                    setattr(group, name, bounded(what, private(group, name)))


def _zero_filling(group: Any, post_backward: Any) -> Any:
    """``post_backward`` of ``group``, first giving a zero gradient to each gathered weight
    without one when the group reduces (older torch reduces only the weights with one)."""

    def filled(*args: Any) -> Any:
        if private(group, "reduce_grads"):
            for weight in private(group, "fsdp_params"):
                try:
                    gathered = weight.unsharded_param
                except AttributeError:  # never gathered: the group never ran
                    continue
                if gathered.grad is None and weight.unsharded_accumulated_grad is None:
                    gathered.grad = torch.zeros_like(gathered)
        return post_backward(*args)

    return filled
