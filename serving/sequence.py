"""A sequence owns its state: tokens, pages, progress, sampling settings and timings.

The scheduler moves sequences between its `waiting` and `running` deques; the page manager only
reads and writes `page_table` / `page_hashes`. One request with `n` samples becomes `n` sequences
that share the prompt but carry distinct seeds (see `derive_seed`).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import secrets
from dataclasses import dataclass, field
from typing import Any

from serving.sampling_options import SamplingOptions

_SEQ_IDS = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def eos_token_ids(model: Any) -> tuple[int, ...]:
    """The tokens that end a sequence (unless it ignores EOS): the model config's EOS ids, else
    its tokenizer's EOS token."""
    eos = tuple(int(t) for t in getattr(model.cfg, "eos_token_ids", ()) or ())
    tok = getattr(model, "tokenizer", None)
    if not eos and getattr(tok, "eos_token_id", None) is not None:
        eos = (int(tok.eos_token_id),)
    return eos


def derive_seed(seed: int | None, index: int) -> int:
    """The u32 seed of sample `index` of a request with seed `seed`.

    Sample 0 of a request whose seed fits in u32 uses it unchanged (so `seed=0` means key 0, as in
    the offline API); other samples and out-of-range seeds go through a fixed hash, so the `n`
    samples differ from each other yet depend only on (seed, index). `None` draws a fresh seed.
    """
    if seed is None:
        return secrets.randbits(32)
    if index == 0 and 0 <= seed < 2**32:
        return int(seed)
    digest = hashlib.blake2b(f"jdet-seed:{seed}:{index}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


@dataclass(eq=False)
class Sequence:
    """One sample being generated. `token_ids` is prompt + output; KV exists for the first
    `num_computed_tokens` of them (reset to 0 on recompute preemption)."""

    request_id: str
    index: int
    prompt_token_ids: list[int]
    options: SamplingOptions
    seed: int  # the u32 seed actually used (recorded so the output is reproducible)
    arrival_time: float = 0.0
    seq_id: int = field(default_factory=lambda: next(_SEQ_IDS))
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    page_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # hash chain of its registered pages
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0
    # speculative decoding (serving/speculative/speculator.py): this step's draft, set before
    # scheduling
    draft_token_ids: list[int] = field(default_factory=list)
    # a score request (Engine.add_score): prefill-only, samples nothing. Row i of token_ids gives
    # scores[i] = log p(targets[i] | token_ids[: i + 1]); rows below num_scored are known (kept
    # over a preemption, so the recompute may read those rows' K/V from the prefix cache)
    targets: list[int] | None = None
    scores: list[float] = field(default_factory=list)
    num_scored: int = 0
    # outputs
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0  # incremental detokenisation window over token_ids (see engine)
    read_offset: int = 0
    detok_end: int = 0  # tokens detokenised and matched against stop strings so far
    emitted_chars: int = 0  # text / tokens already reported to the caller
    emitted_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # timings (engine clock, seconds)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.read_offset = self.detok_end = len(self.prompt_token_ids)
        self.prefix_offset = max(0, self.read_offset - 5)  # a little context for leading spaces
        if self.targets is not None:
            if len(self.targets) != len(self.token_ids):
                raise ValueError("a score sequence needs one target per token")
            self.scores = [0.0] * len(self.targets)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V is not yet in the cache (1 for a decode, more while prefilling)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_score(self) -> bool:
        """A score request's sequence (no sampling; log-probs of `targets` on every row)."""
        return self.targets is not None

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"pages={len(self.page_table)})"
        )


def num_rows(seq: Sequence, n: int) -> int:
    """Sampled rows of `seq` in a step computing `n` of its tokens: k + 1 for a verify of k
    drafts, else 1 (a prefill chunk's row is sampled and dropped, as before)."""
    return 1 + max(0, n - seq.num_uncomputed)


def step_tokens(seq: Sequence, n: int) -> list[int]:
    """The `n` input tokens of `seq` this step: its uncomputed tokens, then its drafts."""
    start = seq.num_computed_tokens
    have = seq.token_ids[start : start + n]
    return have + seq.draft_token_ids[: n - len(have)]


@dataclass
class Request:
    """One request of the engine: its `n` sequences (samples), which share the prompt and whose
    seeds derive from the request's (`derive_seed`); `error` when the engine ended it."""

    request_id: str
    prompt_token_ids: list[int]
    seed: int
    seqs: list[Sequence]
    arrival_time: float
    error: str | None = None

    @classmethod
    def sampling(
        cls, request_id: str, prompt: list[int], opts: SamplingOptions, seed: int, now: float
    ) -> Request:
        """A request that samples: `opts.n` sequences of `prompt`, seeds derived from `seed`."""
        prompt = [int(t) for t in prompt]
        seqs = [
            Sequence(request_id, i, prompt, opts, seed=derive_seed(seed, i), arrival_time=now)
            for i in range(opts.n)
        ]
        return cls(request_id, prompt, seed, seqs, now)
