"""Read PipeDream's profiler output (``graph.txt``) into a :class:`Profile`.

A graph.txt lists one node per line (``nodeN -- <layer> -- forward_compute_time=F,
backward_compute_time=B, activation_size=A, parameter_size=P``; times in milliseconds per
mini-batch, sizes in bytes, ``A`` may be a list ``[a; b]`` for a multi-output layer) and one edge
per tab-indented line (``nodeA -- nodeB``).

A pipeline runs layers in one order, so a branched graph is laid out in a topological order
(ties broken by node number, which keeps PipeDream's numbering). For every cut between
consecutive layers the tensors crossing it are the outputs of the layers before it that a layer
after it still reads; the cut's transfer size is the sum of those outputs. A cut that more than
``max_crossing`` tensors cross is not offered to the planner: it would split a block in the middle
(a residual branch, an Inception module) and every extra tensor is an extra message per
micro-batch. The default of 2 admits the cuts between blocks plus a cut inside a block that only
carries its skip tensor alongside the main one; pass 1 to cut only where a single tensor crosses.
Zero-byte outputs (placeholders such as GNMT's initial ``hidden``) carry nothing and are listed
among the crossing sources but not counted against the limit.

``Input`` nodes stand for data loading: they are not layers (their "compute time" is the data
loader's), and the data loader hands their tensors to whichever stage reads them, so they count
neither as compute nor as crossing tensors; their size is the profile's ``input_bytes``.
"""

from __future__ import annotations

import re
from pathlib import Path

import networkx as nx

from partitioner.profile import Boundary, LayerCost, Profile

DATA_DIR = Path(__file__).parent / "data" / "pipedream_profiles"
MAX_CROSSING = 2
ADAM_BYTES_PER_PARAM = 8.0  # two fp32 moments per fp32 parameter
_BYTES_PER_PARAM = 4  # PipeDream profiled fp32 models: parameter_size / 4 parameters
_STAT = re.compile(r"(\w+)=(\[[^\]]*\]|[-+0-9.eE]+)")
_INPUT = re.compile(r"Input\d*$")
_IMAGE_SIDES = (224, 299)  # ImageNet crops of the profiled image models


def _number(text: str) -> float:
    """A stat value: a number, or ``[a; b; ...]`` (the outputs of one layer) summed."""
    if text.startswith("["):
        return sum(float(part) for part in text.strip("[]").split(";") if part.strip())
    return float(text)


def read_graph(text: str) -> nx.DiGraph:
    """The graph in a graph.txt as a networkx DiGraph with ``layer``, ``forward``, ``backward``
    (milliseconds), ``activation`` and ``parameters`` (bytes) on each node."""
    graph = nx.DiGraph()
    edges = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if line[0].isspace():
            parts = [p.strip() for p in line.strip().split(" -- ")]
            if len(parts) != 2:
                raise ValueError(f"line {lineno}: an edge must read 'nodeA -- nodeB': {line!r}")
            edges.append((parts[0], parts[1]))
            continue
        node, rest = line.split(" -- ", 1)
        layer, stats_text = rest.rsplit(" -- ", 1)
        stats = {key: _number(value) for key, value in _STAT.findall(stats_text)}
        missing = {
            "forward_compute_time",
            "backward_compute_time",
            "activation_size",
            "parameter_size",
        } - set(stats)
        if missing:
            raise ValueError(f"line {lineno}: node {node} lacks {sorted(missing)}")
        graph.add_node(
            node.strip(),
            layer=layer.strip(),
            forward=stats["forward_compute_time"],
            backward=stats["backward_compute_time"],
            activation=stats["activation_size"],
            parameters=stats["parameter_size"],
        )
    for a, b in edges:
        if a not in graph or b not in graph:
            raise ValueError(f"edge {a} -- {b} names a node that is not listed")
        graph.add_edge(a, b)
    if not nx.is_directed_acyclic_graph(graph):
        raise ValueError("the graph has a cycle; a pipeline needs a DAG")
    return graph


def _node_number(node: str) -> tuple[int, str]:
    digits = re.sub(r"\D", "", node)
    return (int(digits) if digits else 0, node)


def _is_input(graph: nx.DiGraph, node: str) -> bool:
    return graph.in_degree(node) == 0 and bool(_INPUT.match(graph.nodes[node]["layer"]))


