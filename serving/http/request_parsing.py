"""A request body -> a validated request -> the engine's SamplingOptions (the server calls these).

`parse` turns JSON bytes into one of serving/http/protocol.py's schemas, refusing (as a RequestError
naming the field) malformed JSON, bodies nested deeper than MAX_JSON_DEPTH, lone surrogates,
unsupported and unknown fields; `sampling_options` gives the engine's options for one prompt (the
endpoint's defaults and max_tokens against what the prompt leaves). Their values are checked
once, by the engine's admission (serving/engine/admission.py: jdet/request_fields.py's bounds,
the vocabulary, the grammar), which the server calls; `request_error` names the field as the
client spelled it.

Defaults are OpenAI's where the OpenAI API has one: /v1/completions without `max_tokens` generates
at most 16 tokens (`COMPLETIONS_MAX_TOKENS`); /v1/chat/completions without `max_tokens` or
`max_completion_tokens` has no limit of its own in the OpenAI API, so it runs until EOS, a stop
or the end of `max_model_len`.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from pydantic import ValidationError

from jdet.request_fields import did_you_mean
from serving.http.protocol import (
    ACCEPTED_NO_OPS,
    MAX_JSON_DEPTH,
    SAME_AS_JDET,
    UNSUPPORTED,
    CommonRequest,
    CompletionRequest,
    RequestError,
    clip,
)
from serving.sampling_options import SamplingOptions

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


def _path(link: tuple | None) -> str:
    """'messages.0.content' from the (parent link, key) chain; keys cut to 40 characters."""
    parts: list[str] = []
    while link is not None:
        link, key = link
        parts.append(str(key)[:40].encode("utf-8", "backslashreplace").decode())
    return ".".join(reversed(parts))


def _check_tree(obj: Any) -> None:
    """Depth limit and valid Unicode everywhere, without recursion (a hostile body cannot
    exhaust the stack here). Lone surrogates (`"\\ud800"`) are legal JSON but not text: they
    would fail in the tokenizer, so they are named here. Paths are built only for an error, and
    numbers are not visited, so a 4 MB list of token ids costs one pass over it."""
    stack: list[tuple[Any, tuple | None, int]] = [(obj, None, 1)]
    nested = (str, dict, list)
    while stack:
        x, link, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            where = _path(link)
            raise RequestError(
                f"request body nests deeper than {MAX_JSON_DEPTH} levels", where or None
            )
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                where = _path(link)
                raise RequestError(
                    f"{where or 'body'} is not valid Unicode text (it contains a lone surrogate "
                    "such as \\ud800); send UTF-8 text",
                    where or None,
                ) from None
        elif isinstance(x, dict):
            for k, v in x.items():
                stack.append((k, (link, k), depth + 1))
                if isinstance(v, nested):
                    stack.append((v, (link, k), depth + 1))
        elif isinstance(x, list):
            stack.extend(
                (v, (link, i), depth + 1) for i, v in enumerate(x) if isinstance(v, nested)
            )


def _check_fields(obj: dict, schema: type[CommonRequest]) -> dict:
    """Refuse unsupported and unknown top-level fields by name; drop the documented no-ops."""
    for k, v in obj.items():
        if k in UNSUPPORTED and not (
            k in SAME_AS_JDET
            and isinstance(v, bool) == isinstance(SAME_AS_JDET[k], bool)
            and v == SAME_AS_JDET[k]
        ):
            raise RequestError(
                f"{k} is not supported by jdet ({UNSUPPORTED[k]}); remove it from the request", k
            )
    known = (schema.model_fields, ACCEPTED_NO_OPS, UNSUPPORTED)  # those left send the default
    unknown = [k for k in obj if not any(k in names for names in known)]
    if unknown:
        names = ", ".join(clip(k, 40) for k in unknown[:5])
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        hint = did_you_mean(unknown[0][:100], schema.model_fields)
        raise RequestError(
            f"unknown field(s) {names}{more}{hint}; remove them (accepted no-ops: "
            f"{', '.join(sorted(ACCEPTED_NO_OPS))})",
            unknown[0][:40],
        )
    drop = (set(ACCEPTED_NO_OPS) | set(UNSUPPORTED)) - set(schema.model_fields)  # typed: kept
    return {k: v for k, v in obj.items() if k not in drop}


def parse(raw: bytes, schema: type[CommonRequest]) -> Any:
    """JSON bytes -> validated request, or RequestError naming the first bad field."""
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise RequestError(f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {str(e)[:200]}", None) from None
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object", None)
    _check_tree(obj)
    obj = _check_fields(obj, schema)
    try:
        req = schema.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "list["))]
        # unions report one branch per error; keep the path to the field itself
        field = ".".join(x for x in loc if x not in ("str", "int", "float", "bool")) or None
        field = field if field is None else clip(field, 60).strip("'")
        raise RequestError(f"{field}: {err['msg'][:300]}", field) from None
    req.unsupported()
    return req


def request_error(req: CommonRequest | None, e: ValueError) -> RequestError:
    """An engine check's InvalidRequest (serving/engine/admission.py) as the client's 400,
    naming the field as the request spelled it (chat's max_completion_tokens)."""
    field = getattr(e, "field", None)
    if field == "max_tokens" and getattr(req, "max_completion_tokens", None) is not None:
        field = "max_completion_tokens"
    return RequestError(str(e), field)


def sampling_options(req: CommonRequest, *, prompt_len: int, max_model_len: int) -> SamplingOptions:
    """Engine sampling options for one prompt of a parsed request: the table's fields it sent,
    the endpoint's own (chat's logprobs / top_logprobs, max_completion_tokens,
    response_format) and its defaults, unchecked: the engine's admission checks them, once
    (serving/engine/admission.py; the server calls it)."""
    values = req.sampling_values()
    room = max_model_len - prompt_len
    field = "max_tokens"
    if isinstance(req, CompletionRequest):
        max_tokens = values.get("max_tokens")
        if max_tokens is None:  # OpenAI's default, within what the prompt leaves
            values["max_tokens"] = min(COMPLETIONS_MAX_TOKENS, room)
    else:
        if req.max_completion_tokens is not None:
            field, values["max_tokens"] = "max_completion_tokens", req.max_completion_tokens
        values.setdefault("max_tokens", room)
        values["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = values["max_tokens"]
    if isinstance(max_tokens, int) and max_tokens > room:
        raise RequestError(
            f"{field}={max_tokens} plus the prompt's {prompt_len} tokens exceeds "
            f"max_model_len={max_model_len}; ask for at most {room}",
            field,
        )
    opts = SamplingOptions.from_any(values)
    if req.structured():
        opts = dataclasses.replace(opts, structured=opts.structured + req.structured())
    return opts
