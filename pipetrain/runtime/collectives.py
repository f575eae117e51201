"""Collectives across the processes of a torchrun job, each bounded by the pipeline's timeout,
whose failures name the peer.

Every collective a pipeline runs outside its stage messages (the settings and first-step batch
checks, the step's agreement, the gradient and loss all-reduces over replicas, barriers and
gathers) waits through :class:`Collectives`: one that returns a ``dist.Work`` for at most
``timeout`` (``Work.wait(timeout=...)``); one that does not (the object collectives, torch's
blocking helpers) in a group created with that timeout (placement.py), which gloo applies to
each of its operations. A failure raises CommunicationTimeout (naming the peers it waited for)
or PeerError (the reason the failing stage published, else the peers this rank lost the
connection to), in the form "stage S (rank R)", and stops every peer (the transport's abort):
the collective's error alone names no one ("Connection closed by peer").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch.distributed as dist

from pipetrain.errors import CommunicationTimeout, PeerError, PipelineError
from pipetrain.runtime.transport import DistributedTransport, is_timeout
from schedules import Schedule

T = TypeVar("T")


def rank_names(schedule: Schedule, members: Sequence[int], replicas: int) -> dict[int, str]:
    """How errors name each global rank of ``members`` (replica-major, placement.py):
    "stage S (rank R)", its replica added where there are several."""
    names = {}
    for index, global_rank in enumerate(members):
        replica, rank = divmod(index, schedule.ranks)
        stages = schedule.stages_on(rank)
        named = f"stage {stages[0]}" if len(stages) == 1 else (
            f"stages {', '.join(map(str, stages))}")
        of = f" of replica {replica}" if replicas > 1 else ""
        names[global_rank] = f"{named}{of} (rank {global_rank})"
    return names


class Collectives:
    """Bounded waits on this process's collectives (module docstring); ``names``: how errors
    name each global rank (:func:`rank_names`)."""

    def __init__(self, transport: DistributedTransport, names: dict[int, str], timeout: float):
        self.transport, self.names, self.timeout = transport, names, timeout

    def wait(self, work: dist.Work | None, what: str, *groups: dist.ProcessGroup) -> None:
        """Wait at most ``timeout`` for ``work``, collective ``what`` in ``groups``."""
        assert work is not None, "an async_op collective returns its Work"
        try:
            work.wait(timeout=timedelta(seconds=self.timeout))
        except RuntimeError as error:
            self.failed(error, what, groups)

    def call(self, what: str, groups: Sequence[dist.ProcessGroup], run: Callable[[], T]) -> T:
        """``run()``, a blocking collective ``what`` in ``groups``, each created with the
        pipeline's timeout (gloo bounds each operation by it: torch's object collectives take
        no timeout of their own). A PipelineError inside (an inner call's, named already)
        passes as it is."""
        try:
            return run()
        except PipelineError:
            raise
        except RuntimeError as error:
            self.failed(error, what, groups)

    def bounded(
        self, what: str, groups: Sequence[dist.ProcessGroup], function: Callable[..., T]
    ) -> Callable[..., T]:
        """``function`` (one of torch's, running collective ``what`` in ``groups``: FSDP2's,
        ZeroRedundancyOptimizer's) with each call's failure named as :meth:`call` names it."""

        def named(*args: object, **options: object) -> T:
            return self.call(what, groups, lambda: function(*args, **options))

        return named

    def failed(
        self, error: RuntimeError, what: str, groups: Sequence[dist.ProcessGroup]
    ) -> NoReturn:
        """Raise a backend ``error`` of collective ``what`` in ``groups`` as an error naming
        the peer, after stopping every peer: the stage that stopped, as it published; the
        peers this rank lost the connection to (probed: a collective's error does not say
        which); on a timeout, the peers it waited for."""
        failure = self._failure(error, what, groups)
        self.transport.abort(str(failure))
        raise failure from error

    def _failure(
        self, error: RuntimeError, what: str, groups: Sequence[dist.ProcessGroup]
    ) -> PeerError:
        me = dist.get_rank()
        peers = sorted({r for g in groups for r in dist.get_process_group_ranks(g)} - {me})
        where = f"{self.names[me]}: {what}"
        if is_timeout(error):
            return CommunicationTimeout(
                f"{where} with {self.named(peers)} did not complete within "
                f"timeout={self.timeout:g} s. The peer is slow, hung or its schedule differs; "
                f"raise Pipeline(timeout=...) if it is only slow. ({error})"
            )
        reason = self.transport.stop_reason()
        if reason:
            return PeerError(f"{where} failed: {reason}")
        lost = [r for g in groups for r in self.transport.lost(g)]
        return PeerError(
            f"{where} lost the connection to {self.named(lost or peers)}; its process "
            f"probably died ({error})"
        )

    def named(self, ranks: Sequence[int]) -> str:
        """``ranks`` (global) as errors name them."""
        return ", ".join(self.names.get(r, f"rank {r}") for r in sorted(set(ranks)))
