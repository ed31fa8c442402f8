"""OpenAI request schemas and validation: bad input becomes a 4xx naming the field, here.

Why parse by hand instead of FastAPI's body binding: every failure (malformed JSON, wrong type,
out-of-range value, unsupported feature) must answer in the OpenAI error format with the field in
`param`, and nothing invalid may reach the engine thread. Checks that need the model (vocabulary,
`max_model_len`, chat template) and the parsing itself are in serving/http/request_parsing.py
(`parse`, `check_prompt`, `sampling_options`, called by the server); they end in the shared
boundary check of jdet/request_fields.py (`check`, `check_prompt_ids`) that `jdet.LLM` and the
engine use too.

The sampling fields (temperature ... guided_grammar) are not written here: they are generated from
jdet/request_fields.py `FIELDS`, the one declaration of every request field, with its HTTP name,
the endpoints that take it and the limits HTTP adds. Pydantic checks their JSON types and those
limits; their bounds are the shared check's. What is written here is what only HTTP has: the
prompt or messages, streaming, echo, response_format, and the fields refused or ignored by name.

A parameter is either honoured or refused by name: unknown fields are a 400 naming them, except
the documented no-ops in `ACCEPTED_NO_OPS`; vLLM/OpenAI extras jdet does not implement are listed,
with the reason, in `UNSUPPORTED` (one place: delete an entry when the feature lands).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, create_model

from jdet.request_fields import BOTH, FIELDS, INT32_MAX, RequestField, http_fields
from jdet.sampling import NUM_TOP

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts per completions request
MAX_STOP = 16  # stop strings per request
MAX_JSON_DEPTH = 32  # nesting of the request body (the deepest valid request needs 5)
MAX_ECHO = 80  # characters of client-supplied text quoted back in an error message

# Parameters of vLLM / OpenAI that jdet does not implement. A request that sends one is refused
# naming it (a silently ignored `min_p=0.99` would return text the client did not ask for), unless
# it sends the value that is jdet's fixed behaviour (`SAME_AS_JDET`).
UNSUPPORTED: dict[str, str] = {
    "length_penalty": "beam search is not implemented",
    "use_beam_search": "beam search is not implemented",
    "early_stopping": "beam search is not implemented",
    "prompt_logprobs": "prompt log-probs are not returned over HTTP yet (use jdet.LLM.generate "
    "with SamplingParams(prompt_logprobs=0), or jdet.LLM.score)",
    "guided_decoding_backend": "the structured-output backend is always llguidance",
    "guided_whitespace_pattern": "the JSON whitespace rule is llguidance's",
    "structured_outputs": "send guided_json / guided_regex / guided_choice / guided_grammar or "
    "response_format instead",
    "truncate_prompt_tokens": "prompt truncation is not implemented; shorten the prompt",
    "spaces_between_special_tokens": "detokenisation options are not implemented",
    "include_stop_str_in_output": "stop strings are always removed from the output",
    "skip_special_tokens": "special tokens are always skipped in the text",
    "add_special_tokens": "the chat template / tokenizer default is always used",
    "continue_final_message": "only add_generation_prompt=true is implemented",
    "add_generation_prompt": "only add_generation_prompt=true is implemented",
    "chat_template": "a per-request chat template is not accepted",
    "chat_template_kwargs": "chat template arguments are not accepted",
    "tool_choice": "tools are not supported",
    "parallel_tool_calls": "tools are not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "modalities": "only text output is supported",
    "audio": "only text output is supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "reasoning settings are not supported",
    "web_search_options": "web search is not supported",
    "priority": "request priorities are not implemented (FCFS)",
    "logits_processors": "logits processors are not accepted over HTTP",
}
SAME_AS_JDET: dict[str, Any] = {
    "use_beam_search": False,
    "skip_special_tokens": True,
    "include_stop_str_in_output": False,
    "spaces_between_special_tokens": True,
    "add_generation_prompt": True,
    "continue_final_message": False,
}
# Fields accepted and ignored because they cannot change a response's tokens.
ACCEPTED_NO_OPS: dict[str, str] = {
    "user": "an end-user id for the client's own records",
    "metadata": "client-side tags",
    "store": "jdet stores nothing",
    "service_tier": "there is one tier",
    "request_id": "clients' tracing id (the response carries jdet's own id)",
    "safety_identifier": "an end-user id for the client's own records",
    "prompt_cache_key": "a cache-routing hint (jdet's prefix cache needs none)",
}


def clip(text: object, limit: int = MAX_ECHO) -> str:
    """`repr` of client input, cut to `limit` characters: errors never echo a 100 KB string."""
    r = repr(text)
    return r if len(r) <= limit else f"{r[:limit]}... ({len(r)} characters)"

Int = StrictInt
Num = Annotated[float, Field(strict=False)]
# a table field's Python type -> the JSON type its HTTP field takes (None: absent, the default)
JSON_TYPES: dict[str, Any] = {
    "float": Num | None,
    "int": Int | None,
    "int | None": Int | None,
    "bool": StrictBool,
    "str | None": StrictStr | None,
    "str | list[str] | None": StrictStr | list[StrictStr] | None,
    "list[str] | None": list[StrictStr] | None,
    "list[int] | None": list[Int] | None,
    "dict[int, float] | None": dict[str, Num] | None,  # JSON object keys are strings
    "dict | str | None": dict[str, Any] | StrictStr | None,
}


def sampling_fields(endpoints: tuple[str, ...]) -> dict[str, Any]:
    """Pydantic field definitions of the table's HTTP fields taken by exactly `endpoints`."""
    def spec(f: RequestField) -> tuple[Any, Any]:
        default = False if f.annotation == "bool" else None
        return JSON_TYPES[f.annotation], Field(default, **f.http_limits)

    return {f.http: spec(f) for f in FIELDS if f.http and f.endpoints == endpoints}


