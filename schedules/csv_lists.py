"""Action lists as CSV in torch.distributed.pipelining's format: one row per rank, one cell per
action written ``{stage}{type}{micro-batch}`` ("0F1", "1I0", "1W0", "0SEND_F1", "1RECV_B0").

Two forms, as torch reads them: compute only (F, B, or I and W where the backward is split),
whose messages :func:`schedules.generators.from_order` places; and with communication
(SEND_F, RECV_F, SEND_B, RECV_B written out), taken as listed. Either way the step closes each
rank's list and the validator checks the result, so a list that would deadlock or drop a
micro-batch is refused naming the rank and the action. torch's UNSHARD, RESHARD and
REDUCE_GRAD cells are skipped (pipetrain shards and reduces by ``zero=`` and the step).

A whole backward (B) in a list that splits others (I and W: torch's DualPipeV mixes them) is
read as its B with its W right after. An overlapped pair (``schedules/overlap.py``) is torch's
cell ``(0F3;3B1)OVERLAP_F_B``, its halves in order; the compute-only form writes pairs so, the
form with communication writes their halves apart (pipetrain lists the forward's send and the
backward's receive between them, where torch lists every receive before the pair and every
send after it).
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import replace
from typing import NoReturn

from schedules.action import COMPUTE, Action, Kind, Schedule, step_tail
from schedules.errors import ScheduleError
from schedules.generators import from_order
from schedules.overlap import overlapped
from schedules.validate import validate

_CELL = re.compile(r"(\d+)(F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)")
_KIND = {
    "F": Kind.FORWARD, "I": Kind.BACKWARD, "B": Kind.BACKWARD, "W": Kind.WEIGHT,
    "SEND_F": Kind.SEND_ACT, "RECV_F": Kind.RECV_ACT,
    "SEND_B": Kind.SEND_GRAD, "RECV_B": Kind.RECV_GRAD,
}
_PAIR = re.compile(r"\((.*)\)OVERLAP_F_B")
_SKIPPED = {"UNSHARD", "RESHARD", "REDUCE_GRAD"}
_TORCH = {
    Kind.FORWARD: "F", Kind.WEIGHT: "W", Kind.SEND_ACT: "SEND_F", Kind.RECV_ACT: "RECV_F",
    Kind.SEND_GRAD: "SEND_B", Kind.RECV_GRAD: "RECV_B",
}


def to_csv(schedule: Schedule, communication: bool = False) -> str:
    """``schedule``'s lists in torch's CSV, compute only unless ``communication``; the step's
    REDUCE, AGREE and STEP have no torch cell and are left out."""
    backward = "I" if schedule.splits_backward else "B"
    pairs = {} if communication else dict(schedule.overlaps)  # forward -> its backward
    later = set(pairs.values())
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    for rank in range(schedule.ranks):
        listed = [a for a in schedule.actions[rank] if a.kind in _TORCH or a.kind is Kind.BACKWARD]
        cells = [
            f"({_cell(a, backward)};{_cell(pairs[a], backward)})OVERLAP_F_B" if a in pairs
            else _cell(a, backward)
            for a in listed
            if (communication or a.kind in COMPUTE) and a not in later
        ]
        writer.writerow(cells)
    return out.getvalue()


def _cell(action: Action, backward: str) -> str:
    return f"{action.stage}{_TORCH.get(action.kind, backward)}{action.microbatch}"


def from_csv(text: str, name: str = "csv") -> Schedule:
    """The schedule a CSV in torch's format lists (``text`` is the file's contents), checked by
    the validator; raises ScheduleError naming the rank and cell it cannot take."""
    split = re.search(r"\d+W\d+", text) is not None
    pairs: list[tuple[Action, Action]] = []
    rows = [_parse_row(rank, row, split, pairs)
            for rank, row in enumerate(csv.reader(io.StringIO(text)))]
    rows = [row for row in rows if row]
    if not rows:
        _refuse("the CSV lists no action")
    actions = [a for row in rows for a in row]
    stages = max(a.stage for a in actions) + 1
    microbatches = max(a.microbatch for a in actions) + 1
    placement = _placement(rows, stages)
    if any(a.kind not in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT) for a in actions):
        listed = {r: (*row, *step_tail(_own(placement, r))) for r, row in enumerate(rows)}
        schedule = Schedule(name, stages, microbatches, listed, placement)
    else:
        try:
            schedule = from_order(name, stages, microbatches, rows.__getitem__, placement)
        except ValueError as error:  # the orders wait on each other: no messages can join them
            raise ScheduleError(f"the CSV's compute orders cannot run: {error}") from None
    try:
        schedule = overlapped(schedule, pairs)
    except ValueError as error:
        raise ScheduleError(str(error)) from None
    validate(schedule)
    return replace(schedule, name=name)


def _parse_row(
    rank: int, row: list[str], split: bool, pairs: list[tuple[Action, Action]]
) -> list[Action]:
    """One rank's cells as actions, torch's sharding cells left out; a whole backward of a
    ``split`` list is its B and W, and each overlapped pair is added to ``pairs``."""
    actions = []
    for position, cell in enumerate(c.strip() for c in row):
        where = f"rank {rank}, cell {position}"
        if pair := _PAIR.fullmatch(cell):
            halves = [_actions(where, half.strip(), split) for half in pair.group(1).split(";")]
            if len(halves) != 2 or not all(halves):
                _refuse(f"{where}: {cell!r} overlaps no two actions (write (0F3;3B1)OVERLAP_F_B)")
            pairs.append((halves[0][0], halves[1][0]))
            actions += halves[0] + halves[1]
        else:
            actions += _actions(where, cell, split)
    return actions


def _actions(where: str, cell: str, split: bool) -> list[Action]:
    """The actions of one plain cell: none for an empty or sharding cell, B and W for a whole
    backward of a ``split`` list, else one."""
    match = _CELL.fullmatch(cell)
    if not cell or (match and match.group(2) in _SKIPPED):
        return []
    if match is None or not match.group(3):
        _refuse(f"{where}: {cell!r} is no action pipetrain runs (write "
                "{stage}{F|I|B|W|SEND_F|RECV_F|SEND_B|RECV_B}{micro-batch}, e.g. 0F1)")
    stage, kind, microbatch = int(match.group(1)), match.group(2), int(match.group(3))
    action = Action(_KIND[kind], stage, microbatch)
    if kind == "B" and split:
        return [action, Action(Kind.WEIGHT, stage, microbatch)]
    return [action]


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


def _refuse(reason: str) -> NoReturn:
    raise ScheduleError(reason)
