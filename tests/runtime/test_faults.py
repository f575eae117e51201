"""Faults across real processes (issue 22): every rank stops promptly with the root cause,
whether the failing rank dies, lives on, or stops answering (its host of the store included)."""

from __future__ import annotations

import os
import signal
import time

import pytest
from torch import nn

import pipetrain
from benchmarks.fault_runs import JOINS, ZERO_PLACES, passed, run_case, run_job
from pipetrain.errors import CommunicationTimeout, PipelineError, StageError
from tests.runtime.harness import run_ranks
from tests.runtime.models import batches, mlp, sgd
from tests.runtime.test_errors import FailOn


def _pipeline(model: nn.Sequential, balance, timeout: float, **options) -> pipetrain.Pipeline:
    return pipetrain.Pipeline(model, balance, loss_fn=nn.functional.cross_entropy, optimizer=sgd,
                              timeout=timeout, recompute="never", **options)


def _timed_step(pipe: pipetrain.Pipeline) -> tuple[str, str, float]:
    start = time.monotonic()
    try:
        pipe.train_step(*batches(1)[0])
    except PipelineError as error:
        return type(error).__name__, str(error), time.monotonic() - start
    return "ok", "", time.monotonic() - start


def _caught_failure(rank: int, world: int) -> tuple[str, str, float]:
    """Stage 1 fails; its process catches the StageError and lives on."""
    model = nn.Sequential(*mlp()[:6], FailOn(call=3), *mlp()[6:])
    pipe = _pipeline(model, [6, 7], timeout=30, chunks=4)
    outcome = _timed_step(pipe)
    if rank == 1:
        with pytest.raises(PipelineError, match="stopped after a failure"):
            pipe.train_step(*batches(1)[0])  # a failed pipeline refuses to go on
        time.sleep(3)  # alive while its peer waits
    return outcome


def test_a_caught_stage_failure_reaches_its_peer_at_once():
    """Today the peer waits out the whole timeout (30 s here), then blames a slow peer."""
    (kind0, message0, took0), (kind1, message1, _) = [v for _, v in run_ranks(
        _caught_failure, 2, deadline=90)]
    assert kind1 == "StageError" and "stage 1, layer 6 (FailOn)" in message1
    assert kind0 == "PeerError", message0
    assert "stage 1, layer 6 (FailOn), forward of micro-batch 2 failed" in message0, message0
    assert took0 < 10, f"the peer learned of the failure after {took0:.1f} s (timeout 30 s)"


def _ragged_on_stage_zero(rank: int, world: int) -> tuple[str, str, float]:
    class Ragged(nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            return x if self.calls == 1 else x[:, :-1]

    model = nn.Sequential(*mlp()[:5], Ragged(), *mlp()[5:])
    outcome = _timed_step(_pipeline(model, [6, 7], timeout=30, chunks=4))
    if rank == 0 and outcome[0] == "StageError" and "micro-batch 1 produced" in outcome[1]:
        os._exit(7)  # as a script ends on the uncaught error: at once, its store with it
    return outcome


def test_a_shape_mismatch_reaches_the_neighbour_as_the_root_cause():
    """Stage 0 hosts the store and ends right after failing; today its neighbour hears only
    "its process probably died"."""
    results = run_ranks(_ragged_on_stage_zero, 2, deadline=90)
    assert results[0] == ("died", 7), results[0]  # stage 0 failed on the shape mismatch
    kind1, message1, took1 = results[1][1]
    assert kind1 == "PeerError" and "micro-batch 1 produced" in message1, message1
    assert took1 < 10


def _dead_receiver(rank: int, world: int) -> tuple[str, str, float]:
    class Die(nn.Module):
        def forward(self, x):
            os._exit(3)

    class Slow(nn.Module):
        def forward(self, x):
            time.sleep(1.0)
            return x

    model = nn.Sequential(*mlp()[:5], Slow(), Die(), *mlp()[6:])
    return _timed_step(_pipeline(model, [6, 7], timeout=30, chunks=4, schedule="gpipe"))


def test_a_send_to_a_dead_peer_is_a_peer_error_naming_stage_peer_and_micro_batch():
    """Today: gloo's raw RuntimeError "Connection closed by peer" with C++ frames."""
    results = run_ranks(_dead_receiver, 2, deadline=90)
    assert results[1] == ("died", 3)
    status, (kind, message, took) = results[0]
    assert kind == "PeerError", message
    assert "stage 0 at action" in message, message
    assert "sending to stage 1 (rank 1) on micro-batch" in message, message
    assert took < 10


def _stopped_store_host(rank: int, world: int, pid_file: str) -> tuple[str, str, float]:
    class Stop(nn.Module):
        calls = 0

        def forward(self, x):
            self.calls += 1
            if self.calls == 2:
                os.kill(os.getpid(), signal.SIGSTOP)
            return x

    if rank == 0:
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    model = nn.Sequential(*mlp()[:5], Stop(), *mlp()[5:])
    outcome = _timed_step(_pipeline(model, [6, 7], timeout=3, chunks=4))
    if rank == 1:
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGKILL)  # the test's clean-up: rank 0 never wakes
    return outcome


