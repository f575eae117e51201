"""Run the README's code blocks, and those of the docs it sends users to (``DOCS``), as a user
would, so they cannot rot; and check that every Markdown file's code fences close.

Every ```python and ```bash block runs in a fresh folder that sees the repository's
`examples/` and `benchmarks/` (as a user running from a clone does), blocks one after another
in that folder, so a bash block may make the plan that a later block reads.

- A Python block whose first line reads ``# ... torchrun --nproc_per_node=N ...`` is saved as
  ``train.py`` and started with torchrun, N processes; one whose first line reads
  ``# NAME.py: ...`` is saved as NAME.py (a module later blocks import) and run with
  ``python``, as is any other Python block.
- A bash block runs with ``bash -euo pipefail``.
- The blocks carry the ``readme`` mark: the default run leaves them out (they take minutes),
  ``python -m pytest -m readme`` runs them, and CI runs them in every row.
- ``<!-- readme-test: skip REASON -->`` on the line before a block leaves it out, and the test
  prints the reason; ``<!-- readme-test: needs MODULE -->`` skips it (with the reason) where
  MODULE cannot be imported.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.runtime.harness import free_port

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(
    r"(?:<!-- readme-test: (?P<marker>skip|needs) (?P<why>[^>]*?) -->\n)?"
    r"```(?P<lang>python|bash)\n(?P<code>.*?)```",
    re.S,
)
TORCHRUN = re.compile(r"^#.*torchrun --nproc_per_node=(\d+)")
MODULE = re.compile(r"^# (\w+\.py):")
TIMEOUT = 240.0  # seconds a block may take: the slowest (the GPT block) needs about a minute


@dataclass(frozen=True)
class Block:
    line: int
    lang: str
    code: str
    skip: str | None  # why this block is not run here, or None


def blocks(text: str) -> list[Block]:
    """The README's python and bash blocks with the line each starts on."""
    found = []
    for match in FENCE.finditer(text):
        skip = None
        why = (match["why"] or "").strip()
        if match["marker"] == "skip":
            skip = why
        elif match["marker"] == "needs" and importlib.util.find_spec(why) is None:
            extra = {"transformers": "hf"}.get(why, "viz")
            skip = f"needs {why}, not installed here (pip install \"pipetrain[{extra}]\")"
        line = text.count("\n", 0, match.start("code"))
        found.append(Block(line, match["lang"], match["code"], skip))
    return found


def command(block: Block, folder: Path) -> list[str]:
    """How a user runs this block."""
    if block.lang == "bash":
        return ["bash", "-euo", "pipefail", "-c", block.code]
    first = block.code.splitlines()[0] if block.code else ""
    ranks, module = TORCHRUN.match(first), MODULE.match(first)
    script = folder / (module[1] if module and not ranks else "train.py")
    script.write_text(block.code)
    if ranks is None:
        return [sys.executable, str(script)]
    return [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks[1]}",
        f"--master_port={free_port()}", str(script),
    ]


README_BLOCKS = blocks((ROOT / "README.md").read_text())
DOCS = ("docs/training-options.md",)  # guides with runnable blocks, besides the README
DOC_BLOCKS = [(doc, block) for doc in DOCS for block in blocks((ROOT / doc).read_text())]


@pytest.mark.parametrize(
    "path", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
)
def test_code_fences_close(path: str) -> None:
    """An unclosed fence turns the rest of the page into code."""
    fences = [
        n for n, line in enumerate((ROOT / path).read_text().splitlines(), 1)
        if line.lstrip().startswith("```")
    ]
    assert len(fences) % 2 == 0, f"{path}: the fence on line {fences[-1]} is never closed"


def test_the_readme_links_every_runnable_doc() -> None:
    readme = (ROOT / "README.md").read_text()
    for doc in DOCS:
        assert f"]({doc})" in readme, f"README.md does not link {doc}"
        assert any(d == doc for d, _ in DOC_BLOCKS), f"{doc} has no runnable block"


def test_readme_has_blocks() -> None:
    assert sum(b.lang == "python" for b in README_BLOCKS) >= 4
    assert README_BLOCKS[0].lang == "bash"
    assert README_BLOCKS[0].skip, "the set-up block is run by CI and test_main_job, not here"


def test_setup_commands_are_the_two_that_ci_and_users_run() -> None:
    setup = [line for line in README_BLOCKS[0].code.splitlines() if line.strip()]
    assert len(setup) == 2
    assert "torchrun" in setup[0] and "examples/train_gpt.py" in setup[0]
    assert re.match(r'^python -c "import torch" .*python -m pytest', setup[1])  # .ci/run's
    guard = 'python -c "import torch" 2>/dev/null || pip install torch==2.13.0 && pip install'
    assert all(line.startswith(guard) for line in setup), "an installed torch is kept as it is"


def test_every_named_script_exists() -> None:
    """Blocks that cannot run here (several nodes) still name files that exist."""
    for block in README_BLOCKS:
        for path in re.findall(r"\b((?:examples|benchmarks)/[\w/]+\.py)\b", block.code):
            assert (ROOT / path).is_file(), f"README line {block.line} names missing {path}"


def unguarded_prints(code: str) -> list[str]:
    """Lines that print outside any ``if`` (so on every rank of a torchrun block)."""
    lines = code.splitlines()
    found = []
    for n, line in enumerate(lines):
        if "print(" not in line or line.lstrip().startswith("#"):
            continue
        depth = len(line) - len(line.lstrip())
        outer = [
            x.lstrip() for x in lines[:n] if x.strip() and len(x) - len(x.lstrip()) < depth
        ]
        if not any(x.startswith("if ") for x in outer[-1:]):
            found.append(line.strip())
    return found


def test_torchrun_blocks_print_on_one_rank() -> None:
    """Two ranks printing at once interleave their lines."""
    for block in README_BLOCKS:
        first = block.code.splitlines()[0] if block.code else ""
        if TORCHRUN.match(first) and "resume.py" not in first:  # resume: each rank's step
            assert not unguarded_prints(block.code), f"README line {block.line}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working folder for all blocks, with the clone's examples and benchmarks in it."""
    path = tmp_path_factory.mktemp("readme")
    for name in ("examples", "benchmarks"):
        (path / name).symlink_to(ROOT / name)
    return path


@pytest.mark.readme
@pytest.mark.parametrize(
    "block", README_BLOCKS[1:], ids=[f"line{b.line}-{b.lang}" for b in README_BLOCKS[1:]]
)
def test_readme_block_runs(block: Block, folder: Path) -> None:
    run_block("README.md", block, folder)


@pytest.mark.readme
@pytest.mark.parametrize(
    ("doc", "block"), DOC_BLOCKS, ids=[f"{d}-line{b.line}" for d, b in DOC_BLOCKS]
)
def test_doc_block_runs(doc: str, block: Block, folder: Path) -> None:
    run_block(doc, block, folder)


def run_block(doc: str, block: Block, folder: Path) -> None:
    """Run ``block`` of ``doc`` in ``folder`` as a user would; it must exit 0."""
    if block.skip:
        pytest.skip(block.skip)
    path = os.pathsep.join([str(ROOT), str(folder)])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run(
        command(block, folder), cwd=folder, env=env, capture_output=True, text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, (
        f"{doc} block at line {block.line} failed ({done.returncode}):\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
