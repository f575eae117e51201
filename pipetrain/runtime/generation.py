"""Generation through the pipeline: what ``Pipeline.generate`` runs on each rank.

The prompt batch is cut into micro-batches. One step of a micro-batch walks the stages in
order: stage s runs its layers (pipetrain/runtime/decoding.py: on the new tokens alone, with a
key/value cache per stage and micro-batch, where the model decodes incrementally; else on the
whole sequence) and sends the result to stage s + 1; the last stage chooses the next tokens
(:class:`Chooser`) and sends them back to the first, which starts that micro-batch's next step.
Each rank works through its (step, micro-batch, stage) items in that order, every item waiting
only on earlier ones, so no rank waits on a later one (no deadlock), and while one micro-batch
is on the last stage the first stage already runs the next: with ``chunks`` at least the
number of stages, every stage is busy, as in a pipeline's forwards.

Every message is a header (its shapes: they grow with the sequence where it is recomputed)
and its tensors, tagged by micro-batch and boundary (tags.generation_tag); every wait has the
pipeline's timeout, and a failing rank aborts its transport, so the others raise at once. A
micro-batch stops after ``max_new_tokens`` or once every row has produced ``eos_token_id``;
the first stage then sends an end marker (a header of no tensors) down the stages. The first
stage's rank keeps the sequences and sends them to every other rank at the end.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipetrain.errors import PeerError, StageError
from pipetrain.runtime.boundary import HEADER_META
from pipetrain.runtime.decoding import DecodeState, run_layers
from pipetrain.runtime.meta import BoundaryMeta, decode, describe, encode, flatten, unflatten
from pipetrain.runtime.prompts import END, Chooser, Feed, Sampling, prompts
from pipetrain.runtime.runner import Runner
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.tags import generation_tag
from pipetrain.runtime.transport import Handle, Transport
from pipetrain.runtime.world import World
from pipetrain.training.precision import autocast, to_boundary
from schedules import Schedule


class Messages:
    """One rank's messages of a generation over ``transport``: a header, then the tensors;
    every wait bounded by ``timeout``; sends kept until :meth:`settle`."""

    def __init__(self, transport: Transport, stages: int, timeout: float):
        self.transport, self.stages, self.timeout = transport, stages, timeout
        self._sends: list[Handle] = []

    def send(self, value: object, peer: int, microbatch: int, boundary: int) -> None:
        tensors: tuple[torch.Tensor, ...] = ()
        meta = BoundaryMeta((), False)
        if value is not END:
            found, is_tuple = flatten(value, f"stage {boundary} in generation")
            tensors = tuple(t.detach().contiguous() for t in found)
            meta = describe(tensors, is_tuple)
        header = encode(meta).to(self.transport.device)
        self._sends.append(self.transport.send(
            [header], peer, generation_tag(microbatch, boundary, True, self.stages)))
        if tensors:
            self._sends.append(self.transport.send(
                list(tensors), peer, generation_tag(microbatch, boundary, False, self.stages)))

    def receive(self, peer: int, microbatch: int, boundary: int, what: str) -> object:
        """The value (or END) rank ``peer`` sent; a PeerError names ``what`` was awaited."""
        try:
            header = self.transport.recv(
                HEADER_META, peer, generation_tag(microbatch, boundary, True, self.stages)
            ).wait(self.timeout)[0]
            meta = decode(header.cpu())
            if not meta.tensors:
                return END
            tensors = self.transport.recv(
                meta.tensors, peer, generation_tag(microbatch, boundary, False, self.stages)
            ).wait(self.timeout)
        except PeerError as error:
            raise type(error)(f"{what} (rank {peer}): {error}") from error
        return unflatten(tensors, meta.is_tuple)

    def settle(self) -> None:
        """Wait for every send posted (each has been received by then, or will be)."""
        for handle in self._sends:
            handle.wait(self.timeout)
        self._sends.clear()


class RankGeneration:
    """One rank's part of a generation: the steps of its ``stages`` (in stage order) for
    every micro-batch, in (step, micro-batch, stage) order (see the module docstring)."""

    def __init__(
        self, stages: Sequence[Stage], messages: Messages, schedule: Schedule, chunks: int,
        sampling: Sampling, incremental: bool,
    ):
        self.stages, self.messages, self.schedule = list(stages), messages, schedule
        self.chunks, self.sampling = chunks, sampling
        self.rank = schedule.rank_of(self.stages[0].index)
        self.count = schedule.stages
        self.states = ({(s.index, m): DecodeState() for s in self.stages for m in range(chunks)}
                       if incremental else None)
        self.choosers = [Chooser(m, sampling) for m in range(chunks)]
        self.tokens: dict[int, tuple[torch.Tensor, bool]] = {}  # chosen, for a first stage here
        self.feeds: list[Feed] = []

    def run(self, feeds: list[Feed] | None) -> torch.Tensor:
        """The whole batch's sequences (prompt and new tokens), on every rank."""
        self.feeds = feeds or []
        where = f"stage {self.stages[0].index} (rank {self.rank}), generating"
        try:
            active = list(range(self.chunks)) if self.sampling.max_new_tokens else []
            step = 0
            while active:
                active = [m for m in active if self._advance(m, step)]
                step += 1
            sequences = self._result()
            self.messages.settle()
        except PeerError as error:
            self.messages.transport.abort(f"{where} stopped: {error}")
            raise
        except Exception as error:
            reason = str(error) if isinstance(error, StageError) else repr(error)
            self.messages.transport.abort(f"{where} failed: {reason}")
            raise
        return sequences

    def _here(self, stage: int) -> bool:
        return self.schedule.rank_of(stage) == self.rank

    def _advance(self, m: int, step: int) -> bool:
        """Micro-batch ``m``'s ``step`` on this rank's stages; False once it has ended."""
        carried: object = None
        going = True
        for stage in self.stages:
            value = self._take(stage, m, step, carried)
            if value is END:
                going = False
            else:
                value = self._compute(stage, m, step, value)
            carried = self._give(stage, m, value)
        return going

    def _take(self, stage: Stage, m: int, step: int, carried: object) -> object:
        """What ``stage`` runs on: the prompt, the sequence grown by the tokens the last stage
        chose, or the previous stage's output (``carried`` where it ran here); or END."""
        if stage.is_first:
            if step == 0:
                return self.feeds[m].value()
            last = self.count - 1
            if self._here(last):
                tokens, done = self.tokens.pop(m)
            else:
                message = self.messages.receive(
                    self.schedule.rank_of(last), m, last,
                    f"stage 0 waiting for the tokens of micro-batch {m}, step {step}",
                )
                assert isinstance(message, tuple)
                tokens, done = message[0], bool(message[1].item())
            self.feeds[m].extend(tokens)
            return END if done else self.feeds[m].value()
        if self._here(stage.index - 1):
            return carried
        return self.messages.receive(
            self.schedule.rank_of(stage.index - 1), m, stage.index - 1,
            f"stage {stage.index} waiting for stage {stage.index - 1}'s output of micro-batch "
            f"{m}, step {step}",
        )

    def _compute(self, stage: Stage, m: int, step: int, value: object) -> object:
        """``stage``'s layers on ``value`` (with its decode state when incremental)."""
        state = self.states[stage.index, m] if self.states is not None else None
        try:
            with autocast(stage.device, stage.autocast_dtype):
                output = run_layers(stage.module.called(), value, state)
        except Exception as error:
            raise StageError(
                f"stage {stage.index}, generation step {step} of micro-batch {m} failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        return output if stage.is_last else to_boundary(output, stage.autocast_dtype)

    def _give(self, stage: Stage, m: int, value: object) -> object:
        """Pass ``stage``'s output on: to the next stage (returned where it runs here), or,
        from the last, as the chosen tokens to the first stage."""
        if stage.is_last:
            if value is not END:
                tokens, done = self.choosers[m].choose(value)
                if self._here(0):
                    self.tokens[m] = tokens, done
                else:
                    flag = torch.tensor([int(done)], device=tokens.device)
                    self.messages.send((tokens, flag), self.schedule.rank_of(0), m, self.count - 1)
            return None
        if self._here(stage.index + 1):
            return value
        self.messages.send(value, self.schedule.rank_of(stage.index + 1), m, stage.index)
        return None

    def _result(self) -> torch.Tensor:
        """The sequences, from the first stage's rank to every other: micro-batches that
        stopped early padded to the longest with the pad token (their rows had all finished)."""
        first = self.schedule.rank_of(0)
        if self.rank != first:
            received = self.messages.receive(first, self.chunks, 0, "waiting for the sequences")
            assert isinstance(received, torch.Tensor)
            return received
        longest = max(f.ids.shape[1] for f in self.feeds)
        pad = self.sampling.pad or 0
        sequences = torch.cat(
            [F.pad(f.ids, (0, longest - f.ids.shape[1]), value=pad) for f in self.feeds]
        )
        for rank in range(self.schedule.ranks):
            if rank != first:
                self.messages.send(sequences, rank, self.chunks, 0)
        return sequences


class Generation:
    """``Pipeline.generate``: this process's ranks of ``world`` generating with ``stages``
    (this process's) under ``schedule``'s placement, ``chunks`` micro-batches; ``runner``
    says whether the pipeline has stopped, and learns when a generation stops it."""

    def __init__(
        self, world: World, stages: Sequence[Stage], schedule: Schedule, runner: Runner,
        incremental: bool,
    ):
        self.world, self.stages, self.schedule = world, list(stages), schedule
        self.runner, self.incremental = runner, incremental

    def run(
        self, input_ids: object, attention_mask: object, sampling: Sampling
    ) -> torch.Tensor:
        """The sequences (batch, prompt + new tokens) on every rank, on its first stage's
        device."""
        self.runner.check()
        feeds = self._feeds(input_ids, attention_mask) if self.stages[0].is_first else None
        modes = [stage.module.training for stage in self.stages]
        for stage in self.stages:
            stage.module.eval()
        try:
            results = self.world.run_ranks(
                lambda rank, transport: self._rank(rank, transport, feeds, sampling)
            )
        except Exception as error:
            self.runner.stop(error)
            raise
        finally:
            for stage, mode in zip(self.stages, modes, strict=True):
                stage.module.train(mode)
        return results[0]

    def _feeds(self, input_ids: object, attention_mask: object) -> list[Feed]:
        """The first stage's feeds; a prompt it refuses stops the other processes' ranks
        too, with the reason (they have no prompt to check)."""
        try:
            return prompts(input_ids, attention_mask, self.runner.chunks, self.incremental,
                           self.stages[0].device)
        except (TypeError, ValueError) as error:
            if self.world.stop_peers(f"stage 0 refused its prompt: {error}"):
                self.runner.stop(error)
            raise

    def _rank(
        self, rank: int, transport: Transport, feeds: list[Feed] | None, sampling: Sampling
    ) -> torch.Tensor:
        """Pipeline rank ``rank``'s part, without gradients (on its own thread, too)."""
        stages = {stage.index: stage for stage in self.stages}
        mine = [stages[s] for s in sorted(self.schedule.stages_on(rank))]
        messages = Messages(transport, self.schedule.stages, self.runner.timeout)
        with torch.no_grad():
            work = RankGeneration(mine, messages, self.schedule, self.runner.chunks, sampling,
                                  self.incremental)
            return work.run(feeds if mine[0].is_first else None)
