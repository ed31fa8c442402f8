"""OpenAI-compatible HTTP server: the FastAPI app (`build_app`) around one engine.

Where the parts live: serving/http/driver.py runs the engine on its own thread (why one thread, and
what a failed step does); serving/http/responses.py holds the streaming and collecting loop both
endpoints share (each endpoint writes only its choice format); serving/http/auth.py the API key;
serving/http/launch.py `serve` (load, engine, uvicorn); jdet/settings.py the settings.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with `stream=true`, ending in
`data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus text). Binds 127.0.0.1 by default.

Hardening (no request can hurt another): the body is capped (`max_body_bytes`, default 4 MB,
413 beyond), JSON nesting and lone surrogates are refused in request_parsing.parse, parsing,
tokenisation and the chat template run in worker threads so a large prompt never blocks the event
loop, and with an API key (`--api-key` or `JDET_API_KEY`) every path except /health needs it
(/metrics too, unless `--public-metrics`). A request the engine fails alone gets a 500 of its own;
an engine failure nobody explains ends the running requests with 500s, the engine resets itself,
and if its page accounting is not clean afterwards the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine.engine import Engine
from serving.engine.outputs import RequestUpdate
from serving.http.auth import ApiKeyMiddleware
from serving.http.driver import ServerState
from serving.http.protocol import ChatCompletionRequest, CompletionRequest, RequestError, clip
from serving.http.request_parsing import parse, request_error, sampling_options
from serving.http.responses import (
    ClientGone,
    chat_logprobs,
    collect,
    completion_logprobs,
    decode_text,
    guarded,
    results,
    sse_stream,
    stream_finish,
    usage,
)
from serving.sampling_options import InvalidRequest, SamplingOptions

log = logging.getLogger("jdet.server")

MAX_BODY_BYTES = 4 << 20  # default request body limit (--max-body-bytes)


# ---------------------------------------------------------------------- the app
def build_app(
    engine: Engine,
    *,
    model_name: str,
    fingerprint: str,
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    public_metrics: bool = False,
    warmup: bool = True,
    chat_template: str | None = None,
) -> Any:
    """The FastAPI app. With `warmup` the engine thread compiles every step shape first, and
    /health answers 503 "warming up" until it is done. `chat_template` (Jinja text) replaces the
    tokenizer's chat template."""
    st = ServerState(engine, model_name, fingerprint, warmup)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        st.driver.stop()

    app = FastAPI(title="jdet", version="1", lifespan=lifespan)
    app.state.jdet = st
    add_error_handlers(app)
    if api_key:
        open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    add_info_routes(app, st)
    gen = Generation(st, max_body_bytes, chat_template)
    app.post("/v1/completions")(gen.completions)
    app.post("/v1/chat/completions")(gen.chat)
    return app


