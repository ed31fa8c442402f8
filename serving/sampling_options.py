"""How one request samples, and the one boundary check every entry point goes through.

`SamplingOptions` is what the engine needs to know about sampling one request (built from
`jdet.SamplingParams`, a dict or the server's pydantic models by `from_any`); `check()` and
`check_prompt_ids` raise `InvalidRequest` naming the field. Bounds are those of the arrays the
step receives, so nothing that passes them can fail inside the model runner.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np

NUM_TOP = 20  # top log-probs the step returns per row (jdet.step.NUM_TOP)
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
    # logits transforms (jdet/sampling.py: order and semantics)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens exist
    logit_bias: tuple[tuple[int, float], ...] = ()
    bad_words: tuple[str, ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None
    prompt_logprobs: int | None = None  # log-probs of the prompt tokens (0 only)
    # structured output: ((kind, spec), ...), kind in STRUCTURED_KINDS; at most one
    structured: tuple[tuple[str, str], ...] = ()

    @property
    def needs_logits_inputs(self) -> bool:
        """Whether this request's rows need the step's LogitsInputs (not the neutral ones)."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
            or self.min_p or self.min_tokens or self.logit_bias or self.bad_words
            or self.allowed_token_ids is not None or self.structured
        )  # fmt: skip

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
            presence_penalty=_or(get("presence_penalty", 0.0), 0.0),
            frequency_penalty=_or(get("frequency_penalty", 0.0), 0.0),
            repetition_penalty=_or(get("repetition_penalty", 1.0), 1.0),
            min_p=_or(get("min_p", 0.0), 0.0),
            min_tokens=_or(get("min_tokens", 0), 0),
            logit_bias=_bias_items(get("logit_bias", None)),
            bad_words=_str_tuple(get("bad_words", None)),
            allowed_token_ids=_opt_tuple(get("allowed_token_ids", None)),
            prompt_logprobs=get("prompt_logprobs", None),
            structured=_structured(get),
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
        self._check_transforms(hi)
        return self

    def _check_transforms(self, hi: int) -> None:
        """The logits transforms and structured output (jdet/sampling.py)."""
        for name, lo, top in (("presence_penalty", -2, 2), ("frequency_penalty", -2, 2),
                              ("min_p", 0, 1)):  # fmt: skip
            v = getattr(self, name)
            if not _is_real(v) or not (math.isfinite(v) and lo <= v <= top):
                raise InvalidRequest(name, f"{name} must be a number in [{lo}, {top}], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not (math.isfinite(r) and 0 < r <= 100):
            raise InvalidRequest(
                "repetition_penalty",
                f"repetition_penalty must be a number in (0, 100] (1 = off), got {r!r}",
            )
        check_int(self.min_tokens, "min_tokens", 0, INT32_MAX)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest(
                "min_tokens",
                f"min_tokens={self.min_tokens} exceeds max_tokens={self.max_tokens}; lower it",
            )
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(
                "logit_bias",
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
            )
        seen = set()
        for tid, b in self.logit_bias:
            check_int(tid, "logit_bias", 0, hi, " (keys are token ids of the vocabulary)")
            if int(tid) in seen:
                raise InvalidRequest("logit_bias", f"logit_bias names token {tid} twice")
            seen.add(int(tid))
            if not _is_real(b) or not (math.isfinite(b) and -100 <= b <= 100):
                raise InvalidRequest(
                    "logit_bias", f"logit_bias values must be numbers in [-100, 100], got {b!r}"
                )
        if not isinstance(self.bad_words, tuple) or len(self.bad_words) > MAX_STOP_STRINGS:
            raise InvalidRequest(
                "bad_words", f"bad_words must be a list of at most {MAX_STOP_STRINGS} strings"
            )
        for w in self.bad_words:
            if not isinstance(w, str) or not w.strip() or _has_surrogate(w):
                raise InvalidRequest("bad_words", "bad_words must be non-empty Unicode strings")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, tuple) or not self.allowed_token_ids:
                raise InvalidRequest(
                    "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids"
                )
            for tid in self.allowed_token_ids:
                check_int(tid, "allowed_token_ids", 0, hi, " (token ids of the vocabulary)")
        if self.prompt_logprobs is not None:
            check_int(self.prompt_logprobs, "prompt_logprobs", 0, 0,
                      " (the prompt tokens' own log-probs; top-k alternatives for prompt "
                      "positions are not implemented)")  # fmt: skip
        if not isinstance(self.structured, tuple) or len(self.structured) > 1:
            names = ", ".join(k for k, _ in self.structured) if isinstance(
                self.structured, tuple) else "?"  # fmt: skip
            raise InvalidRequest(
                "structured_outputs",
                f"give at most one structured-output constraint, got {names}",
            )
        for kind, spec in self.structured:
            if kind not in STRUCTURED_KINDS or not isinstance(spec, str):
                raise InvalidRequest(
                    kind if isinstance(kind, str) else "structured_outputs",
                    f"{kind} must be one of {', '.join(STRUCTURED_KINDS)} given as a string or "
                    "JSON value",
                )
            if self.ignore_eos:
                raise InvalidRequest(
                    "ignore_eos", "ignore_eos cannot be combined with structured output (the "
                    "output ends with EOS when the structure is complete)"
                )


F32_MAX = float(np.finfo(np.float32).max)
MAX_LOGIT_BIAS = 300  # jdet.sampling.MAX_LOGIT_BIAS (the width of the step's bias arrays)
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _or(v: object, default: object) -> object:
    return default if v is None else v


def _bias_items(b: object) -> object:
    """A logit_bias dict ({token id: bias}, ids as ints or decimal strings) -> sorted items."""
    if b is None:
        return ()
    if not isinstance(b, dict):
        return b  # check() names it
    items = []
    for k, v in b.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k)
        items.append((k, v))
    try:
        return tuple(sorted(items, key=lambda kv: int(kv[0])))
    except (TypeError, ValueError):
        return tuple(items)


def _str_tuple(v: object) -> object:
    if v is None:
        return ()
    if isinstance(v, str):
        return (v,)
    return tuple(v) if isinstance(v, list | tuple) else v


def _opt_tuple(v: object) -> object:
    return None if v is None else (tuple(v) if isinstance(v, list | tuple) else v)


def _structured(get: object) -> object:
    """SamplingParams' json_schema / json_object / regex / choice / grammar (or an already built
    `structured` tuple) -> ((kind, spec string), ...); JSON values are serialised."""
    given = get("structured", None)  # type: ignore[operator]
    if given:
        return tuple(given)
    out = []
    for kind in STRUCTURED_KINDS:
        v = get(kind, None)  # type: ignore[operator]
        if v is None or v is False:
            continue
        if kind == "json_object":
            v = ""
        elif kind == "choice":
            if not isinstance(v, list | tuple) or not v or not all(
                isinstance(c, str) and c for c in v
            ):
                return ((kind, None),)  # check() names it
            v = json.dumps(list(v))
        elif kind == "json_schema" and isinstance(v, dict):
            v = json.dumps(v)
        out.append((kind, v))
    return tuple(out)


def check_request(
    prompt: object, opts: SamplingOptions, *, vocab_size: int, max_model_len: int
) -> None:
    """The whole boundary check of one request: its prompt ids and its sampling options."""
    check_prompt_ids(prompt, vocab_size=vocab_size, max_model_len=max_model_len, field="prompt")
    opts.check(vocab_size)
