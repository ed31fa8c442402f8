"""Structured output on the host: token bitmasks from llguidance, applied on device.

Why llguidance: it installs as one dependency-free wheel (CPU CI included), computes a mask over
the whole vocabulary in tens of microseconds for JSON schemas, regexes, choices and Lark grammars,
and writes exactly the [ceil(V / 32)] int32 bitmask layout the step applies (`sampling.apply_mask`).
(xgrammar, the alternative, requires torch and triton at install time.) Both compute a token's
mask far faster than a step runs (benchmarks/mask_bench.py); installability decided.

How it keeps the contract: the mask of a row depends only on the request's constraint and the
tokens that sequence generated so far, both part of the request; the device applies it row-locally
before the invariant log-softmax. So structured output is as batch-invariant as any sampling.

Lifecycle: `check` compiles and validates a constraint at admission (a bad schema is the client's
400, never a failed step); the model runner keeps one `Guide` per sequence, `sync`s it with the
sequence's generated tokens before each step (so preemption, recompute and repeated batch builds
need no bookkeeping) and asks it for the row's mask. When the structure is complete the mask
allows only EOS, which ends the request.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import numpy as np

from jdet.tokenizer import FastTokenizer
from serving.sampling_options import InvalidRequest


def _lg() -> Any:
    try:  # on the first structured request: llguidance.hf imports transformers (slow)
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError as e:  # a dependency in pyproject.toml; named if someone removed it
        raise InvalidRequest(
            "structured_outputs",
            f"structured output needs the llguidance package ({e}); pip install llguidance",
        ) from None
    return llguidance


@functools.lru_cache(maxsize=8)
def _tokenizer_info(tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    """llguidance's view of the tokenizer (about a second for a 150k vocabulary: cached)."""
    lg = _lg()
    if isinstance(tokenizer, FastTokenizer):  # llguidance takes transformers' own class only
        tokenizer = tokenizer.hf
    return lg.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eos_ids))


# Compact JSON (", " and ": " separators, no free whitespace): a model cannot spend its tokens
# on whitespace, and equal requests give equal text. A schema's own "x-guidance" overrides it.
JSON_DEFAULTS = {"whitespace_flexible": False}


def grammar_of(kind: str, spec: str) -> str:
    """(kind, spec) of `SamplingOptions.structured` -> an llguidance grammar."""
    M = _lg().LLMatcher
    if kind == "json_schema":
        try:
            schema = json.loads(spec) if isinstance(spec, str) else spec
        except ValueError as e:
            raise InvalidRequest(kind, f"{kind} is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest(kind, f"{kind} must be a JSON object (a JSON Schema)")
        return M.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    if kind == "json_object":
        return M.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if kind == "regex":
        return M.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        return M.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in choices))
    if kind == "grammar":
        return M.grammar_from_lark(spec)
    raise InvalidRequest(kind, f"unknown structured-output kind {kind!r}")


class Guide:
    """One sequence's constraint: an llguidance matcher fed with the sequence's tokens."""

    def __init__(self, info: Any, grammar: str) -> None:
        self.matcher = _lg().LLMatcher(info, grammar)
        self.consumed = 0  # generated tokens fed to the matcher so far

    def sync(self, output_ids: list[int]) -> None:
        """Feed the generated tokens not yet seen (each was sampled under this guide's mask)."""
        new = output_ids[self.consumed :]
        if new:
            if not self.matcher.consume_tokens(new):
                raise RuntimeError(
                    f"structured output: token(s) {new} rejected by the grammar "
                    f"({self.matcher.get_error()})"
                )
            self.consumed = len(output_ids)

    def fill(self, words: np.ndarray) -> None:
        """Write the next-token bitmask into the int32 row `words` ([ceil(V / 32)])."""
        assert words.dtype == np.int32 and words.flags["C_CONTIGUOUS"]
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)


class Structured:
    """Per-model structured-output support: compiles constraints, makes Guides."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = tuple(sorted(eos_ids))

    @functools.cached_property
    def info(self) -> Any:
        if self.tokenizer is None:
            raise InvalidRequest("structured_outputs", "structured output needs a tokenizer")
        if not self.eos_ids:
            raise InvalidRequest(
                "structured_outputs", "structured output needs the model's EOS token id"
            )
        return _tokenizer_info(self.tokenizer, self.vocab_size, self.eos_ids)

    def check(self, structured: tuple[tuple[str, str], ...]) -> None:
        """Compile and validate (the client's 400 names the field and llguidance's reason)."""
        for kind, spec in structured:
            try:
                grammar = grammar_of(kind, spec)
            except InvalidRequest:
                raise
            except Exception as e:  # noqa: BLE001 - llguidance's message is the client's answer
                raise InvalidRequest(kind, f"{kind} is not usable: {str(e)[:300]}") from None
            err = _lg().LLMatcher.validate_grammar(grammar, self.info)
            if err:
                raise InvalidRequest(kind, f"{kind} is not usable: {str(err)[:300]}")

    def guide(self, structured: tuple[tuple[str, str], ...]) -> Guide:
        (kind, spec), = structured
        return Guide(self.info, grammar_of(kind, spec))
