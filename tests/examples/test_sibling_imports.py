"""Every example runs as ``torchrun examples/NAME.py`` from the repository's root with nothing
on PYTHONPATH: Python puts the script's own folder on sys.path, not the root, so an example
imports its siblings by their own names (``from text import CORPUS``), never ``examples.``."""

from __future__ import annotations

import ast
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_no_example_imports_the_examples_package():
    found = []
    for path in sorted(EXAMPLES.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.name}:{node.lineno} {n}" for n in names
                      if n == "examples" or n.startswith("examples.")]
    assert len(list(EXAMPLES.glob("*.py"))) >= 5
    assert not found, found
