"""PipeDream's graph.txt profiles parse, cross their cuts correctly and plan end to end."""

from __future__ import annotations

import re

import networkx as nx
import pytest

from partitioner import InfeasibleError, load_pipedream, parse_graph, plan
from partitioner.pipedream import DATA_DIR, available, read_graph

REQUIRED = ["alexnet", "gnmt", "inception_v3", "resnet50", "vgg16"]


def _load(name: str):
    return load_pipedream(name, batch_size=64 if name.startswith("gnmt") else None)


def test_the_required_profiles_ship_with_their_license() -> None:
    assert set(REQUIRED) <= set(available())
    notice = (DATA_DIR / "README.md").read_text() + (DATA_DIR / "LICENSE").read_text()
    assert "Microsoft" in notice and "MIT" in notice


@pytest.mark.parametrize("name", available())
def test_layers_keep_the_file_numbers_in_seconds(name: str) -> None:
    text = (DATA_DIR / f"{name}.graph.txt").read_text()
    profile = _load(name)
    raw, kind = {}, {}
    for line in text.splitlines():
        if line and not line[0].isspace():
            node, kind[node] = line.split(" -- ")[:2]
            raw[node] = {k: v for k, v in re.findall(r"(\w+)=([-0-9.e]+)", line)}
    for layer in profile.layers:
        node = layer.name.split(":")[0]
        assert layer.forward == pytest.approx(float(raw[node]["forward_compute_time"]) / 1000)
        assert layer.backward == pytest.approx(float(raw[node]["backward_compute_time"]) / 1000)
        assert layer.param_bytes == pytest.approx(float(raw[node]["parameter_size"]))
    inputs = [n for n in raw if n not in {layer.name.split(":")[0] for layer in profile.layers}]
    assert len(profile.layers) + len(inputs) == len(raw)
    assert inputs and all(kind[n].startswith("Input") for n in inputs)


@pytest.mark.parametrize("name", available())
def test_crossing_tensors_are_the_edges_over_each_cut(name: str) -> None:
    graph = read_graph((DATA_DIR / f"{name}.graph.txt").read_text())
    profile = _load(name)
    order = [layer.name.split(":")[0] for layer in profile.layers]
    assert all(order.index(a) < order.index(b) for a, b in graph.edges if a in order and b in order)
    for cut in range(len(order) - 1):
        before, after = set(order[: cut + 1]), set(order[cut + 1 :])
        sources = {a for a, b in graph.edges if a in before and b in after}
        assert {order[i] for i in profile.crossing(cut)} == sources


def test_chains_cross_one_tensor_and_branches_more() -> None:
    vgg = _load("vgg16")
    assert sum(len(b.sources) > 1 for b in vgg.boundaries or []) <= 1  # only the Size/View pair
    resnet = _load("resnet50")
    assert max(len(b.sources) for b in resnet.boundaries or []) == 2  # block input + branch
    inception = _load("inception_v3")
    assert any(not b.allowed for b in inception.boundaries or [])
    assert all(
        b.allowed == (sum(inception.layers[s].activation_bytes > 0 for s in b.sources) <= 2)
        for b in inception.boundaries or []
    )


def test_max_crossing_one_allows_only_single_tensor_cuts() -> None:
    text = (DATA_DIR / "resnet50.graph.txt").read_text()
    profile = parse_graph(text, max_crossing=1)
    assert all(b.allowed == (len(b.sources) == 1) for b in profile.boundaries or [])


def test_gnmt_needs_a_batch_size() -> None:
    with pytest.raises(ValueError, match="batch_size"):
        load_pipedream("gnmt")


def test_image_batch_size_is_inferred_from_the_input() -> None:
    profile = _load("vgg16")
    assert profile.input_bytes == profile.batch_size * 3 * 224 * 224 * 4


@pytest.mark.parametrize("name", ["vgg16", "resnet50", "inception_v3", "gnmt", "alexnet"])
def test_plans_end_to_end_from_2_to_64_stages(name: str) -> None:
    profile = _load(name)
    total = sum(layer.forward + layer.backward for layer in profile.layers)
    allowed = [0] + [c + 1 for c in range(len(profile.layers) - 1) if profile.cut_allowed(c)]
    previous = float("inf")
    for stages in (2, 3, 4, 8, 16, 32, 64):
        if stages > len(allowed):
            with pytest.raises(InfeasibleError, match="cut points"):
                plan(profile, stages=stages, microbatches=stages)
            continue
        result = plan(profile, stages=stages, microbatches=stages)
        assert sum(result.balance) == len(profile.layers)
        starts = [s.layers[0] for s in result.per_stage]
        assert set(starts) <= set(allowed)
        assert result.bottleneck >= total / stages * (1 - 1e-9)
        assert result.bottleneck <= previous * (1 + 1e-9)  # more stages never hurt here
        assert 0.0 <= result.bubble_fraction < 1.0
        previous = result.bottleneck


def test_a_real_cut_is_charged_its_crossing_bytes() -> None:
    profile = _load("resnet50")
    result = plan(profile, stages=4, microbatches=8, bandwidth="10GB/s")
    for stage in result.per_stage[:-1]:
        cut = stage.layers[1] - 1
        want = sum(profile.layers[s].activation_bytes for s in profile.crossing(cut))
        assert stage.transfer_bytes == want
        assert stage.transfer_time == pytest.approx(want / 10e9)


def test_graph_reader_rejects_cycles() -> None:
    text = (
        "node1 -- A -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
        "parameter_size=0\n"
        "node2 -- B -- forward_compute_time=1, backward_compute_time=1, activation_size=1, "
        "parameter_size=0\n\tnode1 -- node2\n\tnode2 -- node1\n"
    )
    with pytest.raises(ValueError, match="cycle"):
        read_graph(text)
    assert isinstance(read_graph(text.rsplit("\t", 1)[0]), nx.DiGraph)
