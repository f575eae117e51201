"""Run the README's code blocks as a user would, so they cannot rot.

Every ```python and ```bash block runs in a fresh folder that sees the repository's
`examples/` and `benchmarks/` (as a user running from a clone does), blocks one after another
in that folder, so a bash block may make the plan that a later block reads.

- A Python block whose first line reads ``# ... torchrun --nproc_per_node=N ...`` is saved as
  ``train.py`` and started with torchrun, N processes; one whose first line reads
  ``# NAME.py: ...`` is saved as NAME.py (a module later blocks import) and run with
  ``python``, as is any other Python block.
- A bash block runs with ``bash -euo pipefail``.
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
            skip = f"needs {why}, not installed here (pip install \"pipetrain[viz]\")"
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


def test_readme_has_blocks() -> None:
    assert sum(b.lang == "python" for b in README_BLOCKS) >= 4
    assert README_BLOCKS[0].lang == "bash"
    assert README_BLOCKS[0].skip, "the set-up block is run by CI and test_main_job, not here"


def test_setup_commands_are_the_two_that_ci_and_users_run() -> None:
    setup = [line for line in README_BLOCKS[0].code.splitlines() if line.strip()]
    assert len(setup) == 2
    assert "torchrun" in setup[0] and "examples/train_gpt.py" in setup[0]
    assert re.match(r"^pip install .*python -m pytest", setup[1])  # what .ci/run runs


def test_every_named_script_exists() -> None:
    """Blocks that cannot run here (several nodes) still name files that exist."""
    for block in README_BLOCKS:
        for path in re.findall(r"\b((?:examples|benchmarks)/[\w/]+\.py)\b", block.code):
            assert (ROOT / path).is_file(), f"README line {block.line} names missing {path}"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One working folder for all blocks, with the clone's examples and benchmarks in it."""
    path = tmp_path_factory.mktemp("readme")
    for name in ("examples", "benchmarks"):
        (path / name).symlink_to(ROOT / name)
    return path


@pytest.mark.parametrize(
    "block", README_BLOCKS[1:], ids=[f"line{b.line}-{b.lang}" for b in README_BLOCKS[1:]]
)
def test_readme_block_runs(block: Block, folder: Path) -> None:
    if block.skip:
        pytest.skip(block.skip)
    path = os.pathsep.join([str(ROOT), str(folder)])
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1")
    done = subprocess.run(
        command(block, folder), cwd=folder, env=env, capture_output=True, text=True,
        timeout=TIMEOUT,
    )
    assert done.returncode == 0, (
        f"README block at line {block.line} failed ({done.returncode}):\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
