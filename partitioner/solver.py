"""pulp across its releases (2.7 through 4.x), for the integer program in :mod:`partitioner.ilp`.

pulp 4 rebuilt its core: variables belong to their model, ``LpAffineExpression`` no longer takes
a constant, ``solve`` returns a record instead of a status code, and no solver comes bundled
(pulp < 4 ships CBC). This module is the one place that knows; the program reads the same on
every release. pulp 4 solves with HiGHS (``highspy``, a dependency of pipetrain for this).
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any

import pulp

OPTIMAL = 1  # pulp's LpStatusOptimal (< 4) and LpSolveStatus.Optimal (4)
_banner_taken = threading.Lock()
_banner_shown = False


def variable(model: pulp.LpProblem, name: str, cat: str) -> pulp.LpVariable:
    """A non-negative variable of ``model`` (pulp >= 3.3 attaches variables to their model)."""
    if hasattr(model, "add_variable"):
        return model.add_variable(name, lowBound=0, cat=cat)
    return pulp.LpVariable(name, lowBound=0, cat=cat)


def constant(value: float) -> pulp.LpAffineExpression:
    """The expression that is ``value`` alone."""
    return pulp.lpSum([]) + value


def solve(model: pulp.LpProblem, time_limit: float | None) -> bool:
    """Solve ``model``; whether it found the optimum."""
    result = model.solve(_solver(time_limit))
    return int(getattr(result, "status", result)) == OPTIMAL


def _solver(time_limit: float | None) -> Any:
    """pulp's bundled CBC where it ships one, else HiGHS through highspy."""
    cbc = getattr(pulp, "PULP_CBC_CMD", None)
    if cbc is not None:
        with warnings.catch_warnings():
            # pulp 3 marks its bundled CBC for removal in pulp 4 yet ships no other solver.
            warnings.simplefilter("ignore", DeprecationWarning)
            return cbc(msg=False, timeLimit=time_limit)
    highs = pulp.HiGHS(msg=False, timeLimit=time_limit)
    if not highs.available():
        raise RuntimeError(
            f"pulp {pulp.__version__} bundles no solver and HiGHS is not installed: "
            "pip install highspy (a dependency of pipetrain; was it installed with --no-deps?)"
        )
    _take_banner()
    return highs


def _take_banner() -> None:
    """highspy prints its banner to the process's stdout at its first ``Highs()``, whatever
    ``msg`` says, which would corrupt a command's printed plan: build that first one with
    file descriptor 1 pointed at /dev/null."""
    global _banner_shown
    with _banner_taken:
        if _banner_shown:
            return
        import highspy

        sys.stdout.flush()
        saved = os.dup(1)
        try:
            with open(os.devnull, "w") as null:
                os.dup2(null.fileno(), 1)
                highspy.Highs()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        _banner_shown = True
