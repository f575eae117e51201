"""What the commands that build a model (``profile``, ``train``) share: the factory named on
the command line, ``MODULE:FUNCTION`` or ``hf:DIR``. Apart from cli_common.py because a
Hugging Face model needs torch, which the planning commands never import."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipetrain.hf.task import layers
from pipetrain.tools.cli_common import HF_PREFIX, UsageError


def import_factory(target: str) -> Callable[..., Any]:
    """The function named by ``module.path:function`` or ``path/to/file.py:function``; for
    ``hf:DIR`` (a Hugging Face directory or config JSON), one that builds its layers."""
    if target.startswith(HF_PREFIX):
        return lambda: layers(target.removeprefix(HF_PREFIX))
    module_name, sep, attr = target.rpartition(":")
    if not sep or not module_name or not attr:
        raise UsageError(
            f"expected MODULE:FUNCTION (e.g. examples.models:resnet_like), got {target!r}"
        )
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` would: modules of the current directory
    module = _import_module(module_name)
    factory: Callable[..., Any] | None = getattr(module, attr, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise UsageError(
            f"module {module_name!r} has no function {attr!r}; it has: {', '.join(names) or '-'}"
        )
    return factory


def _import_module(module_name: str) -> Any:
    """A module by dotted name, or a ``.py`` file by path; failures as one-line errors."""
    try:
        if not module_name.endswith(".py"):
            return importlib.import_module(module_name)
        path = Path(module_name)
        if not path.is_file():
            raise UsageError(f"no such file: {module_name}")
        spec = importlib.util.spec_from_file_location(path.stem, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    except UsageError:
        raise
    except ModuleNotFoundError as error:
        raise UsageError(
            f"cannot import {module_name!r}: {error} (run from the directory that holds it, "
            "or put it on PYTHONPATH)"
        ) from None
    except Exception as error:
        raise UsageError(
            f"importing {module_name!r} failed: {type(error).__name__}: {error}"
        ) from None
