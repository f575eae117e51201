"""Device graphs: chain order, link bandwidths, and plans that put heavy cuts on fast links."""

from __future__ import annotations

import random

import networkx as nx
import pytest

from partitioner import LayerCost, Profile, chain, chain_order, cluster, plan
from partitioner.costs import problem_from_profile
from partitioner.dp import split_of
from partitioner.topology import is_uniform, link_bandwidths


def test_cluster_builds_fast_links_inside_nodes() -> None:
    graph = cluster(2, 4, memory=2**30, intra_bandwidth=100.0, inter_bandwidth=1.0)
    assert graph.number_of_nodes() == 8 and is_uniform(graph)
    assert graph.edges[0, 3]["bandwidth"] == 100.0 and graph.edges[3, 4]["bandwidth"] == 1.0


def test_chain_order_crosses_the_network_once_per_node() -> None:
    graph = cluster(3, 4, intra_bandwidth=100.0, inter_bandwidth=1.0)
    relabel = list(range(12))
    random.Random(0).shuffle(relabel)  # ranks no longer follow nodes
    shuffled = nx.relabel_nodes(graph, dict(enumerate(relabel)))
    order = chain_order(shuffled)
    assert sorted(order) == list(range(12))
    hosts = [shuffled.nodes[r]["host"] for r in order]
    assert sum(a != b for a, b in zip(hosts, hosts[1:], strict=False)) == 2
    assert sorted(link_bandwidths(shuffled, order)) == [1.0, 1.0] + [100.0] * 9


def test_link_bandwidth_without_a_direct_edge_is_the_widest_path() -> None:
    graph = chain([1.0, 1.0, 1.0], [None, None, None], [5.0, 2.0])
    assert link_bandwidths(graph, [0, 2, 1]) == [2.0, 2.0]


def _profile() -> Profile:
    # Alternating light and heavy outputs: where the cuts fall decides the bytes on each link.
    layers = [LayerCost(f"l{i}", 1.0, 2.0, 10**9 if i % 2 == 1 else 10**6, 0, 0) for i in range(12)]
    return Profile(device="gpu", batch_size=1, layers=layers)


def test_heavy_cuts_go_on_fast_links() -> None:
    graph = cluster(2, 2, intra_bandwidth=1e12, inter_bandwidth=1e8)
    profile = _profile()
    aware = plan(profile, stages=4, microbatches=4, devices=graph)
    assert aware.solver == "dp"
    slow_link = 1  # stages 1 and 2 sit on different nodes
    assert aware.per_stage[slow_link].transfer_bytes == 10**6
    # The split that assumes every link is fast costs more once it meets the real network.
    naive = plan(profile, stages=4, microbatches=4, bandwidth=1e12)
    real = problem_from_profile(
        profile, stages=4, microbatches=4, bandwidth=link_bandwidths(graph, chain_order(graph))
    )
    naive_real = split_of(real, [0, *[s.layers[1] for s in naive.per_stage]], [1] * 4)
    assert aware.bottleneck < naive_real.bottleneck


def test_unlike_devices_use_the_integer_program_and_respect_speed() -> None:
    graph = chain([1.0, 3.0], [None, None], [1e12])
    result = plan(_profile(), stages=2, microbatches=2, devices=graph)
    assert result.solver == "ilp"
    assert result.balance[1] > result.balance[0]  # the faster device takes more layers
    dp = plan(_profile(), stages=2, microbatches=2, devices=graph, solver="dp")
    assert dp.bottleneck == pytest.approx(result.bottleneck, rel=1e-6)


def test_device_memory_caps_the_plan() -> None:
    profile = Profile(
        device="gpu",
        batch_size=1,
        layers=[LayerCost(f"l{i}", 1.0, 1.0, 0, 10, 100 * (i + 1)) for i in range(6)],
    )
    graph = chain([1.0, 1.0], [700, 10**6], [1e9])
    result = plan(profile, stages=2, microbatches=2, devices=graph)
    assert result.per_stage[0].memory_bytes <= 700


def test_a_graph_needs_one_device_per_stage() -> None:
    with pytest.raises(ValueError, match="one device per stage"):
        plan(_profile(), stages=3, microbatches=2, devices=cluster(1, 4))
