"""Start-up check that every rank of a pipeline built the same configuration.

Ranks that pass a different balance, chunk count, schedule or model would otherwise train
silently wrong (a layer on two stages, or on none). Each rank gathers every rank's
fingerprint over the pipeline's process group (created with the pipeline's timeout, which
bounds the gather: a stopped or dead peer is a CommunicationTimeout or PeerError naming it,
collectives.py) and refuses to start, naming what differs and on which rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from pipetrain.layer_tree import LayerTree

if TYPE_CHECKING:
    from pipetrain.runtime.collectives import Collectives


def fingerprint(model: LayerTree, **settings: Any) -> dict[str, Any]:
    """What must agree across ranks: ``settings`` (balance, chunks, schedule, ...) and the
    model's layers with their parameter shapes and dtypes."""
    layers = [
        f"{i}: {type(layer).__name__} "
        + ", ".join(f"{n}{tuple(p.shape)} {str(p.dtype)[6:]}" for n, p in layer.named_parameters())
        for i, layer in enumerate(model)
    ]
    return {**{k: repr(v) for k, v in settings.items()}, "model": layers}


def differences(mine: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Each setting that differs, as 'name: mine vs theirs' (a model: its first other layer)."""
    found = []
    for key in sorted(mine.keys() | theirs.keys()):
        a, b = mine.get(key), theirs.get(key)
        if a == b:
            continue
        if key == "model" and isinstance(a, list) and isinstance(b, list):
            other = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if other is None:
                found.append(f"model: {len(a)} layers here vs {len(b)}")
            else:
                found.append(f"model layer {a[other]!r} here vs {b[other]!r}")
        else:
            found.append(f"{key}: {a} here vs {b}")
    return found


def check_same(
    mine: dict[str, Any], group: dist.ProcessGroup, ranks: list[int], collectives: Collectives
) -> None:
    """Raise ValueError on every rank of ``group`` unless all built ``mine`` (``collectives``
    bounds the gather and names a peer that does not answer)."""
    every: list[Any] = [None] * len(ranks)
    collectives.call("the start-up check of the settings", [group],
                     lambda: dist.all_gather_object(every, mine, group=group))
    for rank, theirs in zip(ranks, every, strict=True):
        found = differences(mine, theirs)
        if found:
            raise ValueError(
                f"rank {dist.get_rank()} and rank {rank} built different pipelines ("
                + "; ".join(found) + "); pass the same configuration on every rank"
            )
