"""Gantt pictures of pipeline timelines: one row per rank, one colour per micro-batch.

With one stage per rank a row is a stage; when a rank holds several stages (interleaved), each
bar is labelled with its stage.

Measured traces and simulated schedules are both lists of Spans, so they draw alike and can be
put side by side. Needs matplotlib (`pip install "pipetrain[viz]"`), imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from schedules import Kind, Span, bubble_fraction
from schedules.action import STEP_KINDS, TIMED


def pyplot() -> Any:
    """matplotlib.pyplot drawing to files; an ImportError naming the extra to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError('drawing needs matplotlib: pip install "pipetrain[viz]"') from error
    return plt


STEP_COLOUR = "0.6"  # optimizer steps: grey
STEP_COLOURS = {Kind.REDUCE: "0.8", Kind.AGREE: "0.4", Kind.STEP: STEP_COLOUR}  # the step's


def legend(kinds: set[Kind]) -> list[tuple[str, int | str, str | None]]:
    """(label, colour, hatch) of each kind of bar drawn: a micro-batch's forward in the dark
    shade of its colour, its backward in the light one (hatched: weight gradients, W), and the
    step's actions in greys: the gradient reduction light, the agreement dark, the optimizer
    step between. Colours stand for micro-batches, so the legend shows the shades
    of micro-batch 0 (an int: a colour of the tab20 map; a str: a matplotlib colour)."""
    entries: list[tuple[str, int | str, str | None, Kind]] = [
        ("forward (dark shade)", 0, None, Kind.FORWARD),
        ("backward (light shade)", 1, None, Kind.BACKWARD),
        ("weight gradient (W)", 1, "//", Kind.WEIGHT),
        ("gradient reduction (REDUCE)", STEP_COLOURS[Kind.REDUCE], None, Kind.REDUCE),
        ("step agreement (AGREE)", STEP_COLOURS[Kind.AGREE], None, Kind.AGREE),
        ("optimizer step", STEP_COLOUR, None, Kind.STEP),
    ]
    return [(label, colour, hatch) for label, colour, hatch, kind in entries if kind in kinds]


def draw(panels: Sequence[tuple[str, Sequence[Span]]], path: str | Path) -> Path:
    """One panel per (title, spans), stacked, sharing the time axis (ms from each panel's
    start), with a legend of the bars (:func:`legend`)."""
    plt = pyplot()
    rows = max((s.lane for _, spans in panels for s in spans), default=0) + 1
    by_rank = any(s.rank is not None for _, spans in panels for s in spans)
    micro = max((s.action.microbatch for _, spans in panels for s in spans), default=0) + 1
    colours = plt.get_cmap("tab20")
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(12, 0.5 + 0.45 * rows * len(panels) + 0.4 * len(panels)),
        sharex=True, squeeze=False,
    )
    for ax, (title, spans) in zip(axes[:, 0], panels, strict=True):
        origin = min((s.start for s in spans), default=0.0)
        for s in spans:
            a = s.action
            if a.kind not in TIMED:
                continue
            colour: object = STEP_COLOURS.get(a.kind)
            if a.kind not in STEP_KINDS:
                colour = colours((2 * a.microbatch + (a.kind is not Kind.FORWARD)) % 20)
            start, width = (s.start - origin) * 1e3, s.duration * 1e3
            hatch = "//" if a.kind is Kind.WEIGHT else None
            ax.barh(s.lane, width, left=start, height=0.8, color=colour, edgecolor="white",
                    hatch=hatch)
            if a.kind not in STEP_KINDS:
                label = str(a) if by_rank else f"{a.kind.value}{a.microbatch}"
                ax.text(start + width / 2, s.lane, label,
                        ha="center", va="center", fontsize=6, clip_on=True)
        name = "rank" if by_rank else "stage"
        ax.set_yticks(range(rows), [f"{name} {r}" for r in range(rows)])
        ax.invert_yaxis()
        ax.set_title(f"{title} — bubble {bubble_fraction(spans):.1%}", fontsize=10)
    axes[-1, 0].set_xlabel(f"ms ({micro} micro-batches)")
    _add_legend(plt, fig, {s.action.kind for _, spans in panels for s in spans})
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return out


def _add_legend(plt: Any, fig: Any, kinds: set[Kind]) -> None:
    """The legend of ``kinds``' bars, below the figure."""
    from matplotlib.patches import Patch

    colours = plt.get_cmap("tab20")
    handles = [
        Patch(facecolor=colours(c) if isinstance(c, int) else c, hatch=hatch, label=label,
              edgecolor="white")
        for label, c, hatch in legend(kinds)
    ]
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0),
               ncol=len(handles), fontsize=8, frameon=False)
