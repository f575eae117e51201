"""The package as a user meets it: its version, its type information, what `import pipetrain`
costs, and the logger switch."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from setuptools.config.pyprojecttoml import read_configuration

import pipetrain
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


def test_the_flat_layouts_module_paths_import_the_grouped_modules():
    """Code written against pipetrain's flat layout (``pipetrain.stage``, the README's former
    ``pipetrain.delayed.DelayedPipeline``) imports the very module that now lives in a
    subpackage: one object, so a patch through either path reaches the code that runs."""
    import importlib
    from unittest import mock

    from pipetrain import _moved
    from pipetrain.runtime.stage import Stage

    for name, group in _moved.MOVED.items():
        old = importlib.import_module(f"pipetrain.{name}")
        assert old is importlib.import_module(f"pipetrain.{group}.{name}"), name
        assert old.__spec__.name == f"pipetrain.{group}.{name}"  # the module keeps its own
    stage = importlib.import_module("pipetrain.stage")
    with mock.patch("pipetrain.stage.Stage.zero_grad") as patched:
        assert Stage.zero_grad is patched and stage.Stage is Stage
    out = _python("from pipetrain.delayed import DelayedPipeline as D; print(D.__module__)")
    assert out.strip() == "pipetrain.training.delayed"
    assert not (ROOT / "pipetrain" / "stage.py").exists()  # moved, not copied


def test_the_tree_groups_every_module():
    """Only the package's public entry points stay at the top; the rest sits in a group."""
    top = sorted(p.name for p in (ROOT / "pipetrain").glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_moved.py", "errors.py", "optim.py"]
    groups = {p.name for p in (ROOT / "pipetrain").iterdir() if (p / "__init__.py").exists()}
    assert groups == {"runtime", "training", "checkpoints", "observe", "tools", "hf"}


def test_import_pipetrain_and_pipetrain_hf_leave_transformers_unloaded():
    """transformers (the ``hf`` extra) loads only when a Hugging Face model is used."""
    out = _python("import sys, pipetrain, pipetrain.hf\nprint('transformers' in sys.modules)\n")
    assert out.strip() == "False"
