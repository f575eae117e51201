"""The module paths of pipetrain before its subpackages, kept importable.

``pipetrain.stage`` (say) now lives in ``pipetrain.runtime.stage``; importing the old name
gives that very module (one object: patching either patches both), so code and documents
written against the flat layout keep working. New code imports the grouped paths.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from types import ModuleType

MOVED = {  # old module name under pipetrain -> the subpackage it moved to
    "agreement": "runtime",
    "assembly": "runtime",
    "batchnorm": "training",
    "checkpointing": "checkpoints",
    "cli": "tools",
    "cli_train": "tools",
    "compensation": "training",
    "config": "runtime",
    "cuda_graphs": "runtime",
    "data_parallel": "runtime",
    "delayed": "training",
    "distributed": "runtime",
    "executor": "runtime",
    "gantt": "observe",
    "inflight": "runtime",
    "layers": "training",
    "lazy": "training",
    "memory": "observe",
    "meta": "runtime",
    "meta_profile": "observe",
    "metrics": "observe",
    "microbatch": "runtime",
    "pipeline": "runtime",
    "placement": "runtime",
    "planning": "tools",
    "precision": "training",
    "profiler": "observe",
    "progress": "observe",
    "readback": "runtime",
    "restart": "checkpoints",
    "rng": "runtime",
    "runner": "runtime",
    "stage": "runtime",
    "stage_module": "runtime",
    "tags": "runtime",
    "task": "tools",
    "trace": "observe",
    "transport": "runtime",
    "update": "runtime",
    "weightfile": "checkpoints",
    "weights": "training",
    "world": "runtime",
}


class _Alias(importlib.abc.Loader):
    """Loads an old name as the module at its new place."""

    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module at the new place ran already); only give it back its own
        spec, which the import of the old name replaced."""
        module.__spec__ = self.spec


class _OldPaths(importlib.abc.MetaPathFinder):
    """Finds ``pipetrain.<old>`` for every name in :data:`MOVED`."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.partition(".")
        if package != "pipetrain" or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(
            fullname, _Alias(f"pipetrain.{MOVED[name]}.{name}")
        )


def install() -> None:
    """Make the old paths importable (once per interpreter)."""
    if not any(isinstance(f, _OldPaths) for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPaths())  # before any finder of a stale flat copy
