"""The package as a user meets it: its version, its type information, what `import pipetrain`
costs, and the logger switch."""

from __future__ import annotations

import importlib
import inspect
import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import FunctionType

import pytest
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


def test_import_pipetrain_loads_torch_only_when_a_name_needs_it():
    """`import pipetrain` leaves torch unloaded (planning runs without it) yet dir() lists
    every public name; each loads on first use, and an unknown one is an AttributeError."""
    out = _python("import sys, pipetrain\n"
                  "print('torch' in sys.modules, set(pipetrain.__all__) <= set(dir(pipetrain)))\n"
                  "pipetrain.Pipeline\nprint('torch' in sys.modules)\n")
    assert out.splitlines() == ["False True", "True"]
    assert all(getattr(pipetrain, name) is not None for name in pipetrain.__all__)
    assert pipetrain.optim.__name__ == "pipetrain.optim"
    with pytest.raises(AttributeError, match="no attribute 'Pipe'"):
        pipetrain.Pipe  # noqa: B018


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
    """Only the package's public entry points (and the model's shape, which every room reads)
    stay at the top; the rest sits in a group."""
    top = sorted(p.name for p in (ROOT / "pipetrain").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "errors.py", "layer_tree.py", "optim.py"]
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
    # the `hf` extra: the layers, transformers' checkpoint conversions, generation's cache,
    # what differs between its releases
    "transformers": {"pipetrain/hf/sequential.py", "pipetrain/hf/layout.py",
                     "pipetrain/hf/cache.py", "pipetrain/hf/compat.py"},
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


def _ci_matrix() -> dict[str, tuple[str, str, str]]:
    """.ci/matrix's rows: name -> (python, torch, the rest)."""
    rows = {}
    for line in (ROOT / ".ci" / "matrix").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, python, torch, rest = line.split()
            rows[name] = (python, torch, rest)
    return rows


def _lower_bound(requirement: str) -> tuple[str, str]:
    """(name, its >= version) of a requirement like ``torch>=2.6``."""
    from packaging.requirements import Requirement

    parsed = Requirement(requirement)
    bounds = [s.version for s in parsed.specifier if s.operator == ">="]
    assert len(bounds) == 1, f"{requirement}: one lower bound (>=) expected"
    return parsed.name.lower(), bounds[0]


def test_pyproject_claims_what_the_ci_matrix_runs():
    """pyproject.toml's lowest Python and torch are the oldest row's of .ci/matrix, with no
    upper bound (the newest row runs the newest release); ruff lints and mypy type-checks for
    the oldest Python (.ci/run type-checks for the newest row's too). A claim that CI never
    runs may break unseen."""
    from packaging.version import Version

    config = read_configuration(ROOT / "pyproject.toml")
    rows = _ci_matrix()
    assert set(rows) == {"main", "newest", "oldest"}
    oldest_python, oldest_torch, _ = rows["oldest"]
    assert _minor_versions(config["project"]["requires-python"])[0] == oldest_python
    assert _minor_versions(config["project"]["requires-python"])[-1] == "3.29", "an upper bound"
    assert max((r[0] for r in rows.values()), key=Version) == rows["newest"][0]
    assert config["tool"]["ruff"]["target-version"] == "py" + oldest_python.replace(".", "")
    assert config["tool"]["mypy"]["python_version"] == oldest_python
    torch = dict(_lower_bound(d) for d in config["project"]["dependencies"])["torch"]
    assert Version(torch).release == Version(oldest_torch).release[:2]
    assert max((r[1] for r in rows.values()), key=Version) == rows["newest"][1]


def test_the_oldest_row_pins_each_dependency_at_its_lowest_claim():
    """.ci/oldest.txt pins every dependency (and the test and hf extras') at the release
    pyproject.toml names as its lowest, so the oldest claims are the ones CI runs."""
    from packaging.version import Version

    config = read_configuration(ROOT / "pyproject.toml")
    project = config["project"]
    extras = project["optional-dependencies"]
    claimed = dict(_lower_bound(r) for r in [*project["dependencies"], *extras["test"],
                                               *extras["hf"]])
    lines = (ROOT / ".ci" / "oldest.txt").read_text().splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    assert set(pins) == set(claimed)
    for name, bound in claimed.items():
        release = Version(bound).release
        assert Version(pins[name]).release[:len(release)] == release, (name, pins[name], bound)
    assert pins["torch"] == _ci_matrix()["oldest"][1]


def test_the_compatibility_matrix_lists_every_row_ci_runs():
    """docs/compatibility.md (written by .ci/compatibility.py from CI's results) has a line per
    row of .ci/matrix, at that row's Python and torch."""
    table = (ROOT / "docs" / "compatibility.md").read_text()
    for name, (python, torch, _) in _ci_matrix().items():
        line = next((x for x in table.splitlines() if x.startswith(f"| {name} |")), None)
        assert line, f"docs/compatibility.md has no row {name}: run .ci/compatibility.py"
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1].startswith(python + ".") and cells[2].split("+")[0] == torch, line


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