def add_error_handlers(app: FastAPI) -> None:
    """Every error in the OpenAI error format; a client gone is a 499 nobody reads."""

    @app.exception_handler(RequestError)
    async def _request_error(_: Request, e: RequestError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> PlainTextResponse:
        return PlainTextResponse("client closed request", status_code=499)  # nobody reads it

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # 404 unknown path, 405 wrong method, ... in the OpenAI error format
        what = f"{request.method} {clip(request.url.path, 100)}"
        err = RequestError(f"{e.detail}: {what}", None, e.status_code)
        return JSONResponse(err.body(), status_code=e.status_code, headers=e.headers)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        err = RequestError(f"internal error: {type(e).__name__}", None, 500)
        return JSONResponse(err.body(), status_code=500)


def add_info_routes(app: FastAPI, st: ServerState) -> None:
    """/health, /metrics and /v1/models."""

    @app.get("/health")
    async def health() -> JSONResponse:
        alive = st.driver.thread.is_alive()
        if alive and not st.driver.ready.is_set():
            return JSONResponse({"status": "warming up"}, status_code=503)
        ok = alive and st.driver.ready.is_set()
        # the fingerprint lets a router check that its replicas give the same bits
        body = {"status": "ok" if ok else "engine thread died"}
        body["system_fingerprint"] = st.fingerprint
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            st.engine.metrics.render().decode(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "jdet",
                "max_model_len": st.engine.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}


class Generation:
    """/v1/completions and /v1/chat/completions: read and check a request (parsing,
    tokenisation and the chat template in worker threads, so a large prompt never blocks the
    event loop), submit it to the engine thread, then stream or collect its outputs."""

    def __init__(self, st: ServerState, max_body_bytes: int, chat_template: str | None) -> None:
        self.st, self.eng, self.tok = st, st.engine, st.tokenizer
        self.max_body_bytes = max_body_bytes
        self.chat_template = chat_template

    # ------------------------------------------------------------------ shared steps
    async def read(self, request: Request, schema: type) -> Any:
        """The request body, parsed and checked against `schema`; the model it names, and that
        stop strings have a tokenizer."""
        req = await asyncio.to_thread(parse, await self.read_body(request), schema)
        if req.model != self.st.model_name:
            raise RequestError(
                f"model {clip(req.model)} does not exist; this server serves "
                f"{self.st.model_name!r}", "model", 404, "model_not_found",
            )  # fmt: skip
        if req.stop and self.tok is None:
            raise RequestError("stop strings need a tokenizer", "stop")
        return req

    async def read_body(self, request: Request) -> bytes:
        """The request body, refused with 413 as soon as it exceeds `max_body_bytes` (before it
        is all read, so a 10 GB upload costs the server nothing)."""
        limit = self.max_body_bytes
        too_big = RequestError(f"request body exceeds {limit} bytes; send a shorter "
                               "request", None, 413, "request_too_large")  # fmt: skip
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError("Content-Length header is not a number", None)
            if int(declared) > limit:
                raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

    async def encode(self, text: str, add_special: bool = True, param: str = "prompt") -> list[int]:
        """Tokenise in a worker thread: a long prompt must not stall every other stream."""
        tok = self.tok
        if tok is None:
            raise RequestError("this model has no tokenizer; send prompts as token ids", param)

        def run_tokenizer() -> list[int]:
            return list(tok(text, add_special_tokens=add_special)["input_ids"])

        try:
            return await asyncio.to_thread(run_tokenizer)
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's
            raise RequestError(
                f"{param} could not be tokenised ({type(e).__name__}: {clip(str(e), 200)})", param
            ) from None

    def check_prompt(self, ids: list[int], param: str) -> None:
        """Token ids in the vocabulary, shorter than max_model_len (the engine's admission)."""
        try:
            self.eng.admission.check_prompt(ids, param)
        except InvalidRequest as e:
            raise RequestError(str(e), param) from None

    def options(self, req: Any, ids: list[int]) -> SamplingOptions:
        """The engine's options for one prompt (checked by `check_options`)."""
        return sampling_options(req, prompt_len=len(ids), max_model_len=self.eng.max_model_len)

    async def check_options(self, req: Any, opts: list[SamplingOptions]) -> None:
        """The engine's admission check of each distinct options (the one check of a request's
        values, serving/engine/admission.py), in a worker thread: a structured-output grammar
        compiles there, so a bad schema is this request's 400 and a large one never stalls the
        event loop. The engine then takes the request as checked."""
        distinct = list(dict.fromkeys(opts))

        def run() -> None:
            for o in distinct:
                self.eng.admission.check_options(o)

        try:
            await asyncio.to_thread(run)
        except ValueError as e:  # InvalidRequest, naming the field
            raise request_error(req, e) from None

    def submit(
        self, prompts: list[list[int]], opts: list[SamplingOptions], prefix: str, kind: str
    ) -> tuple[list[str], asyncio.Queue, dict]:
        """Submit the requests of one response: their ids, their output queue, and the head
        fields every chunk or response of it carries."""
        st = self.st
        cid = f"{prefix}-{uuid.uuid4().hex}"
        head = {"id": cid, "object": kind, "created": int(time.time()), "model": st.model_name,
                "system_fingerprint": st.fingerprint}  # fmt: skip
        q: asyncio.Queue = asyncio.Queue()
        rids = [f"{cid}-{i}" for i in range(len(prompts))]
        for rid, ids, o in zip(rids, prompts, opts, strict=True):
            st.driver.submit(rid, ids, o, q)
        return rids, q, head

    # ------------------------------------------------------------------ completions
    async def completions(self, request: Request) -> Any:
        req: CompletionRequest = await self.read(request, CompletionRequest)
        prompts = []
        for p in req.prompts():
            ids = await self.encode(p) if isinstance(p, str) else list(p)
            self.check_prompt(ids, "prompt")
            prompts.append(ids)
        opts = [self.options(req, ids) for ids in prompts]
        await self.check_options(req, opts)
        echoes = [  # echo=true: each choice's text starts with its prompt
            ("" if not req.echo else p if isinstance(p, str) else decode_text(self.tok, p))
            for p in req.prompts()
        ]
        rids, q, head = self.submit(prompts, opts, "cmpl", "text_completion")
        if req.stream:
            return self.stream_completions(req, opts[0].n, prompts, echoes, rids, q, head)
        finals = await collect(results(self.st.driver, rids, q, request))
        index = {rid: i for i, rid in enumerate(rids)}
        n, want_lp, tok = opts[0].n, req.logprobs is not None, self.tok

        def build() -> list[dict]:  # detokenises every log-prob token: off the event loop
            choices = []
            for rid in rids:
                for c in finals[rid].outputs:
                    lp = completion_logprobs(tok, c, 0, len(c.token_ids), 0) if want_lp else None
                    choices.append({"index": index[rid] * n + c.index,
                                    "text": echoes[index[rid]] + c.text, "logprobs": lp,
                                    "finish_reason": c.finish_reason, "seed": c.seed})  # fmt: skip
            return choices

        choices = await asyncio.to_thread(build)
        return {**head, "choices": choices, "usage": usage(prompts, finals)}

    def stream_completions(self, req: CompletionRequest, n: int, prompts: list[list[int]],
                           echoes: list[str], rids: list[str], q: asyncio.Queue,
                           head: dict) -> StreamingResponse:  # fmt: skip
        index = {rid: i for i, rid in enumerate(rids)}
        want_lp, tok = req.logprobs is not None, self.tok
        offsets: dict[tuple[str, int], int] = {}  # text already streamed per choice
        first = [  # echo: the prompt comes first
            {**head, "choices": [{"index": i * n + j, "text": text, "logprobs": None,
                                  "finish_reason": None}]}  # fmt: skip
            for i, text in enumerate(echoes)
            for j in (range(n) if text else ())
        ]

        def choice(o: RequestUpdate, c: Any) -> dict:
            key = (o.request_id, c.index)
            lp = None
            if want_lp:
                lp = completion_logprobs(tok, c, c.delta_start, len(c.token_ids),
                                         offsets.get(key, 0))  # fmt: skip
            offsets[key] = offsets.get(key, 0) + len(c.delta_text)
            return {"index": index[o.request_id] * n + c.index, "text": c.delta_text,
                    "logprobs": lp, "finish_reason": stream_finish(c)}  # fmt: skip

        events = sse_stream(
            guarded(results(self.st.driver, rids, q)), head, first, choice,
            include_usage=include_usage(req), usage=lambda finals: usage(prompts, finals),
        )  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream")

    # ------------------------------------------------------------------ chat
    async def chat(self, request: Request) -> Any:
        req: ChatCompletionRequest = await self.read(request, ChatCompletionRequest)
        ids = await self.encode(await self.apply_template(req), add_special=False,
                                param="messages")  # fmt: skip
        self.check_prompt(ids, "messages")
        opts = self.options(req, ids)
        await self.check_options(req, [opts])
        rids, q, head = self.submit([ids], [opts], "chatcmpl", "chat.completion")
        if req.stream:
            return self.stream_chat(req, opts.n, ids, rids, q, head)
        finals = await collect(results(self.st.driver, rids, q, request))
        tok = self.tok

        def build() -> list[dict]:  # detokenises every log-prob token: off the event loop
            choices = []
            for c in finals[rids[0]].outputs:
                lp = chat_logprobs(tok, c, 0, len(c.token_ids)) if req.logprobs else None
                choices.append({"index": c.index,
                                "message": {"role": "assistant", "content": c.text},
                                "logprobs": lp, "finish_reason": c.finish_reason,
                                "seed": c.seed})  # fmt: skip
            return choices

        choices = await asyncio.to_thread(build)
        return {**head, "choices": choices, "usage": usage([ids], finals)}

    async def apply_template(self, req: ChatCompletionRequest) -> str:
        """The conversation as the prompt text, through the chat template (a worker thread)."""
        tok = self.tok
        template = self.chat_template or getattr(tok, "chat_template", None)
        if tok is None or not template:
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions instead (or "
                "start the server with --chat-template)",
                "messages",
            )
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            return await asyncio.to_thread(
                tok.apply_chat_template, msgs, tokenize=False, add_generation_prompt=True,
                chat_template=template,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation
            raise RequestError(
                f"the chat template rejected these messages: {clip(str(e), 200)}", "messages"
            ) from None

    def stream_chat(self, req: ChatCompletionRequest, n: int, ids: list[int], rids: list[str],
                    q: asyncio.Queue, head: dict) -> StreamingResponse:  # fmt: skip
        tok, with_usage = self.tok, include_usage(req)
        chead = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if with_usage else {}
        role = {"role": "assistant", "content": ""}
        first = [
            {**chead, "choices": [{"index": i, "delta": role, "logprobs": None,
                                   "finish_reason": None}], **extra}  # fmt: skip
            for i in range(n)
        ]

        def choice(o: RequestUpdate, c: Any) -> dict:
            lp = chat_logprobs(tok, c, c.delta_start, len(c.token_ids)) if req.logprobs else None
            return {"index": c.index,
                    "delta": {"content": c.delta_text} if c.delta_text else {},
                    "logprobs": lp, "finish_reason": stream_finish(c)}  # fmt: skip

        events = sse_stream(
            guarded(results(self.st.driver, rids, q)), chead, first, choice,
            include_usage=with_usage, usage=lambda finals: usage([ids], finals),
        )  # fmt: skip
        return StreamingResponse(events, media_type="text/event-stream")


def include_usage(req: Any) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)
