"""The shape of the code, as issues 39 and 46 ask it measured: lines per room, the longest
constructors and modules, the functions over LONGEST_FUNCTION lines, comparisons with a
schedule's name outside its registry entry, imports between pipetrain's rooms that run back up
and import circles, and the walk of one training step (the pipetrain files on the stack at each
point where the step touches ``x`` or the weights, from ``Pipeline.train_step`` down).

    python benchmarks/code_shape.py

Static figures read the source (``ast``); the walk runs one step of a 2-layer MLP as a
single-rank gloo job in this process (one stage: the walk of ``x`` to the optimizer, the same
files a stage of a longer pipeline takes, sends and receives aside).
"""

from __future__ import annotations

import ast
import os
import sys
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ROOMS = (("observe", "training"), ("checkpoints",), ("runtime",), ("hf",), ("tools",))
"""pipetrain's subpackages in layers, lowest first: a module imports only lower layers."""


def _sources(folder: Path) -> Iterator[Path]:
    return iter(sorted(folder.rglob("*.py")))


def lines_per_room() -> dict[str, int]:
    """Lines of each subpackage of pipetrain (and of the two torch-free packages)."""
    rooms: dict[str, int] = {}
    for path in _sources(ROOT / "pipetrain"):
        parts = path.relative_to(ROOT / "pipetrain").parts
        room = parts[0] if len(parts) > 1 else "(top)"
        rooms[room] = rooms.get(room, 0) + len(path.read_text().splitlines())
    for package in ("schedules", "partitioner"):
        rooms[package] = sum(len(p.read_text().splitlines()) for p in _sources(ROOT / package))
    return rooms


def constructors(folder: str = "pipetrain") -> list[tuple[int, str]]:
    """(parameter count, "file:Class") of every ``__init__`` under ``folder``, ``self`` not
    counted, ``*args`` and ``**kwargs`` one each; longest first."""
    found = []
    for path in _sources(ROOT / folder):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    count = len(args.posonlyargs) + len(args.args) - 1 + len(args.kwonlyargs)
                    count += (args.vararg is not None) + (args.kwarg is not None)
                    found.append((count, f"{path.relative_to(ROOT)}:{node.name}"))
    return sorted(found, reverse=True)


PACKAGES = ("pipetrain", "partitioner", "schedules")
LONGEST_FUNCTION = 80  # lines: issue 46's limit on a function (docstring and signature too)


def long_functions(limit: int = LONGEST_FUNCTION) -> list[tuple[int, str]]:
    """(lines, "file:function") of every function of the repository's Python (pipetrain,
    partitioner, schedules, benchmarks, examples, tests) longer than ``limit`` lines, longest
    first."""
    found = []
    folders = (*PACKAGES, "benchmarks", "examples", "tests")
    for path in (p for folder in folders for p in _sources(ROOT / folder)):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > limit:
                    found.append((lines, f"{path.relative_to(ROOT)}:{node.name}"))
    return sorted(found, reverse=True)


def longest_modules(count: int = 5) -> list[tuple[int, str]]:
    """(lines, file) of the ``count`` longest modules of pipetrain, partitioner and schedules."""
    found = [(len(path.read_text().splitlines()), str(path.relative_to(ROOT)))
             for package in PACKAGES for path in _sources(ROOT / package)]
    return sorted(found, reverse=True)[:count]


def _names_a_schedule(node: ast.AST, schedules: set[str]) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in schedules
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_names_a_schedule(item, schedules) for item in node.elts)
    return False


