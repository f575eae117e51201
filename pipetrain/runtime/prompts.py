"""What generation feeds the first stage and what the last stage chooses
(pipetrain/runtime/generation.py runs them): the arguments of ``Pipeline.generate``, each
micro-batch's sequences as they grow, and the choice of its next tokens."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from pipetrain.runtime import microbatch


class _End:
    """The end of a micro-batch's generation, as it passes down the stages."""


END = _End()


@dataclass(frozen=True)
class Sampling:
    """How the next tokens are chosen, and when a micro-batch stops (Pipeline.generate's
    arguments); refused with a ValueError on every rank alike. Sampling draws from
    softmax(logits / temperature) over the ``top_k`` likeliest tokens (None: all), narrowed to
    the fewest whose probability reaches ``top_p`` (1.0: all), as transformers' generate
    applies them, in that order."""

    max_new_tokens: int
    do_sample: bool = False
    temperature: float = 1.0
    seed: int = 0
    eos_token_id: int | tuple[int, ...] | None = None  # one id or several (Llama 3's two)
    pad_token_id: int | None = None
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an integer >= 0, got {self.max_new_tokens!r}")
        if self.do_sample and not (isinstance(self.temperature, int | float)
                                   and math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if isinstance(self.eos_token_id, list | tuple):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        eos = self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)
        for name, value in [("seed", self.seed), ("pad_token_id", self.pad_token_id),
                            ("top_k", self.top_k), *(("eos_token_id", e) for e in eos)]:
            if not (value is None and name != "seed" or _is_int(value)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (None keeps every token), got {self.top_k}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1 keeps every token), got {self.top_p!r}")

    @classmethod
    def of(cls, config: object | None, **given: object) -> Sampling:
        """The arguments ``given`` (those that are not None), the rest from ``config`` (a
        transformers ``GenerationConfig``, or any object with its attribute names) where it
        has them, else the defaults; ``max_new_tokens`` is required from one or the other."""
        fields = {}
        for name, value in given.items():
            if value is None and config is not None:
                value = getattr(config, name, None)
            if value is not None:
                fields[name] = value
        if "max_new_tokens" not in fields:
            raise ValueError("generate needs max_new_tokens= (or a generation_config that has it)")
        if fields.get("top_k") == 0:  # transformers' "no top-k" value
            del fields["top_k"]
        return cls(**fields)  # type: ignore[arg-type]

    @property
    def eos(self) -> tuple[int, ...]:
        """The ids that finish a row (none: rows run to ``max_new_tokens``)."""
        if self.eos_token_id is None:
            return ()
        return self.eos_token_id if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @property
    def pad(self) -> int | None:
        """What a finished row produces: ``pad_token_id``, else the first ``eos_token_id`` (as
        transformers' generate does)."""
        return self.pad_token_id if self.pad_token_id is not None else (self.eos or (None,))[0]

    def narrowed(self, scores: torch.Tensor) -> torch.Tensor:
        """``scores`` (rows, vocab) over the temperature, -inf outside the top-k and the
        top-p nucleus of each row."""
        scores = scores / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = scores.topk(self.top_k, -1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, -math.inf)
        if self.top_p < 1:
            ordered, order = scores.sort(-1, descending=True)
            probs = ordered.softmax(-1)
            above = probs.cumsum(-1) - probs  # the mass of the tokens ranked higher
            outside = above >= self.top_p  # the likeliest token always stays (above = 0)
            unsorted = torch.zeros_like(outside).scatter(-1, order, outside)
            scores = scores.masked_fill(unsorted, -math.inf)
        return scores


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Feed:
    """One micro-batch as the first stage feeds it: the tokens so far, their padding mask
    (None: no mask given, and the model recomputes the sequence) and, decoding incrementally,
    the new tokens and their positions (from the mask, as transformers' generate counts them:
    left padding takes no position)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor | None, incremental: bool):
        self.ids, self.incremental = ids, incremental
        self.mask = torch.ones_like(ids) if mask is None and incremental else mask
        self.new = ids
        self.positions: torch.Tensor | None = None
        if self.mask is not None and incremental:
            counted = self.mask.long().cumsum(-1) - 1
            self.positions = counted.masked_fill(self.mask == 0, 0)

    def value(self) -> object:
        """What the first stage runs on at this step."""
        if self.incremental:
            return self.new, self.mask, self.positions
        return self.ids if self.mask is None else (self.ids, self.mask)

    def extend(self, tokens: torch.Tensor) -> None:
        """Append the chosen ``tokens`` (batch,)."""
        new = tokens.to(self.ids.device, self.ids.dtype)[:, None]
        self.ids, self.new = torch.cat([self.ids, new], 1), new
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones_like(new, dtype=self.mask.dtype)], 1)
        if self.positions is not None:
            self.positions = self.positions[:, -1:] + 1


class Chooser:
    """The last stage's choice of one micro-batch's next tokens from its logits: the argmax,
    or drawn from the narrowed softmax (:meth:`Sampling.narrowed`) by a generator per row
    seeded from ``seed`` and the row's place in the whole batch (the same draws under any
    split and chunks). Finished rows (they produced an ``eos_token_id``) produce the pad token
    from then on."""

    def __init__(self, microbatch: int, sampling: Sampling):
        self.microbatch, self.sampling = microbatch, sampling
        self.unfinished: torch.Tensor | None = None
        self.generators: list[torch.Generator] = []
        self.made = 0

    def choose(self, logits: object) -> tuple[torch.Tensor, bool]:
        """The next tokens (batch,) and whether the micro-batch is done."""
        if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
            raise ValueError(
                "generation needs the model's last layer to return logits of shape (batch, "
                f"seq, vocab), got {type(logits).__name__} {tuple(getattr(logits, 'shape', ()))}"
            )
        scores, s = logits[:, -1].float(), self.sampling
        rows = scores.shape[0]
        if self.unfinished is None:
            self.unfinished = torch.ones(rows, dtype=torch.bool, device=scores.device)
            first = self.microbatch * rows
            seeds = [row_seed(s.seed, first + r) for r in range(rows)] if s.do_sample else []
            self.generators = [torch.Generator(scores.device).manual_seed(n) for n in seeds]
        if s.do_sample:
            probs = s.narrowed(scores).softmax(-1)
            tokens = torch.cat([torch.multinomial(p, 1, generator=g)
                                for p, g in zip(probs, self.generators, strict=True)])
        else:
            tokens = scores.argmax(-1)
        self.made += 1
        done = self.made >= s.max_new_tokens
        if s.eos and s.pad is not None:
            tokens = torch.where(self.unfinished, tokens, s.pad)
            self.unfinished &= ~torch.isin(tokens, torch.tensor(s.eos, device=tokens.device))
            done = done or not bool(self.unfinished.any())
        return tokens, done


def row_seed(seed: int, row: int) -> int:
    """The seed of row ``row``'s generator: a hash of (seed, row) in 32 bits (torch's CPU
    generator keeps 32 bits of a seed: ``seed * 2**32 + row`` would lose the seed)."""
    digest = hashlib.blake2b(f"{seed}/{row}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


def prompts(
    input_ids: object, attention_mask: object, chunks: int, incremental: bool,
    device: torch.device,
) -> list[Feed]:
    """The first stage's feeds of the prompt batch, one per micro-batch; a ValueError (a
    TypeError for what is no tensor) for a prompt that cannot be generated from."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[1] == 0 or input_ids.dtype == torch.bool or (
        input_ids.is_floating_point() or input_ids.is_complex()
    ):
        raise ValueError(
            "input_ids must be integer token ids of shape (batch, seq) with seq >= 1, got "
            f"{input_ids.dtype} of shape {tuple(input_ids.shape)}"
        )
    batch: microbatch.Batch = input_ids
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"attention_mask must be a tensor of input_ids' shape {tuple(input_ids.shape)}, "
                f"got {tuple(getattr(attention_mask, 'shape', ())) or type(attention_mask)}"
            )
        batch = (input_ids, attention_mask)
    parts = microbatch.scatter(microbatch.to_device(batch, device), chunks, "input_ids")
    return [Feed(p[0], p[1], incremental) if isinstance(p, tuple) else Feed(p, None, incremental)
            for p in parts]
