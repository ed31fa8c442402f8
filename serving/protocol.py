"""OpenAI request schemas and validation: bad input becomes a 4xx naming the field, here.

Why parse by hand instead of FastAPI's body binding: every failure (malformed JSON, wrong type,
out-of-range value, unsupported feature) must answer in the OpenAI error format with the field in
`param`, and nothing invalid may reach the engine thread. Checks that need the model (vocabulary,
`max_model_len`, chat template) are in `check_prompt` / `sampling_options`, called by the server.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from serving.sequence import NUM_TOP, SamplingOptions

MAX_N = 16  # samples per prompt
MAX_PROMPTS = 64  # prompts per completions request
MAX_STOP = 16  # stop strings per request

Int = StrictInt
Num = Annotated[float, Field(strict=False)]


class RequestError(Exception):
    """A client error: HTTP `status`, a message that says what to fix, and the offending field."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
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
    """Fields shared by /v1/completions and /v1/chat/completions (unknown fields are ignored)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr
    max_tokens: Int | None = Field(None, ge=1)
    temperature: Num | None = Field(None, ge=0, le=2)
    top_p: Num | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1)
    n: Int = Field(1, ge=1, le=MAX_N)
    seed: Int | None = Field(None, ge=-(2**63), lt=2**64)
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[Int] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Num = 0.0
    frequency_penalty: Num = 0.0
    logit_bias: dict[str, Num] | None = None
    user: StrictStr | None = None

    def unsupported(self) -> None:
        """Reject features jdet does not implement rather than silently ignoring them."""
        if self.presence_penalty != 0:
            raise RequestError(
                "presence_penalty is not supported; omit it or send 0", "presence_penalty"
            )
        if self.frequency_penalty != 0:
            raise RequestError(
                "frequency_penalty is not supported; omit it or send 0", "frequency_penalty"
            )
        if self.logit_bias:
            raise RequestError("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise RequestError(f"at most {MAX_STOP} stop strings are allowed", "stop")
        if any(s == "" for s in stops):
            raise RequestError("stop strings must be non-empty", "stop")

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


class CompletionRequest(_Common):
    prompt: StrictStr | list[StrictStr] | list[Int] | list[list[Int]]
    logprobs: Int | None = Field(None, ge=0, le=NUM_TOP)
    echo: StrictBool = False
    best_of: Int | None = None
    suffix: StrictStr | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.echo:
            raise RequestError("echo is not supported", "echo")
        if self.best_of is not None and self.best_of != self.n:
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


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: StrictBool = False
    top_logprobs: Int | None = Field(None, ge=0, le=NUM_TOP)
    max_completion_tokens: Int | None = Field(None, ge=1)
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> None:
        super().unsupported()
        if self.tools:
            raise RequestError("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise RequestError(
                "only response_format {'type': 'text'} is supported", "response_format"
            )
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs=true", "top_logprobs")


def parse(raw: bytes, schema: type[_Common]) -> Any:
    """JSON bytes -> validated request, or RequestError naming the first bad field."""
    try:
        obj = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise RequestError(f"request body is not valid JSON: {e}", None) from None
    if not isinstance(obj, dict):
        raise RequestError("request body must be a JSON object", None)
    try:
        req = schema.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = [str(x) for x in err["loc"] if not str(x).startswith(("function-", "list["))]
        # unions report one branch per error; keep the path to the field itself
        field = ".".join(x for x in loc if x not in ("str", "int", "float", "bool")) or None
        raise RequestError(f"{field}: {err['msg']}", field) from None
    req.unsupported()
    return req


def check_prompt(ids: list[int], *, vocab_size: int, max_model_len: int, param: str) -> None:
    if not ids:
        raise RequestError("prompt is empty", param)
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside the vocabulary [0, {vocab_size})", param)
    if len(ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(ids)} tokens but max_model_len is {max_model_len}; shorten it",
            param,
        )


def sampling_options(
    req: _Common,
    *,
    prompt_len: int,
    max_model_len: int,
    logprobs: int | None,
    max_tokens: int | None,
) -> SamplingOptions:
    """Engine sampling options for one prompt of a validated request."""
    room = max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        field = (
            "max_completion_tokens"
            if getattr(req, "max_completion_tokens", None)
            else ("max_tokens")
        )
        raise RequestError(
            f"{field}={max_tokens} plus the prompt's {prompt_len} tokens exceeds "
            f"max_model_len={max_model_len}; ask for at most {room}",
            field,
        )
    return SamplingOptions(
        temperature=1.0 if req.temperature is None else float(req.temperature),
        top_p=1.0 if req.top_p is None else float(req.top_p),
        top_k=0 if req.top_k is None or req.top_k < 0 else req.top_k,
        seed=req.seed,
        max_tokens=max_tokens if max_tokens is not None else room,
        n=req.n,
        stop=req.stops(),
        stop_token_ids=tuple(req.stop_token_ids or ()),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
    )
