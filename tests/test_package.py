"""The package as a user meets it: its version, its type information, what `import pipetrain`
costs, and the logger switch."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FunctionType

from setuptools.config.pyprojecttoml import read_configuration

import pipetrain
from benchmarks.code_shape import (
    LONGEST_FUNCTION,
    ROOMS,
    back_arrows,
    circles,
    imports,
    long_functions,
    room_imports,
    schedule_name_comparisons,
)
from pipetrain.observe import progress
from pipetrain.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipetrain", "partitioner", "schedules")


def _python(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, check=True)
    return done.stdout


def test_import_pipetrain_leaves_the_planners_dependencies_unloaded():
    """pulp and networkx are for planning only; `from partitioner import plan` still works."""
    out = _python(
        "import sys, pipetrain\n"
        "print(sorted(m for m in ('pulp', 'networkx') if m in sys.modules))\n"
        "from partitioner import plan, solve_ilp, chain\n"
        "print(sorted(m for m in ('pulp', 'networkx') if m in sys.modules))\n"
    )
    assert out.splitlines() == ["[]", "['networkx', 'pulp']"]


def test_version_from_the_package_metadata_and_the_command_line(capsys):
    try:
        expected = version("pipetrain")
    except PackageNotFoundError:  # a source tree that was never installed
        expected = "0+unknown"
    assert pipetrain.__version__ == expected
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pipetrain {expected}"


def test_every_package_ships_py_typed():
    data = read_configuration(ROOT / "pyproject.toml")["tool"]["setuptools"]
    for package in PACKAGES:
        assert (ROOT / package / "py.typed").is_file(), package
        assert "py.typed" in data["package-data"][package], package


def test_verbose_twice_prints_each_event_once(capsys):
    handlers, level = list(progress.logger.handlers), progress.logger.level
    try:
        progress.verbose(rank=3)
        progress.verbose(rank=3)
        progress.logger.info("resumed")
    finally:
        for handler in set(progress.logger.handlers) - set(handlers):
            progress.logger.removeHandler(handler)
        progress.logger.setLevel(level)
    assert capsys.readouterr().err.splitlines() == ["[rank 3] INFO resumed"]


def test_the_flat_layouts_module_paths_are_gone():
    """The flat layout's paths (``pipetrain.stage``) no longer import: CHANGELOG.md names each
    module's new place, and every one of those places imports."""
    import importlib

    moved = re.findall(r"^- `pipetrain\.(\w+)` -> `pipetrain\.(\w+)\.\1`$",
                       (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert len(moved) == 41  # and pipetrain.delayed, out of the package
    for name, group in moved:
        assert importlib.import_module(f"pipetrain.{group}.{name}").__name__.endswith(name)
    out = _python("import pipetrain\n"
                  "try:\n    import pipetrain.stage\nexcept ImportError:\n    print('gone')\n")
    assert out.strip() == "gone"


def test_the_tree_groups_every_module():
    """Only the package's public entry points stay at the top; the rest sits in a group."""
    top = sorted(p.name for p in (ROOT / "pipetrain").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "optim.py"]
    groups = {p.name for p in (ROOT / "pipetrain").iterdir() if (p / "__init__.py").exists()}
    assert groups == {"runtime", "training", "checkpoints", "observe", "tools", "hf"}


def test_the_rooms_of_pipetrain_only_point_down():
    """pipetrain's subpackages form layers (ROOMS, lowest first): a module imports, at module
    level or inside a function, only rooms of lower layers, so no import runs back up and no
    two rooms need each other. observe and training share the lowest layer and import neither
    each other. (An import under ``if TYPE_CHECKING:`` never runs and is not counted.)"""
    layer = {room: i for i, rooms in enumerate(ROOMS) for room in rooms}
    assert room_imports(), "no import between rooms found: the parse is broken"
    assert any(item.deferred for item in imports()), "no import in a function found"
    up = back_arrows()
    assert not up, up
    groups = {p.name for p in (ROOT / "pipetrain").iterdir() if (p / "__init__.py").exists()}
    assert groups == set(layer)


def test_no_import_circle_between_modules():
    """No two modules of pipetrain, partitioner and schedules import each other, directly or
    round about, counting imports inside functions: a function-level import once hid
    checkpoints/weightfile.py <-> hf/load.py."""
    assert not circles(), circles()


def test_no_function_is_longer_than_eighty_lines():
    """A function the next engineer reads in one go: none in the repository (the packages,
    benchmarks, examples, tests) runs over LONGEST_FUNCTION lines, docstring included; split
    a longer one by the steps it takes."""
    assert long_functions(10), "no function over 10 lines found: the parse is broken"
    assert not long_functions(LONGEST_FUNCTION), long_functions(LONGEST_FUNCTION)


def test_only_the_registry_asks_which_schedule_it_is():
    """Code outside schedules/registry.py reads a schedule's properties from its entry and
    never compares its name with a registered one (``schedule == "gpipe"``), so that a new
    schedule is one entry; schedules.DEFAULT_SCHEDULE names the default."""
    assert not schedule_name_comparisons(), schedule_name_comparisons()


OPTIONAL = {  # optional dependencies -> the modules that may import them, inside functions only
    "matplotlib": {"pipetrain/observe/gantt.py"},  # pictures: `pipetrain trace`, simulate --png
    "transformers": {"pipetrain/hf/sequential.py"},  # the `hf` extra
}


def test_optional_dependencies_are_imported_only_where_listed_and_only_when_used():
    """An optional dependency is imported inside a function of the module OPTIONAL allows,
    so that `import pipetrain` (and any other module) works without it installed."""
    found = {(item.target.split(".")[0], item.file, item.deferred) for item in imports()
             if item.target.split(".")[0] in OPTIONAL}
    assert {(name, file) for name, file, _ in found} == {
        (name, file) for name, files in OPTIONAL.items() for file in files}
    assert all(deferred for _, _, deferred in found), sorted(found)


def _minor_versions(spec: str) -> list[str]:
    """The Python 3 minor versions a requires-python specifier admits."""
    from packaging.specifiers import SpecifierSet

    return [v for v in (f"3.{m}" for m in range(6, 30)) if SpecifierSet(spec).contains(v)]


def test_pyproject_claims_the_python_that_ci_runs():
    """pyproject.toml claims exactly the Python .ci/run runs (and checks it runs), and lints and
    type-checks for that one: a claimed Python that CI never runs may break unseen."""
    config = read_configuration(ROOT / "pyproject.toml")
    found = re.search(r"^CI_PYTHON=(3\.\d+)$", (ROOT / ".ci" / "run").read_text(), re.M)
    assert found, ".ci/run names no CI_PYTHON"
    ci = found[1]
    assert _minor_versions(config["project"]["requires-python"]) == [ci]
    assert config["tool"]["ruff"]["target-version"] == "py" + ci.replace(".", "")
    assert config["tool"]["mypy"]["python_version"] == ci


NEWER_NAMES = {  # added in Python 3.11: (module, name); a module; a builtin; a method
    ("typing", n) for n in ("Self", "LiteralString", "Never", "assert_never", "reveal_type",
                            "NotRequired", "Required", "dataclass_transform", "Unpack")
} | {("enum", "StrEnum"), ("enum", "ReprEnum"), ("enum", "verify"), ("datetime", "UTC"),
     ("asyncio", "TaskGroup"), ("asyncio", "timeout"), ("hashlib", "file_digest"),
     ("math", "exp2"), ("math", "cbrt"), ("contextlib", "chdir"), ("operator", "call")}
NEWER_MODULES = {"tomllib"}
NEWER_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}
NEWER_METHODS = {"add_note"}


def _newer_uses(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.ImportFrom) and node.module:
            found += [f"{line}: {node.module}.{a.name}" for a in node.names
                      if (node.module, a.name) in NEWER_NAMES or node.module in NEWER_MODULES]
        elif isinstance(node, ast.Import):
            found += [f"{line}: {a.name}" for a in node.names if a.name in NEWER_MODULES]
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if (owner, node.attr) in NEWER_NAMES or node.attr in NEWER_METHODS:
                found.append(f"{line}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            found.append(f"{line}: {node.id}")
        elif type(node).__name__ == "TryStar":
            found.append(f"{line}: except*")
    return found


def test_the_package_calls_nothing_newer_than_python_3_10():
    """CI runs 3.11 only (the torch wheel here is cp311), but the package keeps clear of what
    3.11 added, so a wider CI needs no code change: add_note once masked every layer's error
    on 3.10 with an AttributeError."""
    newer = {
        str(path.relative_to(ROOT)): uses
        for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
        if (uses := _newer_uses(ast.parse(path.read_text())))
    }
    assert not newer, newer


def test_import_pipetrain_and_pipetrain_hf_leave_transformers_unloaded():
    """transformers (the ``hf`` extra) loads only when a Hugging Face model is used."""
    out = _python("import sys, pipetrain, pipetrain.hf\nprint('transformers' in sys.modules)\n")
    assert out.strip() == "False"


MOST_PARAMETERS = 8  # of a runtime constructor, beside self


def _parameters(init: FunctionType) -> int:
    """How many parameters, beside self, a constructor's own code takes (not the signature
    it shows: Pipeline's lists every option but takes ``**options``)."""
    code = init.__code__
    starred = [code.co_flags & flag for flag in (inspect.CO_VARARGS, inspect.CO_VARKEYWORDS)]
    return code.co_argcount + code.co_kwonlyargcount + sum(map(bool, starred)) - 1


def test_no_runtime_constructor_takes_more_than_eight_parameters():
    """Every class of pipetrain/runtime/ with a constructor of its own takes at most
    MOST_PARAMETERS: more says the class does several jobs (Stage took 17, Pipeline 31). A
    frozen dataclass is a record of settings filled by keyword (PipelineConfig, StageOptions,
    LayerSource): its fields are its declaration, not parameters of a job, and it is exempt."""
    counted, over = {}, []
    for path in sorted((ROOT / "pipetrain" / "runtime").glob("*.py")):
        module = importlib.import_module(f"pipetrain.runtime.{path.stem}")
        for cls in vars(module).values():
            if not isinstance(cls, type) or cls.__module__ != module.__name__:
                continue
            init = vars(cls).get("__init__")
            params = getattr(cls, "__dataclass_params__", None)
            if not inspect.isfunction(init) or (params is not None and params.frozen):
                continue
            name = f"{module.__name__}.{cls.__qualname__}"
            counted[name] = _parameters(init)
            if counted[name] > MOST_PARAMETERS:
                over.append(f"{name}: {counted[name]}")
    assert counted["pipetrain.runtime.pipeline.Pipeline"] == 3  # model, balance, **options
    assert counted["pipetrain.runtime.stage.Stage"] == 8
    assert not over, over
