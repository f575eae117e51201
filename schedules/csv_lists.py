"""Action lists as CSV in torch.distributed.pipelining's format: one row per rank, one cell per
action written ``{stage}{type}{micro-batch}`` ("0F1", "1I0", "1W0", "0SEND_F1", "1RECV_B0").

Two forms, as torch reads them: compute only (F, B, or I and W where the backward is split),
whose messages :func:`schedules.generators.from_order` places; and with communication
(SEND_F, RECV_F, SEND_B, RECV_B written out), taken as listed. Either way the step closes each
rank's list and the validator checks the result, so a list that would deadlock or drop a
micro-batch is refused naming the rank and the action. torch's UNSHARD, RESHARD and
REDUCE_GRAD cells are skipped (pipetrain shards and reduces by ``zero=`` and the step);
OVERLAP_F_B is refused.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import replace
from typing import NoReturn

from schedules.action import Action, Kind, Schedule, step_tail
from schedules.errors import ScheduleError
from schedules.generators import from_order
from schedules.validate import validate

_CELL = re.compile(r"(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)")
_KIND = {
    "F": Kind.FORWARD, "I": Kind.BACKWARD, "B": Kind.BACKWARD, "W": Kind.WEIGHT,
    "SEND_F": Kind.SEND_ACT, "RECV_F": Kind.RECV_ACT,
    "SEND_B": Kind.SEND_GRAD, "RECV_B": Kind.RECV_GRAD,
}
_SKIPPED = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
_TORCH = {
    Kind.FORWARD: "F", Kind.WEIGHT: "W", Kind.SEND_ACT: "SEND_F", Kind.RECV_ACT: "RECV_F",
    Kind.SEND_GRAD: "SEND_B", Kind.RECV_GRAD: "RECV_B",
}


def to_csv(schedule: Schedule, communication: bool = False) -> str:
    """``schedule``'s lists in torch's CSV, compute only unless ``communication``; the step's
    REDUCE, AGREE and STEP have no torch cell and are left out."""
    backward = "I" if schedule.splits_backward else "B"
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(schedule.ranks):
        cells = [
            f"{a.stage}{_TORCH.get(a.kind, backward)}{a.microbatch}"
            for a in schedule.actions[rank]
            if a.kind in _TORCH or a.kind is Kind.BACKWARD
        ]
        writer.writerow([c for c in cells if communication or not _is_message(c)])
    return out.getvalue()


def _is_message(cell: str) -> bool:
    return "SEND" in cell or "RECV" in cell


def from_csv(text: str, name: str = "csv") -> Schedule:
    """The schedule a CSV in torch's format lists (``text`` is the file's contents), checked by
    the validator; raises ScheduleError naming the rank and cell it cannot take."""
    rows = [_parse_row(rank, row) for rank, row in enumerate(csv.reader(io.StringIO(text)))]
    rows = [row for row in rows if row]
    if not rows:
        _refuse("the CSV lists no action")
    actions = [a for row in rows for a in row]
    stages = max(a.stage for a in actions) + 1
    microbatches = max(a.microbatch for a in actions) + 1
    placement = _placement(rows, stages)
    split = [a for a in actions if a.kind is Kind.WEIGHT]
    if split and _full_backwards(text):
        _refuse("the CSV mixes whole backwards (B) with split ones (I and W): pipetrain's lists "
                "split every backward or none")
    if any(a.kind not in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT) for a in actions):
        listed = {r: (*row, *step_tail(_own(placement, r))) for r, row in enumerate(rows)}
        schedule = Schedule(name, stages, microbatches, listed, placement)
    else:
        try:
            schedule = from_order(name, stages, microbatches, rows.__getitem__, placement)
        except ValueError as error:  # the orders wait on each other: no messages can join them
            raise ScheduleError(f"the CSV's compute orders cannot run: {error}") from None
    validate(schedule)
    return replace(schedule, name=name)


def _parse_row(rank: int, row: list[str]) -> list[Action]:
    """One rank's cells as actions, torch's sharding cells left out."""
    actions = []
    for position, cell in enumerate(c.strip() for c in row):
        match = _CELL.fullmatch(cell)
        if not cell or (match and match.group(2) in _SKIPPED):
            continue
        if match is None or not match.group(3):
            _refuse(f"rank {rank}, cell {position}: {cell!r} is no action pipetrain runs "
                    "(write {stage}{F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B}{micro-batch}, e.g. 0F1)")
        stage, kind, microbatch = match.groups()
        actions.append(Action(_KIND[kind], int(stage), int(microbatch)))
    return actions


def _placement(rows: list[list[Action]], stages: int) -> tuple[int, ...]:
    """Each stage's rank: the row that computes it; refused where two rows or none do."""
    where: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for a in row:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT):
                if where.setdefault(a.stage, rank) != rank:
                    _refuse(f"stage {a.stage} is computed on rank {where[a.stage]} and on rank "
                            f"{rank} ({a}): each stage runs on one rank")
    missing = [s for s in range(stages) if s not in where]
    if missing:
        _refuse(f"stage {missing[0]} is never computed: no rank forwards it")
    return tuple(where[s] for s in range(stages))


def _own(placement: tuple[int, ...], rank: int) -> list[int]:
    return [s for s, r in enumerate(placement) if r == rank]


def _full_backwards(text: str) -> bool:
    return re.search(r"(^|,)\s*\d+B\d+", text, re.MULTILINE) is not None


def _refuse(reason: str) -> NoReturn:
    raise ScheduleError(reason)