class RequestError(Exception):
    """A client error: HTTP `status`, a message that says what to fix, and the offending field."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        # client text quoted in a message may hold lone surrogates: the JSON answer must encode
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        if param is not None:
            param = param.encode("utf-8", "backslashreplace").decode("utf-8")[:100]
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        if self.status == 401:
            kind = "authentication_error"
        return {
            "error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class _Common(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions (unknown fields are refused);
    `CommonRequest` adds the table's sampling fields."""

    model_config = ConfigDict(extra="forbid")
    endpoint: ClassVar[str]  # "completions" or "chat": which of the table's fields it takes

    model: StrictStr
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None

    def sampling_values(self) -> dict[str, Any]:
        """The table's fields this request sent, by their Python API / engine names."""
        out = {}
        for f in http_fields(self.endpoint):
            v = getattr(self, f.http)
            if v is not None:
                out[f.name] = v
        return out

    def structured(self) -> tuple[tuple[str, str], ...]:
        """Structured output asked for outside the table's fields (chat's response_format)."""
        return ()

    def unsupported(self) -> None:
        """Reject features jdet does not implement rather than silently ignoring them."""
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        stop = self.stop  # type: ignore[attr-defined]
        if not isinstance(stop, str) and len(stop or ()) > MAX_STOP:
            raise RequestError(f"at most {MAX_STOP} stop strings are allowed", "stop")


CommonRequest = create_model("CommonRequest", __base__=_Common, **sampling_fields(BOTH))
CommonRequest.__module__ = __name__


class _Completion(CommonRequest):
    endpoint: ClassVar[str] = "completions"
    prompt: StrictStr | list[StrictStr] | list[Int] | list[list[Int]]
    echo: StrictBool = False
    best_of: Int | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo and self.logprobs is not None:
            raise RequestError(
                "echo with logprobs is not supported (prompt log-probs are not returned over "
                "HTTP yet); send echo without logprobs, or use jdet.LLM.score",
                "echo",
            )
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise RequestError(
                "best_of is not supported (it must equal n or be omitted)", "best_of"
            )
        if self.suffix:
            raise RequestError("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: text or token-id lists (a batch when given a list of them)."""
        p = self.prompt
        if isinstance(p, str):
            out: list = [p]
        elif p and isinstance(p[0], int):
            out = [p]
        else:
            out = list(p)
        if not out:
            raise RequestError("prompt must not be empty", "prompt")
        if len(out) > MAX_PROMPTS:
            raise RequestError(f"at most {MAX_PROMPTS} prompts per request", "prompt")
        return out


CompletionRequest = create_model(
    "CompletionRequest", __base__=_Completion, **sampling_fields(("completions",))
)
CompletionRequest.__module__ = __name__


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None  # accepted, not shown to the template (OpenAI's optional tag)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(CommonRequest):
    endpoint: ClassVar[str] = "chat"
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=NUM_TOP)
    max_completion_tokens: Int | None = Field(None, ge=1, le=INT32_MAX)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.tools:
            raise RequestError("tools are not supported", "tools")
        self.structured()  # names a malformed response_format
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")

    def structured(self) -> tuple[tuple[str, str], ...]:
        """response_format: {"type": "text" | "json_object" | "json_schema", "json_schema":
        {"name", "schema", "strict", "description"}} (the guided_* extras are table fields)."""
        out: list[tuple[str, str]] = []
        rf = self.response_format
        if rf is None:
            return tuple(out)
        kind = rf.get("type")
        if kind == "json_object" and set(rf) <= {"type"}:
            out.append(("json_object", ""))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            extra = set(rf) - {"type", "json_schema"}
            if not isinstance(js, dict) or extra or not isinstance(js.get("schema"), dict):
                raise RequestError(
                    "response_format json_schema needs {'type': 'json_schema', 'json_schema': "
                    "{'name': ..., 'schema': {...}}}",
                    "response_format",
                )
            unknown = set(js) - {"name", "schema", "strict", "description"}
            if unknown:
                raise RequestError(
                    f"response_format.json_schema: unknown field(s) {sorted(unknown)}",
                    "response_format",
                )
            out.append(("json_schema", json.dumps(js["schema"])))
        elif not (kind == "text" and set(rf) <= {"type"}):
            raise RequestError(
                f"response_format type {clip(kind, 40)} is not supported; use 'text', "
                "'json_object' or 'json_schema'",
                "response_format",
            )
        return tuple(out)
