"""The planner must run where torch is not installed: it never imports it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import partitioner

PACKAGE = Path(partitioner.__file__).parent


def test_no_module_imports_torch() -> None:
    sources = list(PACKAGE.rglob("*.py"))
    assert len(sources) >= 10
    for path in sources:
        found = re.search(r"^\s*(import|from)\s+torch\b", path.read_text(), re.MULTILINE)
        assert found is None, f"{path} imports torch"


def test_importing_and_planning_leave_torch_unloaded() -> None:
    code = (
        "import sys, partitioner\n"
        "p = partitioner.load_pipedream('alexnet')\n"
        "partitioner.plan(p, stages=2, microbatches=2)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
