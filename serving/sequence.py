"""A sequence owns its state: tokens, pages, progress, sampling settings and timings.

The scheduler moves sequences between its `waiting` and `running` deques; the block manager only
reads and writes `block_table` / `page_hashes`. One request with `n` samples becomes `n` sequences
that share the prompt but carry distinct seeds (see `derive_seed`).
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import math
import secrets
from dataclasses import dataclass, field

import numpy as np

NUM_TOP = 20  # top log-probs the step returns per row (jdet.step.NUM_TOP)
_SEQ_IDS = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


INT32_MAX = 2**31 - 1  # top_k, positions and token ids travel to the device as int32
SEED_MIN, SEED_END = -(2**63), 2**64  # any seed in this range maps to a u32 key (derive_seed)
MAX_STOP_STRINGS = 64


class InvalidRequest(ValueError):
    """A request value that is out of range or cannot be represented in the step's arrays.

    `field` names it, so the server can put it in the error's `param` and the offline API's
    message starts with it. A ValueError, so existing `except ValueError` boundaries catch it.
    """

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field


def _is_int(x: object) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool | np.bool_)


def _is_real(x: object) -> bool:
    return _is_int(x) or isinstance(x, float | np.floating)


def _has_surrogate(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_int(value: object, field: str, lo: int, hi: int, hint: str = "") -> None:
    """`value` is an int (not a bool) in [lo, hi]; raise InvalidRequest naming `field` if not."""
    if not _is_int(value) or not lo <= int(value) <= hi:
        shown = repr(value) if _is_int(value) or value is None else type(value).__name__
        msg = f"{field} must be an integer in [{lo}, {hi}]{hint}, got {shown}"
        raise InvalidRequest(field, msg)


def check_prompt_ids(ids: object, *, vocab_size: int, max_model_len: int, field: str) -> None:
    """A prompt given as token ids: non-empty ints in [0, vocab_size), shorter than
    max_model_len (one position must remain for the first generated token)."""
    if not isinstance(ids, list | tuple) or not ids:
        raise InvalidRequest(field, f"{field} is empty; give at least one token")
    for t in ids:
        if not _is_int(t):
            raise InvalidRequest(
                field, f"{field}: token ids must be integers, got {type(t).__name__} {t!r:.40}"
            )
        if not 0 <= int(t) < vocab_size:
            raise InvalidRequest(
                field, f"{field}: token id {t} is outside the vocabulary [0, {vocab_size})"
            )
    if len(ids) >= max_model_len:
        raise InvalidRequest(
            field,
            f"{field} has {len(ids)} tokens but max_model_len is {max_model_len}; shorten it "
            "or raise max_model_len",
        )


@dataclass(frozen=True)
class SamplingOptions:
    """What the engine needs to know about how to sample one request.

    The engine accepts any object with these attribute names (e.g. `jdet.SamplingParams`, a
    dict); see `SamplingOptions.from_any`. `seed=None` means "pick one at admission and record it".
    `check()` is the one validation every entry point (LLM, server, CLI, engine) goes through:
    its bounds are those of the arrays the step receives (int32 top_k, u32 seed keys, f32
    temperature/top_p), so nothing that passes it can fail inside `ModelRunner.prepare`.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top log-probs to report per token (0..NUM_TOP)
    skip_special_tokens: bool = True

    @classmethod
    def from_any(cls, p: object | None) -> SamplingOptions:
        """Copy the known fields from any params object (or dict), unconverted: `check()` then
        names any value of the wrong type instead of a bare `int()` error."""
        if p is None:
            return cls()
        if isinstance(p, SamplingOptions):
            return p
        get = p.get if isinstance(p, dict) else lambda k, d: getattr(p, k, d)
        stop = get("stop", ()) or ()
        stop = (stop,) if isinstance(stop, str) else stop
        top_k = get("top_k", 0)
        n = get("n", 1)
        return cls(
            temperature=get("temperature", 1.0),
            top_p=get("top_p", 1.0),
            top_k=0 if top_k is None or (_is_int(top_k) and top_k == -1) else top_k,
            seed=get("seed", None),
            max_tokens=get("max_tokens", 16),
            n=1 if n is None else n,
            stop=tuple(stop) if isinstance(stop, list | tuple) else stop,
            stop_token_ids=tuple(get("stop_token_ids", ()) or ()),
            ignore_eos=get("ignore_eos", False),
            logprobs=get("logprobs", None),
            skip_special_tokens=get("skip_special_tokens", True),
        )

    def check(self, vocab_size: int | None = None) -> SamplingOptions:
        """Raise InvalidRequest naming the first bad field; return self (for chaining).

        Model-dependent bounds (stop token ids < vocab) apply when `vocab_size` is given.
        """
        t, p = self.temperature, self.top_p
        if not _is_real(t) or not (math.isfinite(t) and 0 <= t <= F32_MAX):
            raise InvalidRequest(
                "temperature", f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}"
            )
        if not _is_real(p) or not (math.isfinite(p) and 0 < p <= 1):
            raise InvalidRequest("top_p", f"top_p must be a number in (0, 1], got {p!r}")
        check_int(self.top_k, "top_k", 0, INT32_MAX, " (0 = off; -1 also means off)")
        if self.seed is not None:
            check_int(self.seed, "seed", SEED_MIN, SEED_END - 1)
        if self.max_tokens is not None:
            check_int(self.max_tokens, "max_tokens", 1, INT32_MAX)
        check_int(self.n, "n", 1, INT32_MAX)
        if self.logprobs is not None:
            check_int(self.logprobs, "logprobs", 0, NUM_TOP)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool | np.bool_):
                raise InvalidRequest(name, f"{name} must be true or false")
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                "stop", f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings"
            )
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequest("stop", "stop strings must be non-empty strings")
            if _has_surrogate(s):
                raise InvalidRequest("stop", "stop strings must be valid Unicode (lone surrogate)")
        hi = INT32_MAX if vocab_size is None else vocab_size - 1
        for tid in self.stop_token_ids:
            check_int(tid, "stop_token_ids", 0, hi, " (token ids of the vocabulary)")
        return self


F32_MAX = float(np.finfo(np.float32).max)


def check_request(
    prompt: object, opts: SamplingOptions, *, vocab_size: int, max_model_len: int
) -> None:
    """The whole boundary check of one request: its prompt ids and its sampling options."""
    check_prompt_ids(prompt, vocab_size=vocab_size, max_model_len=max_model_len, field="prompt")
    opts.check(vocab_size)


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
    block_table: list[int] = field(default_factory=list)
    page_hashes: list[bytes] = field(default_factory=list)  # hash chain of its registered pages
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache (last admission)
    num_preemptions: int = 0
    # outputs
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    prefix_offset: int = 0  # incremental detokenisation window over token_ids (see engine)
    read_offset: int = 0
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
        self.read_offset = len(self.prompt_token_ids)
        self.prefix_offset = max(0, self.read_offset - 5)  # a little context for leading spaces

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
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id}#{self.index}, {self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"pages={len(self.block_table)})"
        )
