"""Hunt each known kind of wrong training with the generator and print its smallest case; or
count what a sample of cases exercises and how each fared.

``python -m tests.property.hunt [WORDS]`` runs, per hunt (those whose names hold one of the
WORDS, or all), hypothesis' ``find`` over a narrowed part of the model space (derandomized: the
same cases every run) for a case whose outcome is of the hunted kind, shrinks it, and prints it
with the difference from plain training it shows. This
is how docs/property-tests.md's table of what the generator found was made; the cases found
are kept as tests in test_regressions.py.

``python -m tests.property.hunt --census N`` trains the cases ``RandomChooser(0..N-1)`` draw
and prints, per feature, how many cases exercised it and how many of those failed, by kind of
failure (the first words of the outcome).
"""

from __future__ import annotations

import logging
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from hypothesis import HealthCheck, find, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from tests.property.model_space import (
    SCHEDULES,
    Case,
    RandomChooser,
    draw_case,
    features,
    largest_difference,
    train_pipeline,
    train_reference,
)
from tests.property.test_equivalence import TOLERANCE, HypothesisChooser


def outcome(case: Case) -> str | None:
    """None when the case trains like plain training (or plain training refuses it), else
    what went wrong: "missing: ...", "differs: ..." or "error: ..."."""
    try:
        expected = train_reference(case)
    except RuntimeError:
        return None
    try:
        worst, where = largest_difference([train_pipeline(case, timeout=20)], expected)
    except Exception as error:  # the pipeline failed where plain training did not
        return f"error: {type(error).__name__}: {error}".splitlines()[0]
    if worst <= TOLERANCE:
        return None
    return f"{'missing' if 'no rank holds' in where else 'differs'}: {where} by {worst:.3g}"


@dataclass(frozen=True)
class Hunt:
    name: str
    kind: Callable[[str], bool]  # the outcomes this hunt looks for
    leave_out: frozenset[str] = frozenset()
    schedules: Sequence[str] = SCHEDULES
    most_stages: int = 4


HUNTS = [
    Hunt("a module used twice in one stage is dropped", lambda o: o.startswith("missing")),
    Hunt("in-place op on a view of a weighted layer's output, split backward",
         lambda o: o.startswith("differs"), frozenset({"again", "detach"}),
         ("zb-h1", "zb-h2"), most_stages=1),
    Hunt("in-place op on a view, the per-layer cut of 1f1b/gpipe's last backward",
         lambda o: o.startswith("differs"), frozenset({"again", "detach"}), ("1f1b", "gpipe")),
    Hunt("a stage input without gradient sends zeros (AdamW decays the stage before)",
         lambda o: o.startswith("differs"), frozenset({"again", "relu_"})),
    Hunt("a stage beginning with an in-place op fails",
         lambda o: "leaf Variable" in o, frozenset({"again", "detach"})),
    Hunt("an in-place first layer fails (recomputed, or at 2+ micro-batches)",
         lambda o: "modified by an inplace" in o, frozenset({"again", "detach"})),
    Hunt("a stage whose input needs no gradient fails the stage before (after fix-runtime)",
         lambda o: "arrived before" in o),
]


def hunt(h: Hunt, examples: int = 2000) -> tuple[Case, str] | None:
    """The smallest case with an outcome of ``h``'s kind, and that outcome."""

    @st.composite
    def cases(draw: st.DrawFn) -> Case:
        return draw_case(HypothesisChooser(draw), leave_out=h.leave_out, schedules=h.schedules,
                         most_stages=h.most_stages)

    def found(case: Case) -> bool:
        said = outcome(case)
        return said is not None and h.kind(said)

    try:
        case = find(cases(), found, settings=settings(
            max_examples=examples, derandomize=True, database=None, deadline=None,
            suppress_health_check=list(HealthCheck)))
    except NoSuchExample:
        return None
    said = outcome(case)
    assert said is not None
    return case, said


KINDS = {  # a phrase of the outcome -> the kind of failure it shows
    "missing": "a layer's parameters missing",
    "differs": "wrong parameters",
    "arrived before": "'gradients arrived before' error",
    "leaf Variable": "in-place on a leaf error",
    "modified by an inplace": "in-place version error",
}


def kind_of(said: str) -> str:
    return next((kind for phrase, kind in KINDS.items() if phrase in said), said[:60])


def census(count: int) -> None:
    """Per feature: cases, failures, and the commonest kinds of failure among them."""
    cases: Counter[str] = Counter()
    failed: dict[str, Counter[str]] = defaultdict(Counter)
    for seed in range(count):
        case = draw_case(RandomChooser(seed))
        said = outcome(case)
        for feature in features(case):
            cases[feature] += 1
            if said is not None:
                failed[feature][kind_of(said)] += 1
    print(f"| feature | cases of {count} | failed | failures by kind |\n|---|---|---|---|")
    for feature, n in sorted(cases.items()):
        kinds = failed[feature]
        said = ", ".join(f"{k} {c}" for k, c in kinds.most_common())
        print(f"| {feature} | {n} | {sum(kinds.values())} | {said} |")


def main(names: Sequence[str]) -> None:
    torch.set_num_threads(1)
    logging.disable(logging.CRITICAL)  # a failing stage logs its traceback; outcome() says it
    if names[:1] == ["--census"]:
        census(int(names[1]))
        return
    for h in HUNTS:
        if names and not any(n in h.name for n in names):
            continue
        result = hunt(h)
        print(f"## {h.name}")
        print("not found" if result is None else f"{result[0]}\n-> {result[1]}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