def infer_batch_size(graph: nx.DiGraph) -> int | None:
    """The mini-batch size of an image model: its fp32 RGB input bytes over one image's."""
    size = sum(graph.nodes[n]["activation"] for n in graph if _is_input(graph, n))
    for side in _IMAGE_SIDES:
        per_image = 3 * side * side * 4
        if size > 0 and size % per_image == 0:
            return int(size // per_image)
    return None


def crossings(order: list[str], graph: nx.DiGraph) -> list[tuple[str, ...]]:
    """For each cut between ``order[p]`` and ``order[p + 1]``: the nodes up to ``p`` whose
    outputs a node after ``p`` reads (edges from before the cut to after it)."""
    position = {node: p for p, node in enumerate(order)}
    last_use = {
        node: max((position[s] for s in graph.successors(node) if s in position), default=-1)
        for node in order
    }
    cuts: list[tuple[str, ...]] = []
    live: list[str] = []
    for p, node in enumerate(order[:-1]):
        live = [n for n in live if last_use[n] > p]
        if last_use[node] > p:
            live.append(node)
        cuts.append(tuple(live))
    return cuts


def parse_graph(
    text: str,
    batch_size: int | None = None,
    *,
    max_crossing: int = MAX_CROSSING,
    optimizer_bytes_per_param: float = ADAM_BYTES_PER_PARAM,
    device: str = "GPU of the PipeDream profile",
) -> Profile:
    """A Profile from graph.txt text; times become seconds, ``boundaries`` record the crossing
    tensors of every cut. ``batch_size`` is inferred for image models when not given."""
    if max_crossing < 1:
        raise ValueError(f"max_crossing must be >= 1, got {max_crossing}")
    graph = read_graph(text)
    if batch_size is None:
        batch_size = infer_batch_size(graph)
        if batch_size is None:
            raise ValueError("cannot infer the batch size of this profile; pass batch_size")
    inputs = [n for n in graph if _is_input(graph, n)]
    body = graph.subgraph(n for n in graph if n not in set(inputs))
    order = list(nx.lexicographical_topological_sort(body, key=_node_number))
    index = {node: i for i, node in enumerate(order)}
    layers = []
    for node in order:
        attrs = graph.nodes[node]
        params = int(attrs["parameters"])
        kind = attrs["layer"].split("(", 1)[0].strip()
        layers.append(
            LayerCost(
                name=f"{node}:{kind}",
                forward=attrs["forward"] / 1000.0,
                backward=attrs["backward"] / 1000.0,
                activation_bytes=round(attrs["activation"]),
                param_count=params // _BYTES_PER_PARAM,
                param_bytes=params,
                optimizer_state_bytes=round(optimizer_bytes_per_param * params / _BYTES_PER_PARAM),
            )
        )
    boundaries = [
        Boundary(
            tuple(index[n] for n in cut),
            allowed=sum(graph.nodes[n]["activation"] > 0 for n in cut) <= max_crossing,
        )
        for cut in crossings(order, body)
    ]
    return Profile(
        device=device,
        batch_size=batch_size,
        layers=layers,
        input_bytes=round(sum(graph.nodes[n]["activation"] for n in inputs)),
        boundaries=boundaries,
    )


def available() -> list[str]:
    """Names of the PipeDream profiles shipped in ``partitioner/data/pipedream_profiles``."""
    return sorted(p.name.removesuffix(".graph.txt") for p in DATA_DIR.glob("*.graph.txt"))


def load_pipedream(
    name_or_path: str | Path,
    batch_size: int | None = None,
    *,
    max_crossing: int = MAX_CROSSING,
    optimizer_bytes_per_param: float = ADAM_BYTES_PER_PARAM,
) -> Profile:
    """A shipped profile by model name (``"vgg16"``) or any graph.txt by path."""
    path = Path(name_or_path)
    if not path.exists():
        path = DATA_DIR / f"{name_or_path}.graph.txt"
        if not path.exists():
            raise FileNotFoundError(
                f"no PipeDream profile {str(name_or_path)!r}; shipped ones: {available()}"
            )
    return parse_graph(
        path.read_text(),
        batch_size,
        max_crossing=max_crossing,
        optimizer_bytes_per_param=optimizer_bytes_per_param,
        device=f"GPU of the PipeDream profile {path.name}",
    )
