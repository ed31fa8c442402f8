"""OpenAI-compatible HTTP server: the FastAPI app (`build_app`) around one engine.

Where the parts live: serving/driver.py runs the engine on its own thread (why one thread, and
what a failed step does); serving/responses.py holds the streaming and collecting loop both
endpoints share (each endpoint writes only its choice format); serving/auth.py the API key;
serving/launch.py `serve` (load, engine, uvicorn); jdet/settings.py the settings.

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

from serving.auth import ApiKeyMiddleware
from serving.driver import ServerState
from serving.engine import Engine
from serving.outputs import RequestUpdate
from serving.protocol import ChatCompletionRequest, CompletionRequest, RequestError, clip
from serving.request_parsing import check_prompt, parse, sampling_options
from serving.responses import (
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
from serving.sampling_options import SamplingOptions

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
    eng = engine

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

    if api_key:
        open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)

    async def read_body(request: Request) -> bytes:
        """The request body, refused with 413 as soon as it exceeds `max_body_bytes` (before it
        is all read, so a 10 GB upload costs the server nothing)."""
        too_big = RequestError(f"request body exceeds {max_body_bytes} bytes; send a shorter "
                               "request", None, 413, "request_too_large")  # fmt: skip
        declared = request.headers.get("content-length")
        if declared is not None:
            if not declared.isdigit():
                raise RequestError("Content-Length header is not a number", None)
            if int(declared) > max_body_bytes:
                raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise too_big
            chunks.append(chunk)
        return b"".join(chunks)

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
            eng.metrics.render().decode(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> dict:
        card = {"id": st.model_name, "object": "model", "created": st.created, "owned_by": "jdet",
                "max_model_len": eng.max_model_len}  # fmt: skip
        return {"object": "list", "data": [card]}

    def check_model(name: str) -> None:
        if name != st.model_name:
            raise RequestError(f"model {clip(name)} does not exist; this server serves "
                               f"{st.model_name!r}", "model", 404, "model_not_found")  # fmt: skip

    async def encode(text: str, add_special: bool = True, param: str = "prompt") -> list[int]:
        """Tokenise in a worker thread: a long prompt must not stall every other stream."""
        if st.tokenizer is None:
            raise RequestError("this model has no tokenizer; send prompts as token ids", param)

        def run_tokenizer() -> list[int]:
            return list(st.tokenizer(text, add_special_tokens=add_special)["input_ids"])

        try:
            return await asyncio.to_thread(run_tokenizer)
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is the client's
            raise RequestError(
                f"{param} could not be tokenised ({type(e).__name__}: {clip(str(e), 200)})", param
            ) from None

    async def check_transforms(opts: SamplingOptions) -> None:
        """Compile the structured-output constraint (and tokenise bad_words) in a worker thread,
        so a bad schema is this request's 400 and a large one never stalls the event loop."""
        try:
            await asyncio.to_thread(eng.runner.logits_rows.check, opts)
        except ValueError as e:
            raise RequestError(str(e), getattr(e, "field", None)) from None

    def check_stop_ids(req: Any) -> None:
        if req.stop and st.tokenizer is None:
            raise RequestError("stop strings need a tokenizer", "stop")

    async def run(
        prompts: list[list[int]], opts: list[SamplingOptions], prefix: str, kind: str
    ) -> tuple[list[str], asyncio.Queue, dict]:
        """Submit the requests of one response: their ids, their output queue, and the head
        fields every chunk or response of it carries."""
        cid = f"{prefix}-{uuid.uuid4().hex}"
        head = {"id": cid, "object": kind, "created": int(time.time()), "model": st.model_name,
                "system_fingerprint": st.fingerprint}  # fmt: skip
        q: asyncio.Queue = asyncio.Queue()
        rids = [f"{cid}-{i}" for i in range(len(prompts))]
        for rid, ids, o in zip(rids, prompts, opts, strict=True):
            st.driver.submit(rid, ids, o, q)
        return rids, q, head

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = await read_body(request)
        req: CompletionRequest = await asyncio.to_thread(parse, body, CompletionRequest)
        check_model(req.model)
        check_stop_ids(req)
        prompts = []
        for p in req.prompts():
            ids = await encode(p) if isinstance(p, str) else list(p)
            check_prompt(
                ids, vocab_size=eng.cfg.vocab_size, max_model_len=eng.max_model_len, param="prompt"
            )
            prompts.append(ids)
        opts = [
            sampling_options(
                req,
                prompt_len=len(ids),
                max_model_len=eng.max_model_len,
                logprobs=req.logprobs,
                max_tokens=req.max_tokens,
                vocab_size=eng.cfg.vocab_size,
            )
            for ids in prompts
        ]
        await check_transforms(opts[0])
        echoes = [  # echo=true: each choice's text starts with its prompt
            ("" if not req.echo else p if isinstance(p, str) else decode_text(st.tokenizer, p))
            for p in req.prompts()
        ]
        rids, q, head = await run(prompts, opts, "cmpl", "text_completion")
        index = {rid: i for i, rid in enumerate(rids)}
        n = req.n
        want_lp = req.logprobs is not None
        tok = st.tokenizer

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

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
                    lp = completion_logprobs(
                        tok, c, c.delta_start, len(c.token_ids), offsets.get(key, 0)
                    )
                offsets[key] = offsets.get(key, 0) + len(c.delta_text)
                return {
                    "index": index[o.request_id] * n + c.index,
                    "text": c.delta_text,
                    "logprobs": lp,
                    "finish_reason": stream_finish(c),
                }

            events = sse_stream(
                guarded(results(st.driver, rids, q)), head, first, choice,
                include_usage=include_usage, usage=lambda finals: usage(prompts, finals),
            )  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream")

        finals = await collect(results(st.driver, rids, q, request))

        def build() -> list[dict]:  # detokenises every log-prob token: off the event loop
            choices = []
            for rid in rids:
                for c in finals[rid].outputs:
                    lp = completion_logprobs(tok, c, 0, len(c.token_ids), 0) if want_lp else None
                    choices.append(
                        {
                            "index": index[rid] * n + c.index,
                            "text": echoes[index[rid]] + c.text,
                            "logprobs": lp,
                            "finish_reason": c.finish_reason,
                            "seed": c.seed,
                        }
                    )
            return choices

        choices = await asyncio.to_thread(build)
        return {**head, "choices": choices, "usage": usage(prompts, finals)}

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        body = await read_body(request)
        req: ChatCompletionRequest = await asyncio.to_thread(parse, body, ChatCompletionRequest)
        check_model(req.model)
        check_stop_ids(req)
        tok = st.tokenizer
        template = chat_template or getattr(tok, "chat_template", None)
        if tok is None or not template:
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions instead (or "
                "start the server with --chat-template)",
                "messages",
            )
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = await asyncio.to_thread(
                tok.apply_chat_template, msgs, tokenize=False, add_generation_prompt=True,
                chat_template=template,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation
            raise RequestError(
                f"the chat template rejected these messages: {clip(str(e), 200)}", "messages"
            ) from None
        ids = await encode(text, add_special=False, param="messages")
        check_prompt(
            ids, vocab_size=eng.cfg.vocab_size, max_model_len=eng.max_model_len, param="messages"
        )
        max_tokens = req.max_completion_tokens or req.max_tokens
        k = (req.top_logprobs or 0) if req.logprobs else None
        opts = sampling_options(
            req,
            prompt_len=len(ids),
            max_model_len=eng.max_model_len,
            logprobs=k,
            max_tokens=max_tokens,
            vocab_size=eng.cfg.vocab_size,
        )
        await check_transforms(opts)
        rids, q, head = await run([ids], [opts], "chatcmpl", "chat.completion")

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chead = {**head, "object": "chat.completion.chunk"}

            extra = {"usage": None} if include_usage else {}
            role = {"role": "assistant", "content": ""}
            first = [
                {**chead, "choices": [{"index": i, "delta": role, "logprobs": None,
                                       "finish_reason": None}], **extra}  # fmt: skip
                for i in range(req.n)
            ]

            def choice(o: RequestUpdate, c: Any) -> dict:
                lp = None
                if req.logprobs:
                    lp = chat_logprobs(tok, c, c.delta_start, len(c.token_ids))
                return {
                    "index": c.index,
                    "delta": {"content": c.delta_text} if c.delta_text else {},
                    "logprobs": lp,
                    "finish_reason": stream_finish(c),
                }

            events = sse_stream(
                guarded(results(st.driver, rids, q)), chead, first, choice,
                include_usage=include_usage, usage=lambda finals: usage([ids], finals),
            )  # fmt: skip
            return StreamingResponse(events, media_type="text/event-stream")

        finals = await collect(results(st.driver, rids, q, request))

        def build() -> list[dict]:  # detokenises every log-prob token: off the event loop
            choices = []
            for c in finals[rids[0]].outputs:
                lp = chat_logprobs(tok, c, 0, len(c.token_ids)) if req.logprobs else None
                choices.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", "content": c.text},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "seed": c.seed,
                    }
                )
            return choices

        choices = await asyncio.to_thread(build)
        return {**head, "choices": choices, "usage": usage([ids], finals)}

    return app
