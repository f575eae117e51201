"""Devices and links as a networkx graph, and the order in which a pipeline walks them.

Nodes are ranks (ints) with ``speed`` (compute speed relative to the profiled device, default 1)
and ``memory`` (bytes, absent = no cap); edges carry ``bandwidth`` (bytes/s). A pipeline's stages
talk only to their neighbours, so its devices are laid out as a chain; :func:`chain_order` walks
the widest links first, which keeps consecutive stages inside a node and crosses the slow network
as rarely as possible. The planner then knows the bandwidth of every link between consecutive
stages and puts the cuts that move many bytes on the fast ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import networkx as nx


def cluster(
    nodes: int,
    gpus_per_node: int,
    *,
    memory: int | None = None,
    intra_bandwidth: float = 300e9,
    inter_bandwidth: float = 25e9,
    speed: float = 1.0,
) -> nx.Graph:
    """``nodes`` x ``gpus_per_node`` identical GPUs, ranks node-major; GPUs of one node share a
    fast link (NVLink-like ``intra_bandwidth``), GPUs of different nodes the network."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError("a cluster needs at least one node with one GPU")
    graph = nx.Graph()
    ranks = range(nodes * gpus_per_node)
    for rank in ranks:
        attrs: dict[str, float | int] = {"speed": speed, "host": rank // gpus_per_node}
        if memory is not None:
            attrs["memory"] = memory
        graph.add_node(rank, **attrs)
    for a in ranks:
        for b in ranks[a + 1 :]:
            same = a // gpus_per_node == b // gpus_per_node
            graph.add_edge(a, b, bandwidth=intra_bandwidth if same else inter_bandwidth)
    return graph


def chain(
    speeds: Sequence[float],
    memories: Sequence[int | None],
    bandwidths: Sequence[float],
) -> nx.Graph:
    """Devices 0..n-1 linked in a line: device i has ``speeds[i]`` and ``memories[i]``, the link
    from i to i + 1 ``bandwidths[i]``."""
    if not len(speeds) == len(memories) == len(bandwidths) + 1:
        raise ValueError("a chain of n devices needs n speeds, n memories and n - 1 bandwidths")
    graph = nx.Graph()
    for rank, (speed, memory) in enumerate(zip(speeds, memories, strict=True)):
        graph.add_node(rank, speed=speed, **({} if memory is None else {"memory": memory}))
    for rank, bandwidth in enumerate(bandwidths):
        graph.add_edge(rank, rank + 1, bandwidth=bandwidth)
    return graph


def speed_of(graph: nx.Graph, rank: int) -> float:
    """Compute speed of a device (1.0 when not given)."""
    return float(graph.nodes[rank].get("speed", 1.0))


def memory_of(graph: nx.Graph, rank: int) -> int | None:
    """Memory of a device in bytes, None when not given."""
    memory = graph.nodes[rank].get("memory")
    return None if memory is None else int(memory)


def is_uniform(graph: nx.Graph) -> bool:
    """Whether all devices have the same speed and memory (links may differ)."""
    return len({(speed_of(graph, r), memory_of(graph, r)) for r in graph}) <= 1


def chain_order(graph: nx.Graph) -> list[int]:
    """The devices as a chain: from the lowest rank, always step to the unvisited device behind
    the widest link (lowest rank on ties); with no link to any, to the lowest unvisited rank."""
    if graph.number_of_nodes() == 0:
        raise ValueError("the device graph is empty")
    left = set(graph.nodes)
    here = min(left)
    order = [here]
    left.remove(here)
    while left:
        linked = [(graph.edges[here, n]["bandwidth"], -n, n) for n in graph[here] if n in left]
        here = max(linked)[2] if linked else min(left)
        order.append(here)
        left.remove(here)
    return order


def link_bandwidths(graph: nx.Graph, order: Sequence[int]) -> list[float]:
    """Bandwidth between consecutive devices of ``order``; for devices with no direct link, the
    narrowest link on the widest path between them."""
    out = []
    widest: nx.Graph | None = None
    for a, b in zip(order, order[1:], strict=False):
        if graph.has_edge(a, b):
            out.append(float(graph.edges[a, b]["bandwidth"]))
            continue
        if widest is None:
            widest = nx.maximum_spanning_tree(graph, weight="bandwidth")
        try:
            path = nx.shortest_path(widest, a, b)
        except nx.NetworkXNoPath:
            raise ValueError(f"devices {a} and {b} are not connected") from None
        out.append(
            min(
                float(widest.edges[u, v]["bandwidth"]) for u, v in zip(path, path[1:], strict=False)
            )
        )
    return out