@pytest.mark.slow  # waits out a 3 s timeout
def test_a_stopped_store_host_times_out_within_the_timeout(tmp_path):
    """Today the peer, past its timeout, blocks on the store that the stopped rank hosts."""
    results = run_ranks(_stopped_store_host, 2, str(tmp_path / "pid"), deadline=60)
    assert results[0] == ("died", -signal.SIGKILL)
    status, (kind, message, took) = results[1]
    assert kind == CommunicationTimeout.__name__, message
    assert "timeout=3 s" in message, message
    assert took < 3 + 2.5, f"stopped after {took:.1f} s with timeout=3"


SCRIPT_CASES = [("stopped store host", "CommunicationTimeout", "stage 0 (rank 0)"),
                ("killed rank", "PeerError", "stage 1 (rank 1)")]
# a stopped peer is waited out (timeout=3, then the exit): the script case keeps one in the
# fast run, the others wait in the slow one
SCRIPT_CASES_STOP_SLOW = [pytest.param(*SCRIPT_CASES[0], marks=pytest.mark.slow), SCRIPT_CASES[1]]


@pytest.mark.parametrize(("case", "kind", "peer"), SCRIPT_CASES)
def test_a_scripts_other_rank_exits_naming_the_peer(case, kind, peer):
    """A user's script (tests/runtime/jobs/fault_job.py) whose peer is SIGSTOPped (the store's
    host) or SIGKILLed mid-training, from outside, at a random moment: the other process
    exits non-zero within timeout + 10 s (timeout=3). Before: after a stop it raised but did
    not exit (its gloo teardown waited 600 s for a collective with the stopped rank)."""
    run = run_case(case, timeout=3, seed=int(time.time()))
    assert passed(run, 3), run
    assert kind in run.error and peer in run.error, run.error


@pytest.mark.parametrize(("case", "kind", "peer"), SCRIPT_CASES_STOP_SLOW)
def test_a_peer_lost_in_a_collective_is_named_and_the_rank_exits(case, kind, peer):
    """The same, the peer hit as it enters the step's agreement, so that the other rank
    waits in an all-reduce, not a receive. Before: "lost the connection to a peer", naming
    no one, and after a stop no exit."""
    run = run_case(case, timeout=3, at_agree=True)
    assert passed(run, 3), run
    assert kind in run.error and peer in run.error, run.error
    assert "the step's agreement" in run.error, run.error


START_UP_CHECKS = {"settings": "the start-up check of the settings",
                   "batch": "the first step's check of the batch"}


@pytest.mark.parametrize("place", list(START_UP_CHECKS))
@pytest.mark.parametrize(("case", "kind", "peer"), SCRIPT_CASES_STOP_SLOW)
def test_a_peer_lost_in_a_start_up_check_is_named_and_the_rank_exits(case, kind, peer, place):
    """The peer hit as it enters the settings check (building the pipeline) or the first
    step's batch check, gathers of every rank's view: the other process exits non-zero within
    timeout + 10 s (timeout=3), naming the peer and the check. Before: torch's own error
    ("Timed out waiting 3000ms", "Connection closed by peer"), naming no one."""
    (run,) = run_job(case, timeout=3, at=place).values()
    assert passed(run, 3), run
    assert kind in run.error and peer in run.error, run.error
    assert START_UP_CHECKS[place] in run.error, run.error


def _assert_every_survivor_named(runs: dict, kinds: tuple[str, ...], peer: str) -> None:
    for rank, run in runs.items():
        assert passed(run, 3), (rank, run)
        assert peer in run.error and any(k in run.error for k in kinds), (rank, run.error)


