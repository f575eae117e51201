"""The compatibility matrix (docs/compatibility.md): what each row of .ci/matrix ran and how it
ended. `.ci/run` records each row with ``record`` (run by that row's own Python, so it reads the
versions that Python imports); ``table`` writes the page from the latest records.

    python .ci/compatibility.py record NAME RESULT TESTS   # into $PIPETRAIN_CI_CACHE/results
    python .ci/compatibility.py table                      # docs/compatibility.md
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ["torch", "numpy", "pulp", "transformers", "networkx", "safetensors", "hypothesis"]
RESULTS = Path(os.environ.get("PIPETRAIN_CI_CACHE", Path.home() / ".cache" / "pipetrain-ci"))


def record(name: str, result: str, tests: str) -> None:
    """This interpreter's versions and the row's outcome, as results/<name>.json."""
    entry = {"name": name, "python": platform.python_version(),
             **{p: version(p) for p in PACKAGES}, "result": result, "tests": tests,
             "date": datetime.date.today().isoformat()}
    (RESULTS / "results").mkdir(parents=True, exist_ok=True)
    (RESULTS / "results" / f"{name}.json").write_text(json.dumps(entry) + "\n")


def table() -> str:
    """The page: one line per row of .ci/matrix, in its order."""
    rows = [line.split()[0] for line in (ROOT / ".ci" / "matrix").read_text().splitlines()
            if line.strip() and not line.startswith("#")]
    lines = [
        "# Compatibility matrix",
        "",
        "What CI (`.ci/run`) runs, one environment per row of `.ci/matrix`: `main` runs the",
        "README's test command with ruff and mypy; `newest` and `oldest` each run, in a venv of",
        "their own, the README's test command (the default test profile; GPU tests skip with",
        "their reason) and a 20-step `torchrun` training run of `examples/train_gpt.py`.",
        "`oldest` pins every dependency at its lowest claim (`.ci/oldest.txt`). Regenerate",
        "with `python .ci/compatibility.py table` after `bash .ci/run`.",
        "",
        "transformers (the `hf` extra) is claimed from 4.56 through 5.x. On 4.56 (`oldest`)",
        "`pipetrain.hf` works as on 5.x but for what docs/hf.md's \"transformers 4.56\" lists",
        "(pipetrain/hf/compat.py): hub checkpoints renamed by 4.56's own `from_pretrained` rules",
        "(it converts no tensors), Gemma and Gemma 3 refused at `sequential`, mixtures of",
        "experts refused on the meta device (`profile --meta`), each naming `transformers>=5.20`.",
        "",
        "| row | Python | torch | numpy | pulp | transformers | networkx | safetensors "
        "| hypothesis | result | tests | date |",
        "|" + "---|" * 12,
    ]
    for name in rows:
        path = RESULTS / "results" / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"no result for row {name} in {path.parent}: run bash .ci/run")
        e = json.loads(path.read_text())
        cells = [name, e["python"], *(e[p] for p in PACKAGES), e["result"], e["tests"],
                 e["date"]]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:2] == ["record"] and len(sys.argv) == 5:
        record(*sys.argv[2:])
    elif sys.argv[1:] == ["table"]:
        (ROOT / "docs" / "compatibility.md").write_text(table())
    else:
        raise SystemExit(__doc__)