def schedule_name_comparisons() -> list[str]:
    """"file:line: comparison" for each comparison with a registered schedule's name (or a
    collection of them) outside schedules/registry.py, the one place that may ask which
    schedule it is: elsewhere the entry's properties say what a schedule does."""
    registry = ROOT / "schedules" / "registry.py"
    names = set(ast.literal_eval(node.args[0]) for node in ast.walk(ast.parse(
        registry.read_text())) if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "ScheduleSpec" and node.args)
    found = []
    for path in (p for package in PACKAGES for p in _sources(ROOT / package)):
        if path == registry:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(
                _names_a_schedule(side, names) for side in (node.left, *node.comparators)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


@dataclass(frozen=True)
class Import:
    """One import statement's target, as the module ``source`` runs it."""

    file: str  # the importing file, relative to the repository
    source: str  # the importing module, dotted ("pipetrain.tools.cli")
    target: str  # the imported module: ``from a import b`` is ``a.b`` where that is a module
    deferred: bool  # inside a function: it runs at the call, not when ``source`` is imported


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _statements(node: ast.AST, deferred: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every import statement under ``node`` with whether it sits in a function; the bodies
    of ``if TYPE_CHECKING:`` are left out (they never run: annotations only)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, deferred
        elif isinstance(child, ast.If) and _is_type_checking(child):
            yield from (s for o in child.orelse for s in _statements(o, deferred))
        else:
            inside = deferred or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef
                                            | ast.Lambda)
            yield from _statements(child, inside)


def imports(packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    """Every import that runs in the modules of ``packages``, at module level or in a
    function; ``from a import b`` counts as an import of the module ``a.b`` where that is one
    of theirs, else of ``a``. A package's own ``__init__`` running first is not counted."""
    paths = [path for package in packages for path in _sources(ROOT / package)]
    modules = {_module_name(path) for path in paths}
    found = []
    for path in paths:
        source = _module_name(path)
        package = source if path.name == "__init__.py" else source.rpartition(".")[0]
        for node, deferred in _statements(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                assert isinstance(node, ast.ImportFrom)
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                           for a in node.names]
            found += [Import(str(path.relative_to(ROOT)), source, t, deferred)
                      for t in dict.fromkeys(targets)]
    return found


def room_imports() -> list[tuple[str, str, str]]:
    """(from room, to room, file) for each import of one of pipetrain's subpackages by a
    module of another, in a function or not (under TYPE_CHECKING, annotations only, not)."""
    rooms = {room for layer in ROOMS for room in layer}
    found = []
    for item in imports(("pipetrain",)):
        here, there = item.source.split("."), item.target.split(".")
        if len(here) < 3 or here[1] not in rooms:
            continue
        if there[0] == "pipetrain" and len(there) > 1 and there[1] in rooms - {here[1]}:
            found.append((here[1], there[1], item.file))
    return found


def circles() -> list[list[str]]:
    """The import circles among the modules of pipetrain, partitioner and schedules, each a
    list of modules that import one another (directly or round about), counting imports in
    functions: Tarjan's strongly connected components of more than one module, or of one
    that imports itself."""
    graph: dict[str, set[str]] = {}
    for item in imports():
        graph.setdefault(item.source, set())
    for item in imports():
        if item.target in graph:
            graph[item.source].add(item.target)
    order: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        order[node] = low[node] = len(order)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            component = [stack.pop()]
            while component[-1] != node:
                component.append(stack.pop())
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in order:
            visit(node)
    return sorted(found)


def back_arrows() -> list[str]:
    """The imports of :func:`room_imports` that point to the same or a higher layer."""
    layer = {room: i for i, rooms in enumerate(ROOMS) for room in rooms}
    return sorted({f"{file}: {here} -> {there}" for here, there, file in room_imports()
                   if layer[there] >= layer[here]})


def _stack_files() -> list[str]:
    """The pipetrain and schedules files on the caller's stack, outermost first, from
    pipeline.py's train_step on, consecutive repeats merged."""
    files: list[str] = []
    started = False
    for frame in traceback.extract_stack()[:-2]:
        path = Path(frame.filename)
        if not path.is_relative_to(ROOT) or "benchmarks" in path.parts:
            continue
        started = started or frame.name == "train_step"
        name = str(path.relative_to(ROOT))
        if started and (not files or files[-1] != name):
            files.append(name)
    return files


def walk() -> list[tuple[str, list[str]]]:
    """(event, files on the stack) at the step's touches of ``x`` and the weights: ``x``
    checked, split into micro-batches, the first layer's forward and backward, the optimizer
    step."""
    import torch
    import torch.distributed as dist
    from torch import nn

    import pipetrain
    from pipetrain.runtime import microbatch

    events: list[tuple[str, list[str]]] = []

    def note(event: str) -> None:
        if not any(e == event for e, _ in events):
            events.append((event, _stack_files()))

    def noting(event: str, function: Any) -> Any:
        def noted(*args: Any, **kwargs: Any) -> Any:
            note(event)
            return function(*args, **kwargs)
        return noted

    microbatch.check_batches = noting("x checked", microbatch.check_batches)
    microbatch.scatter = noting("x split", microbatch.scatter)

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
        model[0].register_forward_pre_hook(lambda *_: note("first layer forward"))
        model[0].register_full_backward_pre_hook(lambda *_: note("first layer backward"))
        pipe = pipetrain.Pipeline(
            model, [2], chunks=2, loss_fn=nn.functional.cross_entropy,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        )
        for stage in pipe.stages:
            assert stage.optimizer is not None
            stage.optimizer.register_step_pre_hook(lambda *_: note("optimizer step"))
        pipe.train_step(torch.randn(4, 8), torch.randint(0, 2, (4,)))
    finally:
        dist.destroy_process_group()
    return events


def _walk_summary(events: list[tuple[str, list[str]]]) -> tuple[list[str], int]:
    """The files entered along the walk in order (each stack after the part it shares with
    the previous one) and how many times the walk enters a file it has already left."""
    path: list[str] = []
    previous: list[str] = []
    for _, stack in events:
        shared = 0
        while shared < min(len(stack), len(previous)) and stack[shared] == previous[shared]:
            shared += 1
        path += stack[shared:] if path else stack
        previous = stack
    returns = sum(1 for i, f in enumerate(path) if f in path[:i] and path[i - 1] != f)
    return path, returns


def main() -> None:
    print("| room | lines |\n|---|---:|")
    for room, count in lines_per_room().items():
        print(f"| {room} | {count} |")
    print("\n| constructor (pipetrain/) | parameters |\n|---|---:|")
    for count, name in constructors()[:5]:
        print(f"| {name} | {count} |")
    print("\n| longest module | lines |\n|---|---:|")
    for count, name in longest_modules():
        print(f"| {name} | {count} |")
    long = long_functions()
    print(f"\nfunctions over {LONGEST_FUNCTION} lines: {len(long)}")
    for count, name in long:
        print(f"  {name}: {count}")
    compared = schedule_name_comparisons()
    print(f"schedule-name comparisons outside the registry: {len(compared)}")
    for where in compared:
        print(f"  {where}")
    arrows = back_arrows()
    deferred = sum(item.deferred for item in imports())
    print(f"\nimports between rooms: {len(room_imports())}, running back up: {len(arrows)}; "
          f"imports in functions: {deferred}; import circles: {len(circles())}")
    for arrow in arrows:
        print(f"  {arrow}")
    for circle in circles():
        print(f"  circle: {' <-> '.join(circle)}")
    events = walk()
    path, returns = _walk_summary(events)
    print("\nthe walk of a training step (files on the stack at each event):")
    for event, stack in events:
        print(f"  {event}: {' > '.join(stack)}")
    print(f"files along the walk: {len(path)} ({len(set(path))} distinct), re-entries: {returns}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