@pytest.mark.slow  # 4 processes: about 30 s on 2 busy cores
def test_a_replica_killed_in_the_gradient_all_reduce_is_named_by_every_rank():
    """2 stages x 2 replicas, stage 1 of replica 0 (rank 1) SIGKILLed as it enters the
    gradient all-reduce: the 3 other processes exit non-zero within timeout + 10 s, each
    naming it (its replica peer lost it in the all-reduce; the others read that reason).
    Before: "gradient all-reduce failed (Connection closed by peer ...)", naming no one."""
    runs = run_job("killed rank", timeout=3, at="gradients", replicas=2)
    _assert_every_survivor_named(runs, ("PeerError",), "stage 1 of replica 0 (rank 1)")
    assert "the gradient all-reduce" in runs[3].error, runs[3].error


@pytest.mark.slow
def test_a_replica_stopped_in_the_gradient_all_reduce_is_named_by_every_rank():
    """The same with stage 0 of replica 0 (rank 0, the store's host) SIGSTOPped: every other
    process times out naming it, or reads a peer's reason that does, and exits."""
    runs = run_job("stopped store host", timeout=3, at="gradients", replicas=2)
    _assert_every_survivor_named(runs, ("CommunicationTimeout", "PeerError"),
                                 "stage 0 of replica 0 (rank 0)")
    assert "CommunicationTimeout" in runs[2].error, runs[2].error


def test_stage_error_is_still_the_root_class():
    assert issubclass(StageError, PipelineError)


def _disagreeing(rank: int, world: int, what: str) -> None:
    balance, chunks, model = [6, 6], 2, mlp()
    if rank == 1 and what == "balance":
        balance = [5, 7]
    if rank == 1 and what == "chunks":
        chunks = 4
    if rank == 1 and what == "model":
        model[8] = nn.Linear(12, 12, bias=False)
    _pipeline(model, balance, timeout=10, chunks=chunks)


@pytest.mark.parametrize(("what", "named"), [
    ("balance", "balance: [6, 6] here vs [5, 7]"),
    ("chunks", "chunks: 2 here vs 4"),
    ("model", "model layer '8: Linear weight(12, 12) float32, bias(12,) float32' here vs"),
])
def test_ranks_that_built_different_pipelines_are_refused(what, named):
    """Today they train silently, with a layer on two stages (balance) or none."""
    results = run_ranks(_disagreeing, 2, what, deadline=60)
    status, (kind, message, _) = results[0]
    assert status == "error" and kind == "ValueError", message
    assert "rank 0 and rank 1 built different pipelines" in message and named in message, message
    assert results[1][0] == "error", results[1]


# ZeRO's collectives are torch's own (sharding.py): the rank hit as it enters one, per level
# (ZERO_PLACES), and how the error names it
ZERO_COLLECTIVES = {1: "ZeroRedundancyOptimizer's broadcast of the updated weights (zero=1)",
                    2: "FSDP2's all-gather of the sharded weights over the replicas (zero=2)",
                    3: "FSDP2's all-gather of the sharded weights over the replicas (zero=3)"}
# a kill ends at once: zero 1 and 3 (each mechanism once) stay in the fast run
ZERO_CASES = [pytest.param(case, kind, zero, marks=() if (case, zero) in {
    ("killed rank", 1), ("killed rank", 3)} else pytest.mark.slow, id=f"{case}-zero{zero}")
    for case, kind, _ in SCRIPT_CASES for zero in ZERO_COLLECTIVES]


@pytest.mark.parametrize(("case", "kind", "zero"), ZERO_CASES)
def test_a_replica_lost_in_a_zero_collective_is_named_and_the_rank_exits(case, kind, zero):
    """1 stage x 2 replicas sharded at ``zero``, one replica SIGSTOPped (rank 0, the store's
    host) or SIGKILLed (rank 1) as it enters ZeroRedundancyOptimizer's step (zero 1) or the
    step's first forward (zero 2 and 3: FSDP2's all-gather): the other exits non-zero within
    timeout + 10 s (timeout=3), naming the replica's stage and rank and the collective.
    Before: torch's own error ("Connection closed by peer", "Application timeout caused pair
    closure"), naming no one."""
    (run,) = run_job(case, timeout=3, at=ZERO_PLACES[zero], replicas=2, stages=1,
                     zero=zero).values()
    assert passed(run, 3), run
    assert kind in run.error and run.named_peer, run.error
    assert ZERO_COLLECTIVES[zero] in run.error, run.error


