"""Host side of the per-request logits transforms: one `LogitsInputs` per step.

Why this shape (jdet/sampling.py `LogitsInputs`): every array is [S, X] with X fixed by the step's
bucket (penalty width U = Pmax * page_size, which bounds any row's distinct tokens; NB =
MAX_LOGIT_BIAS; W = ceil(V / 32)), so the transforms add no compiled shape: `warmup()` compiles
them with the step. A step where no row uses a transform gets neutral arrays that are cached on
the device per shape, so the common path transfers nothing extra; the device skips each transform
that no row uses (`lax.cond`).

Cost when used (not yet measured on a GPU; benchmarks/mask_bench.py): a step with any penalised
row sends pen_ids + pen_counts of 8 * S * Pmax * page_size bytes (S = 256 at 8192 tokens: 16 MB)
and recounts each penalised row's tokens on the host (np.unique, O(sequence length)); a step with
any masked row sends 4 * S * ceil(V / 32) bytes (4 MB at S = 256, V = 128k). Keeping per-sequence
token counts on the device instead would remove both; it needs a slot per sequence.

What depends on the previous token (penalty counts, bad-word prefixes, the grammar state,
whether min_tokens is reached) is read from the sequence when the batch is built, so a step that
holds such a request needs the previous step's tokens on the host first. The engine today fetches
step n before it builds step n+1, so this holds; an engine that feeds tokens back on the device
must treat rows with `SamplingOptions.needs_logits_inputs` as synchronous.

Everything a row gets depends only on its own request and tokens: the batch never changes it.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import jax
import numpy as np

from jdet.sampling import MAX_LOGIT_BIAS, LogitsInputs
from serving.constrained.structured import Guide, Structured
from serving.sampling_options import InvalidRequest, SamplingOptions
from serving.sequence import Sequence, eos_token_ids


def _clear(words: np.ndarray, ids: Any) -> None:
    """Clear the bits of token ids `ids` in an int32 bitmask row."""
    u = words.view(np.uint32)
    for t in ids:
        u[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def pack_allowed(ids: Any, words: int) -> np.ndarray:
    """The int32 bitmask row allowing exactly `ids`."""
    bits = np.zeros(words * 32, bool)
    bits[np.asarray(ids, np.int64)] = True
    return np.packbits(bits, bitorder="little").view("<i4").astype(np.int32)


class LogitsRows:
    """Builds the step's LogitsInputs; owns the per-sequence grammar state (weakly keyed)."""

    def __init__(self, model: Any, vocab_size: int, sharding: Any = None) -> None:
        self.V = vocab_size
        self.W = -(-vocab_size // 32)
        self.tokenizer = getattr(model, "tokenizer", None)
        self.eos = eos_token_ids(model)
        self.structured = Structured(self.tokenizer, vocab_size, self.eos)
        self.guides: weakref.WeakKeyDictionary[Sequence, Guide] = weakref.WeakKeyDictionary()
        self.sharding = sharding  # where the step's inputs live (TP: replicated on the mesh)
        self._neutral: dict[tuple[int, int], LogitsInputs] = {}

    # ------------------------------------------------------------------ admission
    def check(self, o: SamplingOptions) -> None:
        """Model-dependent checks of a request's transforms (raises InvalidRequest)."""
        if o.bad_words and self.tokenizer is None:
            raise InvalidRequest("bad_words", "bad_words need a tokenizer")
        if o.structured:
            self.structured.check(o.structured)

    @functools.lru_cache(maxsize=256)  # noqa: B019 - one runner per engine, few distinct lists
    def bad_word_ids(self, words: tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
        """Token sequences of each word, at the start of text and after a space (vLLM's rule:
        the last token is banned when the tokens before it were just generated)."""
        out: dict[tuple[int, ...], None] = {}
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])
                if ids:
                    out[ids] = None
        return tuple(out)

    # ------------------------------------------------------------------ per step
    def _put(self, x: LogitsInputs) -> LogitsInputs:
        """On the device the step runs on, committed the same way for every step (the compiled
        executable is keyed by its inputs' placement)."""
        target = self.sharding if self.sharding is not None else jax.devices()[0]
        return jax.device_put(x, target)

    def _host(self, S: int, U: int) -> dict[str, np.ndarray]:
        return dict(
            min_p=np.zeros(S, np.float32),
            presence=np.zeros(S, np.float32),
            frequency=np.zeros(S, np.float32),
            repetition=np.ones(S, np.float32),
            pen_ids=np.full((S, U), -1, np.int32),
            pen_counts=np.zeros((S, U), np.int32),
            bias_ids=np.full((S, MAX_LOGIT_BIAS), -1, np.int32),
            bias_vals=np.zeros((S, MAX_LOGIT_BIAS), np.float32),
            mask=np.full((S, self.W), -1, np.int32),
        )

    def neutral(self, S: int, U: int) -> LogitsInputs:
        key = (S, U)
        if key not in self._neutral:
            self._neutral[key] = self._put(LogitsInputs(**self._host(S, U)))
        return self._neutral[key]

    def build(
        self, plan: list[tuple[Sequence, int]], S: int, U: int, row_of: list[int] | None = None
    ) -> LogitsInputs:
        """The step's LogitsInputs: rows of sequences that sample now and use a transform.
        `row_of[s]`: plan entry s's sampled row (default s; a speculative verify takes several
        rows, but never for a sequence with transforms: serving/speculative/speculator.py)."""
        rows = [
            (s if row_of is None else row_of[s], seq)
            for s, (seq, n) in enumerate(plan)
            if seq.options.needs_logits_inputs and seq.num_computed_tokens + n == seq.num_tokens
        ]
        if not rows:
            return self.neutral(S, U)
        a = self._host(S, U)
        for s, seq in rows:
            self._row(a, s, seq, U)
        return self._put(LogitsInputs(**a))

    def _row(self, a: dict[str, np.ndarray], s: int, seq: Sequence, U: int) -> None:
        o = seq.options
        a["min_p"][s] = o.min_p
        a["presence"][s], a["frequency"][s] = o.presence_penalty, o.frequency_penalty
        a["repetition"][s] = o.repetition_penalty
        if o.presence_penalty or o.frequency_penalty or o.repetition_penalty != 1:
            toks = np.asarray(seq.token_ids, np.int32)
            ids, inv = np.unique(toks, return_inverse=True)
            counts = np.bincount(inv[seq.num_prompt_tokens :], minlength=len(ids))
            if o.repetition_penalty == 1:  # presence/frequency see generated tokens only
                ids, counts = ids[counts > 0], counts[counts > 0]
            assert len(ids) <= U, "a row's distinct tokens exceed the page-table width"
            a["pen_ids"][s, : len(ids)] = ids
            a["pen_counts"][s, : len(ids)] = counts
        for j, (tid, b) in enumerate(o.logit_bias):
            a["bias_ids"][s, j], a["bias_vals"][s, j] = tid, b
        words = a["mask"][s]
        if o.structured:
            guide = self.guides.get(seq)
            if guide is None:
                guide = self.guides[seq] = self.structured.guide(o.structured)
            guide.sync(seq.output_token_ids)
            guide.fill(words)
        if o.allowed_token_ids is not None:
            words &= pack_allowed(o.allowed_token_ids, self.W)
        if o.bad_words:
            out = seq.output_token_ids
            for ids in self.bad_word_ids(o.bad_words):
                k = len(ids) - 1
                if k == 0 or (len(out) >= k and tuple(out[-k:]) == ids[:-1]):
                    _clear(words, [ids[-1]])
        if seq.num_output_tokens < o.min_tokens:
            _clear(words, list(o.stop_token_ids) + ([] if o.ignore_eos else list(self.eos)))
