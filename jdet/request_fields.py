"""Every per-request sampling field, declared once, and the one check of a request's values.

`FIELDS` is the table: a field's name (the Python API's and the engine's), its type and default in
`jdet.SamplingParams`, its bounds, its name in the OpenAI / vLLM HTTP API and the endpoints that
take it. From it follow `jdet.SamplingParams` (jdet/sampling_params.py), the sampling fields of the
server's request schemas (serving/http/protocol.py) and the engine's `SamplingOptions`
(serving/sampling_options.py). `engine_values` turns any of them (or a dict) into the engine's
form, and `check` validates that form: the one validation every entry point (LLM, server, CLI,
engine) goes through. Its bounds are those of the arrays the step receives (int32 top_k and token
ids, u32 seed keys, f32 temperature, the MAX_LOGIT_BIAS-wide bias arrays, NUM_TOP top log-probs),
so a value that passes cannot fail inside a step. The server adds only what HTTP limits further
(`RequestField.http_limits`: OpenAI's temperature <= 2, at most 16 samples, ...).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Iterable
from typing import Any

import numpy as np

from jdet.sampling import MAX_LOGIT_BIAS, NUM_TOP

INT32_MAX = 2**31 - 1  # top_k, positions and token ids travel to the device as int32
SEED_MIN, SEED_END = -(2**63), 2**64  # any seed in this range maps to a u32 key (derive_seed)
F32_MAX = float(np.finfo(np.float32).max)  # temperature travels as f32
MAX_STOP_STRINGS = 64  # stop strings and bad words per request
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
BOTH = ("completions", "chat")


@dataclasses.dataclass(frozen=True)
class RequestField:
    """One request field.

    kind: "int", "real" or "bool" (checked against lo/hi by `check`), or "" (a list, dict or
        structured-output field with its own rule in `check`).
    lo, hi: inclusive bounds; `lo_open` makes lo exclusive. rule: for an int, a note the error
        message adds after its range; for a real, what the message says it must be.
    http: its name in a request body (None: not accepted over HTTP); `endpoints` the endpoints
        that take it; `http_limits`: pydantic Field bounds HTTP adds (OpenAI's or the server's).
    api: a `jdet.SamplingParams` field; engine: a `SamplingOptions` field (the structured-output
        fields reach the engine as one `structured` tuple).
    """

    name: str
    annotation: str
    default: Any
    help: str
    kind: str = ""
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    rule: str = ""
    http: str | None = None
    endpoints: tuple[str, ...] = BOTH
    http_limits: dict[str, Any] = dataclasses.field(default_factory=dict)
    api: bool = True
    engine: bool = True


F = RequestField
FIELDS: tuple[RequestField, ...] = (
    F("temperature", "float", 1.0, "0 = greedy", "real", 0, F32_MAX,
      rule="a finite number >= 0 (0 = greedy)", http="temperature", http_limits={"le": 2}),
    F("top_p", "float", 1.0, "nucleus sampling; 1 = off", "real", 0, 1, lo_open=True,
      http="top_p"),
    F("top_k", "int", 0, "0 = off (-1 also means off)", "int", 0, INT32_MAX,
      rule="0 = off; -1 also means off", http="top_k"),
    F("max_tokens", "int", 16, "tokens to generate at most", "int", 1, INT32_MAX,
      http="max_tokens"),
    F("seed", "int | None", None, "None: one is picked at admission and reported", "int",
      SEED_MIN, SEED_END - 1, http="seed"),
    F("stop", "str | list[str] | None", None, "stop strings (removed from the output)",
      http="stop"),
    F("stop_token_ids", "list[int] | None", None, "token ids that end the output",
      http="stop_token_ids", http_limits={"max_length": 64}),
    F("ignore_eos", "bool", False, "generate past EOS", "bool", http="ignore_eos"),
    F("n", "int", 1, "samples per prompt", "int", 1, INT32_MAX, http="n",
      http_limits={"le": 16}),
    F("logprobs", "int | None", None, "top log-probs to return per generated token", "int", 0,
      NUM_TOP, http="logprobs", endpoints=("completions",)),
    # Logits transforms, row-local so a request's bits never depend on its batch (jdet/sampling.py
    # gives the order). Names and meanings as in the OpenAI API and vLLM.
    F("presence_penalty", "float", 0.0, "minus this for each token already generated", "real",
      -2, 2, http="presence_penalty"),
    F("frequency_penalty", "float", 0.0, "minus this times the token's generated count", "real",
      -2, 2, http="frequency_penalty"),
    F("repetition_penalty", "float", 1.0, "prompt + generated tokens; > 1 discourages", "real",
      0, 100, lo_open=True, rule="a number in (0, 100] (1 = off)", http="repetition_penalty"),
    F("logit_bias", "dict[int, float] | None", None, "token id -> bias in [-100, 100]",
      http="logit_bias"),
    F("min_p", "float", 0.0, "keep tokens with p >= min_p * p_max (after temperature)", "real",
      0, 1, http="min_p"),
    F("min_tokens", "int", 0, "EOS and stop_token_ids banned until this many (stop strings "
      "apply)", "int", 0, INT32_MAX, http="min_tokens"),
    F("bad_words", "list[str] | None", None, "words never generated (vLLM's token-sequence "
      "rule)", http="bad_words", http_limits={"max_length": 64}),
    F("allowed_token_ids", "list[int] | None", None, "only these tokens may be generated",
      http="allowed_token_ids", http_limits={"max_length": 1 << 20}),
    F("prompt_logprobs", "int | None", None, "0: also return the prompt tokens' log-probs",
      "int", 0, 0, rule="the prompt tokens' own log-probs; top-k alternatives for prompt "
      "positions are not implemented"),
    # Structured output (at most one): a JSON schema (dict or JSON text), any JSON object, a
    # regular expression, one of a list of strings, or a Lark grammar (llguidance syntax).
    F("json_schema", "dict | str | None", None, "a JSON schema", http="guided_json",
      engine=False),
    F("json_object", "bool", False, "any JSON object (HTTP: response_format)", engine=False),
    F("regex", "str | None", None, "a regular expression", http="guided_regex", engine=False),
    F("choice", "list[str] | None", None, "one of these strings", http="guided_choice",
      http_limits={"min_length": 1, "max_length": 1024}, engine=False),
    F("grammar", "str | None", None, "a Lark grammar", http="guided_grammar", engine=False),
    # the engine's own
    F("skip_special_tokens", "bool", True, "special tokens are left out of the text", "bool",
      api=False),
    F("structured", "tuple", (), "((kind, spec), ...) from the structured-output fields",
      api=False),
)  # fmt: skip
del F
BY_NAME = {f.name: f for f in FIELDS}
API_FIELDS = tuple(f for f in FIELDS if f.api)
ENGINE_FIELDS = tuple(f for f in FIELDS if f.engine)
OPTIONAL = ("seed", "max_tokens", "logprobs", "prompt_logprobs")  # None is a value of its own


def http_fields(endpoint: str) -> tuple[RequestField, ...]:
    """The fields a request body to `endpoint` ("completions" or "chat") may carry."""
    return tuple(f for f in FIELDS if f.http and endpoint in f.endpoints)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """' (did you mean 'max_tokens'?)' for a near miss of a known name, else ''."""
    near = difflib.get_close_matches(str(name), sorted(known), n=1, cutoff=0.75)
    return f" (did you mean {near[0]!r}?)" if near else ""


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


# ---------------------------------------------------------------------- the engine's form
def engine_values(p: object) -> dict[str, Any]:
    """The engine's values (`ENGINE_FIELDS`) from any params object or dict: lists become
    tuples, None the default, a logit_bias dict sorted (id, bias) pairs, the structured-output
    fields one `structured` tuple. Nothing is converted to a number here: `check` then names any
    value of the wrong type instead of a bare `int()` error."""
    if isinstance(p, dict):
        def get(k: str) -> Any:
            return p.get(k, BY_NAME[k].default if k in BY_NAME else None)
    else:
        def get(k: str) -> Any:
            return getattr(p, k, BY_NAME[k].default if k in BY_NAME else None)
    out = {}
    for f in ENGINE_FIELDS:
        v = get(f.name)
        out[f.name] = f.default if v is None and f.name not in OPTIONAL else v
    stop = out["stop"]
    out["stop"] = (stop,) if isinstance(stop, str) else _tuple(stop)
    out["stop_token_ids"] = _tuple(out["stop_token_ids"])
    if _is_int(out["top_k"]) and out["top_k"] == -1:
        out["top_k"] = 0  # OpenAI / vLLM spell "off" -1
    out["logit_bias"] = _bias_items(out["logit_bias"])
    out["bad_words"] = (out["bad_words"],) if isinstance(out["bad_words"], str) else _tuple(
        out["bad_words"])  # fmt: skip
    allowed = get("allowed_token_ids")
    out["allowed_token_ids"] = None if allowed is None else _tuple(allowed)
    out["structured"] = _structured(get)
    return out


def _tuple(v: object) -> object:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, list | tuple) else v  # anything else: check() names it


def _bias_items(b: object) -> object:
    """A logit_bias dict ({token id: bias}, ids as ints or decimal strings) -> sorted items."""
    if not b:
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


def _structured(get: Any) -> object:
    """json_schema / json_object / regex / choice / grammar (or an already built `structured`
    tuple) -> ((kind, spec string), ...); JSON values are serialised."""
    given = get("structured")
    if given:
        return tuple(given)
    out = []
    for kind in STRUCTURED_KINDS:
        v = get(kind)
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


# ---------------------------------------------------------------------- the check
def check(o: object, vocab_size: int | None = None) -> None:
    """Raise InvalidRequest naming the first bad field of `o` (the engine's form: a
    SamplingOptions, or any object with its attribute names).

    Model-dependent bounds (token ids < vocab) apply when `vocab_size` is given.
    """
    for f in ENGINE_FIELDS:
        v = getattr(o, f.name)
        if f.kind == "int" and not (v is None and f.name in OPTIONAL):
            check_int(v, f.name, int(f.lo), int(f.hi), f" ({f.rule})" if f.rule else "")
        elif f.kind == "real":
            ok = _is_real(v) and math.isfinite(v) and (f.lo < v if f.lo_open else f.lo <= v)
            if not (ok and v <= f.hi):
                lb = "(" if f.lo_open else "["
                rule = f.rule or f"a number in {lb}{f.lo:g}, {f.hi:g}]"
                raise InvalidRequest(f.name, f"{f.name} must be {rule}, got {v!r}")
        elif f.kind == "bool" and not isinstance(v, bool | np.bool_):
            raise InvalidRequest(f.name, f"{f.name} must be true or false")
    hi = INT32_MAX if vocab_size is None else vocab_size - 1
    _check_strings(o.stop, "stop", "stop strings")
    for tid in o.stop_token_ids:
        check_int(tid, "stop_token_ids", 0, hi, " (token ids of the vocabulary)")
    if o.max_tokens is not None and o.min_tokens > o.max_tokens:
        raise InvalidRequest(
            "min_tokens",
            f"min_tokens={o.min_tokens} exceeds max_tokens={o.max_tokens}; lower it",
        )
    _check_logit_bias(o.logit_bias, hi)
    _check_strings(o.bad_words, "bad_words", "bad_words", strip=True)
    if o.allowed_token_ids is not None:
        if not isinstance(o.allowed_token_ids, tuple) or not o.allowed_token_ids:
            raise InvalidRequest(
                "allowed_token_ids", "allowed_token_ids must be a non-empty list of token ids"
            )
        for tid in o.allowed_token_ids:
            check_int(tid, "allowed_token_ids", 0, hi, " (token ids of the vocabulary)")
    _check_structured(o.structured, o.ignore_eos)


def _check_strings(v: object, field: str, what: str, strip: bool = False) -> None:
    if not isinstance(v, tuple) or len(v) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            field, f"{field} must be a string or a list of at most {MAX_STOP_STRINGS} strings"
        )
    for s in v:
        if not isinstance(s, str) or not (s.strip() if strip else s):
            raise InvalidRequest(field, f"{what} must be non-empty strings")
        if _has_surrogate(s):
            raise InvalidRequest(field, f"{what} must be valid Unicode (lone surrogate)")


def _check_logit_bias(items: object, hi: int) -> None:
    if not isinstance(items, tuple) or len(items) > MAX_LOGIT_BIAS:
        raise InvalidRequest(
            "logit_bias",
            f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases in [-100, 100]",
        )
    seen = set()
    for tid, b in items:
        check_int(tid, "logit_bias", 0, hi, " (keys are token ids of the vocabulary)")
        if int(tid) in seen:
            raise InvalidRequest("logit_bias", f"logit_bias names token {tid} twice")
        seen.add(int(tid))
        if not _is_real(b) or not (math.isfinite(b) and -100 <= b <= 100):
            raise InvalidRequest(
                "logit_bias", f"logit_bias values must be numbers in [-100, 100], got {b!r}"
            )


def _check_structured(structured: object, ignore_eos: object) -> None:
    if not isinstance(structured, tuple) or len(structured) > 1:
        names = ", ".join(k for k, _ in structured) if isinstance(structured, tuple) else "?"
        raise InvalidRequest(
            "structured_outputs", f"give at most one structured-output constraint, got {names}"
        )
    for kind, spec in structured:
        if kind not in STRUCTURED_KINDS or not isinstance(spec, str):
            raise InvalidRequest(
                kind if isinstance(kind, str) else "structured_outputs",
                f"{kind} must be one of {', '.join(STRUCTURED_KINDS)} given as a string or "
                "JSON value",
            )
        if ignore_eos:
            raise InvalidRequest(
                "ignore_eos", "ignore_eos cannot be combined with structured output (the "
                "output ends with EOS when the structure is complete)"
            )


def engine_annotation(f: RequestField) -> str:
    """A field's type in the engine's form (lists as tuples, logit_bias as sorted pairs)."""
    return (f.annotation.replace("list[str]", "tuple[str, ...]")
            .replace("list[int]", "tuple[int, ...]")
            .replace("dict[int, float] | None", "tuple[tuple[int, float], ...]"))  # fmt: skip


ENGINE_DEFAULTS = engine_values({})  # SamplingOptions' defaults: () for the lists