@pytest.mark.slow  # 4 processes: about 25 s on 2 busy cores
def test_a_replica_killed_in_fsdp2s_all_gather_is_named_by_every_rank():
    """2 stages x 2 replicas at zero 3, stage 1 of replica 0 (rank 1) SIGKILLed as it enters
    the step's first forward: the 3 other processes exit non-zero within timeout + 10 s, each
    naming stage 1 and rank 1 (its pipeline peer as its sender, the others as the replica
    lost in the all-gather, or that replica's reason)."""
    runs = run_job("killed rank", timeout=3, at="gather", replicas=2, zero=3)
    for rank, run in runs.items():
        assert passed(run, 3), (rank, run)
        assert "PeerError" in run.error and "stage 1" in run.error, (rank, run.error)
        assert "(rank 1)" in run.error, (rank, run.error)
    assert "FSDP2's all-gather" in runs[3].error, runs[3].error


# where a rank waits for every other beyond a pipeline's steps (JOINS): what its error names
JOINED = {"groups": "creating the pipeline's process groups",
          "shutdown": "pipetrain.shutdown()'s barrier"}


@pytest.mark.parametrize(("case", "kind", "place"), [
    pytest.param(case, kind, place, id=f"{case}-{place}",
                 marks=() if (case, place) == ("killed rank", "shutdown") else pytest.mark.slow)
    for case, kind, _ in SCRIPT_CASES for place in JOINS])
def test_a_rank_that_never_joins_the_groups_or_the_shutdown_ends_the_others(case, kind, place):
    """2 processes (1 stage x 2 replicas), one SIGSTOPped (the store's host) or SIGKILLed as
    it enters the creation of the pipeline's groups or pipetrain.shutdown(): the other exits
    non-zero within timeout + 10 s (timeout=3), its error saying what it waited for and the
    fix; at shutdown, naming the peer. Before: after a stop, a hang in the creation (torch's
    store wait, past the timeout) or the exit; torch's own errors, naming no one."""
    (run,) = run_job(case, timeout=3, at=place, replicas=2, stages=1).values()
    assert passed(run, 3), run
    assert JOINED[place] in run.error, run.error
    if place == "groups":
        assert "CommunicationTimeout" in run.error and "start every rank with the same" \
            in run.error, run.error
    else:
        assert kind in run.error and run.named_peer, run.error


# the gather of a sharded stage's state for a checkpoint (sharding.Checkpointing), per level
SAVE_GATHERS = {1: "gathering the sharded optimizer state for a checkpoint "
                   "(ZeroRedundancyOptimizer.consolidate_state_dict's broadcasts",
                3: "gathering the sharded weights for a checkpoint (DTensor.full_tensor's "
                   "all-gathers over the replicas, zero=3)"}


@pytest.mark.parametrize(("case", "kind", "zero"), [
    pytest.param(case, kind, zero, id=f"{case}-zero{zero}",
                 marks=() if case == "killed rank" else pytest.mark.slow)
    for case, kind, _ in SCRIPT_CASES for zero in SAVE_GATHERS])
def test_a_replica_lost_in_a_checkpoints_gather_is_named_and_leaves_the_last_checkpoint(
    case, kind, zero
):
    """1 stage x 2 replicas sharded at ``zero``, saving after every step, one replica
    SIGSTOPped (rank 0, the store's host) or SIGKILLed (rank 1) as it enters the gather of
    step 4's checkpoint: the other exits non-zero within timeout + 10 s (timeout=3), naming
    the replica's stage and rank and the gather; ``latest`` still names step 3's complete
    checkpoint, no partial one is left. Before: torch's own error ("Connection closed by
    peer", "Application timeout caused pair closure"), naming no one."""
    (run,) = run_job(case, timeout=3, at="save", replicas=2, stages=1, zero=zero).values()
    assert passed(run, 3), run
    assert kind in run.error and run.named_peer, run.error
    assert SAVE_GATHERS[zero] in run.error, run.error
    assert run.latest == "step-00000003" and "step-00000003/manifest.json" in run.saved, run
    assert not [name for name in run.saved if "step-00000004" in name], run.saved
