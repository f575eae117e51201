"""DualPipeV: two stages per rank in a V, a forward of one stage overlapped with a backward of
the other in the steady phase.

DeepSeek's DualPipe (DeepSeek-V3 technical report, 2024) runs two pipelines in opposite
directions; DualPipeV is its folded form on one V (rank r holds stages r and 2p-1-r, as ZB-V;
torch's ``ScheduleDualPipeV``). Each rank warms up with forwards (more of them the nearer the
V's top it is), then in its steady phase alternates overlapped pairs, a forward on one of its
stages with a whole backward (B then W) on the other, and drains with backwards whose weight
passes are put off (split B and W) from the middle of the drain on, to fill its bubbles. Here
an overlapped pair is two actions next to each other (``schedules/overlap.py``): a CPU runs
them in order; on a GPU the halves may run at once. It needs at least 2p micro-batches.
"""

from __future__ import annotations

from collections import deque

from schedules.action import Action, Kind, Schedule, check_sizes, check_v
from schedules.generators import from_order
from schedules.list_scheduling import v_placement
from schedules.overlap import overlapped


class _RankOrder:
    """One rank's compute order as DualPipeV writes it: the next micro-batch per stage and
    kind, the weight passes put off, and the overlapped pairs."""

    def __init__(self) -> None:
        self.order: list[Action] = []
        self.pairs: list[tuple[Action, Action]] = []
        self._next: dict[tuple[Kind, int], int] = {}
        self._put_off: deque[Action] = deque()

    def _take(self, kind: Kind, stage: int) -> Action:
        i = self._next.get((kind, stage), 0)
        self._next[kind, stage] = i + 1
        return Action(kind, stage, i)

    def forward(self, stage: int) -> Action:
        action = self._take(Kind.FORWARD, stage)
        self.order.append(action)
        return action

    def backward(self, stage: int, split: bool = False) -> Action:
        """B of ``stage``'s next micro-batch; its W follows at once unless ``split`` puts it
        off (to :meth:`weight`)."""
        action = self._take(Kind.BACKWARD, stage)
        self.order.append(action)
        weight = Action(Kind.WEIGHT, stage, action.microbatch)
        if split:
            self._put_off.append(weight)
        else:
            self.order.append(weight)
        return action

    def weight(self) -> None:
        """The oldest weight pass put off, if any."""
        if self._put_off:
            self.order.append(self._put_off.popleft())

    def overlap(self, forward_stage: int, backward_stage: int) -> None:
        self.pairs.append((self.forward(forward_stage), self.backward(backward_stage)))


def _rank_order(rank: int, ranks: int, microbatches: int) -> _RankOrder:
    """Rank ``rank``'s DualPipeV order: down stage ``rank``, up stage ``2p - 1 - rank``."""
    p, r, m = ranks, rank, microbatches
    down, up = r, 2 * p - 1 - r
    rank_order = _RankOrder()
    for _ in range(2 * (p - r - 1)):  # the down stage's warm-up
        rank_order.forward(down)
    for _ in range(r + 1):  # both stages' warm-up
        rank_order.forward(down)
        rank_order.forward(up)
    for _ in range(p - r - 1):  # the up stage's first backwards, each followed by a forward
        rank_order.backward(up, split=True)
        rank_order.weight()
        rank_order.forward(up)
    for i in range(m - 2 * p + r + 1):  # the steady phase: two overlapped pairs at a time
        if i == 0 and r == p - 1:  # the V's bottom: the first pair is not overlapped
            rank_order.forward(down)
            rank_order.backward(up)
        else:
            rank_order.overlap(down, up)
        rank_order.overlap(up, down)
    for _ in range(p - r - 1):
        rank_order.backward(up)
        rank_order.overlap(up, down)
    split = False  # from the drain's middle on, weight passes are put off to fill its bubbles
    for i in range(r + 1):
        split = split or (i == (r + 1) // 2 and r % 2 == 1)
        rank_order.backward(up, split)
        split = split or (i == (r + 1) // 2 and r % 2 == 0)
        rank_order.backward(down, split)
    for _ in range(p - r - 1):
        rank_order.weight()
        rank_order.backward(down, split)
    for _ in range(r + 1):
        rank_order.weight()
    return rank_order


def dualpipev(ranks: int, microbatches: int, chunks_per_rank: int = 2) -> Schedule:
    """DualPipeV over ``ranks`` ranks (2p stages in a V) and ``microbatches`` >= 2p."""
    check_sizes(ranks, microbatches)
    check_v("dualpipev", chunks_per_rank)
    if microbatches < 2 * ranks:
        raise ValueError(
            f"dualpipev needs at least as many micro-batches as stages ({2 * ranks} on "
            f"{ranks} ranks), got {microbatches}: raise the micro-batch count "
            "(Pipeline(chunks=...)), or use zbv"
        )
    orders = [_rank_order(r, ranks, microbatches) for r in range(ranks)]
    schedule = from_order(
        "dualpipev", 2 * ranks, microbatches, lambda r: orders[r].order, v_placement(ranks)
    )
    return overlapped(schedule, [pair for o in orders for pair in o.pairs])
