"""OpenAI-compatible HTTP server: FastAPI + uvicorn around one engine driven by one thread.

Why one engine thread: the engine is single-threaded by design (scheduler, pages, device step);
HTTP handlers on the asyncio loop validate and tokenise, then hand requests over a queue; the
engine thread steps continuously and posts each output back to the request's asyncio queue with
`call_soon_threadsafe`. A handler that goes away (client disconnect, cancellation) sends an abort,
which releases the request's pages on the engine thread before its next step.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with `stream=true`, ending in
`data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus text). Binds 127.0.0.1 by default.

Hardening (no request can hurt another): the body is capped (`max_body_bytes`, default 4 MB,
413 beyond), JSON nesting and lone surrogates are refused in protocol.parse, parsing,
tokenisation and the chat template run in worker threads so a large prompt never blocks the event
loop, and with an API key (`--api-key` or `JDET_API_KEY`) every path except /health needs it
(/metrics too, unless `--public-metrics`). A request the engine fails alone gets a 500 of its own;
an engine failure nobody explains ends the running requests with 500s, the engine resets itself,
and if its page accounting is not clean afterwards the process exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.engine import CompletionOutput, Engine, EngineBroken, EngineStepError, RequestOutput
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_prompt,
    clip,
    parse,
    sampling_options,
)
from serving.sequence import SamplingOptions

log = logging.getLogger("jdet.server")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler asks whether its client is still there
MAX_BODY_BYTES = 4 << 20  # default request body limit (--max-body-bytes)
EXIT_ENGINE_BROKEN = 70  # process exit status when the engine cannot be trusted after a failure


class ClientGone(Exception):
    """The client of a non-streaming request disconnected; its requests were aborted."""


class EngineDriver:
    """Runs `engine.step()` on a background thread; thread-safe submit/abort from asyncio."""

    def __init__(self, engine: Engine, warmup: bool = True) -> None:
        self.engine = engine
        self.warmup = warmup
        self.ready = threading.Event()  # set once every step shape is compiled (/health: 200)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.wakeup = threading.Event()
        self.routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.stopping = False
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="jdet-engine", daemon=True)
        self.thread.start()

    def submit(self, rid: str, ids: list[int], opts: SamplingOptions, q: asyncio.Queue) -> None:
        self.routes[rid] = (asyncio.get_running_loop(), q)
        self.commands.put(("add", rid, ids, opts))
        self.wakeup.set()

    def abort(self, rid: str) -> None:
        self.commands.put(("abort", rid, None, None))
        self.wakeup.set()

    def stop(self) -> None:
        self.stopping = True
        self.wakeup.set()
        self.thread.join(timeout=10)

    def _post(self, rid: str, item: Any) -> None:
        route = self.routes.get(rid)
        if route is not None:
            loop, q = route
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _warm_up(self) -> None:
        """Compile every step shape before the first step (requests that arrive meanwhile wait in
        the queue), so no request in flight ever stalls on a compile."""
        eng = self.engine
        if self.warmup:
            n = len(eng.runner.shapes.all())
            log.info("warming up: compiling %d step shapes", n)
            dt = eng.warmup("step", progress=True, should_stop=lambda: self.stopping)
            eng.metrics.warmup_seconds.set(dt)
            log.info("warm: %d step shapes in %.1f s", n, dt)
        eng.metrics.warm.set(1)
        self.ready.set()

    def _run(self) -> None:
        eng = self.engine
        try:
            self._warm_up()
        except Exception as e:  # noqa: BLE001 - /health reports it; the process stays inspectable
            log.exception("warm-up failed")
            self.error = e
            return
        while not self.stopping:
            while True:
                try:
                    kind, rid, ids, opts = self.commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    try:
                        eng.add_request(rid, ids, opts)
                    except Exception as e:  # noqa: BLE001 - validated before; a last line of defence
                        if isinstance(e, ValueError):
                            err = RequestError(str(e), getattr(e, "field", None))
                        else:  # a bug, but this request's alone: the engine thread lives on
                            log.exception("add_request failed for %s", rid)
                            err = RequestError(f"internal error: {type(e).__name__}", status=500)
                        self._post(rid, err)
                        self.routes.pop(rid, None)
                else:
                    eng.abort(rid)
                    self.routes.pop(rid, None)
                    eng.refresh_gauges()
            if not eng.has_unfinished():
                self.wakeup.wait(0.1)
                self.wakeup.clear()
                continue
            live = list(eng.requests)
            try:
                outs = eng.step()
            except EngineBroken:
                log.critical("engine state is inconsistent after a failed step; exiting")
                logging.shutdown()
                os._exit(EXIT_ENGINE_BROKEN)
            except Exception as e:  # noqa: BLE001 - the engine already reset itself
                if not isinstance(e, EngineStepError):  # step() wraps what it can recover from
                    log.exception("engine step failed")
                self.error = e
                for rid in live:
                    eng.abort(rid)  # no-op after a recovery; covers anything else
                    self._post(rid, RequestError(f"engine error: {clip(str(e), 300)}", status=500))
                    self.routes.pop(rid, None)
                continue
            for o in outs:
                if o.error is not None:  # this request alone failed; the others go on
                    err = RequestError(f"request failed in the engine: {o.error}", status=500)
                    self._post(o.request_id, err)
                else:
                    self._post(o.request_id, o)
                if o.finished:
                    self.routes.pop(o.request_id, None)


# ---------------------------------------------------------------------- response pieces
def _decode(tok: Any, ids: list[int]) -> str:
    return "" if tok is None else tok.decode(ids)


def _token_str(tok: Any, token_id: int) -> str:
    return "" if tok is None else tok.decode([token_id])


def _completion_logprobs(
    tok: Any, c: CompletionOutput, start: int, end: int, text_offset: int
) -> dict:
    ids = c.token_ids[start:end]
    strs = [_token_str(tok, t) for t in ids]
    offsets, o = [], text_offset
    for s in strs:
        offsets.append(o)
        o += len(s)
    top = None
    if c.top_logprobs is not None:
        top = [{_token_str(tok, i): lp for i, lp in row} for row in c.top_logprobs[start:end]]
    return {
        "tokens": strs,
        "token_logprobs": c.logprobs[start:end],
        "top_logprobs": top,
        "text_offset": offsets,
    }


def _chat_logprobs(tok: Any, c: CompletionOutput, start: int, end: int) -> dict:
    content = []
    for k in range(start, end):
        s = _token_str(tok, c.token_ids[k])
        tops = []
        if c.top_logprobs is not None:
            for i, lp in c.top_logprobs[k]:
                ts = _token_str(tok, i)
                tops.append({"token": ts, "logprob": lp, "bytes": list(ts.encode())})
        content.append(
            {"token": s, "logprob": c.logprobs[k], "bytes": list(s.encode()), "top_logprobs": tops}
        )
    return {"content": content}


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


# ---------------------------------------------------------------------- the app
class ApiKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but /health (and /metrics when `open_paths`
    has it): /docs, /redoc and /openapi.json too. A plain ASGI middleware: Starlette's
    `@app.middleware("http")` wraps `receive` so that `request.is_disconnected()` never sees the
    client go away, which the non-streaming handlers rely on to abort abandoned requests."""

    def __init__(self, app: Any, api_key: str, open_paths: tuple[str, ...] = ("/health",)) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.open_paths = open_paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                err = RequestError(
                    "missing or wrong API key (Authorization: Bearer ...)",
                    None,
                    401,
                    "invalid_api_key",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class ServerState:
    def __init__(
        self, engine: Engine, model_name: str, fingerprint: str, warmup: bool = True
    ) -> None:
        self.engine = engine
        self.driver = EngineDriver(engine, warmup)
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self.ids = itertools.count()


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
        too_big = RequestError(
            f"request body exceeds {max_body_bytes} bytes; send a shorter request",
            None,
            413,
            "request_too_large",
        )
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
        return JSONResponse(
            {"status": "ok" if ok else "engine thread died"}, status_code=200 if ok else 503
        )

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            eng.metrics.render().decode(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": st.model_name,
                    "object": "model",
                    "created": st.created,
                    "owned_by": "jdet",
                    "max_model_len": eng.max_model_len,
                }
            ],
        }

    def check_model(name: str) -> None:
        if name != st.model_name:
            raise RequestError(
                f"model {clip(name)} does not exist; this server serves {st.model_name!r}",
                "model",
                404,
                "model_not_found",
            )

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
        prompts: list[list[int]], opts: list[SamplingOptions], base: str
    ) -> tuple[list[str], asyncio.Queue]:
        q: asyncio.Queue = asyncio.Queue()
        rids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid, ids, o in zip(rids, prompts, opts, strict=True):
            st.driver.submit(rid, ids, o, q)
        return rids, q

    async def results(
        rids: list[str], q: asyncio.Queue, request: Request | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Outputs of these engine requests until all finish; aborts the rest if cancelled.

        With `request` (non-streaming responses, which Starlette does not cancel when the client
        goes away) the client is polled every DISCONNECT_POLL_S; a gone client ends the iteration
        and its requests are aborted, so nobody computes tokens for a closed socket.
        """
        live = set(rids)
        last_poll = time.monotonic()
        try:
            while live:
                if request is not None and time.monotonic() - last_poll >= DISCONNECT_POLL_S:
                    last_poll = time.monotonic()
                    if await request.is_disconnected():
                        log.info("client went away; aborting %d request(s)", len(live))
                        raise ClientGone
                try:
                    timeout = None if request is None else DISCONNECT_POLL_S
                    item = await asyncio.wait_for(q.get(), timeout)
                except TimeoutError:
                    continue  # nothing yet: time to look at the client again
                if isinstance(item, RequestError):
                    raise item
                if item.finished:
                    live.discard(item.request_id)
                yield item
        finally:
            for rid in live:
                st.driver.abort(rid)

    async def guarded(it: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput | str]:
        """A stream's outputs; an error after the 200 went out becomes one SSE error event and
        `data: [DONE]` (the connection ends cleanly instead of breaking mid-stream)."""
        try:
            async for o in it:
                yield o
        except RequestError as e:
            yield _sse(e.body()) + "data: [DONE]\n\n"

    def usage(prompts: list[list[int]], finals: dict[str, RequestOutput]) -> dict:
        p = sum(len(x) for x in prompts)
        c = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

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
            ("" if not req.echo else p if isinstance(p, str) else _decode(st.tokenizer, p))
            for p in req.prompts()
        ]
        cid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        rids, q = await run(prompts, opts, cid)
        index = {rid: i for i, rid in enumerate(rids)}
        head = {
            "id": cid,
            "object": "text_completion",
            "created": created,
            "model": st.model_name,
            "system_fingerprint": st.fingerprint,
        }
        n = req.n
        want_lp = req.logprobs is not None
        tok = st.tokenizer

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream() -> AsyncIterator[str]:
                finals: dict[str, RequestOutput] = {}
                offsets: dict[tuple[str, int], int] = {}
                done: set[tuple[str, int]] = set()
                for i, text in enumerate(echoes):  # echo: the prompt comes first
                    for j in range(n) if text else ():
                        choice = {"index": i * n + j, "text": text, "logprobs": None,
                                  "finish_reason": None}  # fmt: skip
                        yield _sse({**head, "choices": [choice]})
                async for o in guarded(results(rids, q)):
                    if isinstance(o, str):  # the error event: the stream ends here
                        yield o
                        return
                    for c in o.outputs:
                        key = (o.request_id, c.index)
                        ends = c.finish_reason is not None and key not in done
                        if not c.delta_text and not c.delta_token_ids and not ends:
                            continue
                        if ends:
                            done.add(key)
                        lp = None
                        if want_lp:
                            lp = _completion_logprobs(
                                tok, c, c.delta_start, len(c.token_ids), offsets.get(key, 0)
                            )
                        offsets[key] = offsets.get(key, 0) + len(c.delta_text)
                        fin = c.finish_reason if c.finish_reason != "abort" else None
                        choice = {
                            "index": index[o.request_id] * n + c.index,
                            "text": c.delta_text,
                            "logprobs": lp,
                            "finish_reason": fin,
                        }
                        chunk = {**head, "choices": [choice]}
                        if include_usage:
                            chunk["usage"] = None
                        yield _sse(chunk)
                    if o.finished:
                        finals[o.request_id] = o
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": usage(prompts, finals)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        finals = {}
        async for o in results(rids, q, request):
            if o.finished:
                finals[o.request_id] = o

        def build() -> list[dict]:  # detokenises every log-prob token: off the event loop
            choices = []
            for rid in rids:
                for c in finals[rid].outputs:
                    lp = _completion_logprobs(tok, c, 0, len(c.token_ids), 0) if want_lp else None
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
        cid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        rids, q = await run([ids], [opts], cid)
        head = {
            "id": cid,
            "object": "chat.completion",
            "created": created,
            "model": st.model_name,
            "system_fingerprint": st.fingerprint,
        }

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            chead = {**head, "object": "chat.completion.chunk"}

            async def stream() -> AsyncIterator[str]:
                finals: dict[str, RequestOutput] = {}
                extra = {"usage": None} if include_usage else {}
                for i in range(req.n):
                    yield _sse(
                        {
                            **chead,
                            "choices": [
                                {
                                    "index": i,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                            **extra,
                        }
                    )
                done: set[int] = set()
                async for o in guarded(results(rids, q)):
                    if isinstance(o, str):  # the error event: the stream ends here
                        yield o
                        return
                    for c in o.outputs:
                        ends = c.finish_reason is not None and c.index not in done
                        if not c.delta_text and not c.delta_token_ids and not ends:
                            continue
                        if ends:
                            done.add(c.index)
                        lp = (
                            _chat_logprobs(tok, c, c.delta_start, len(c.token_ids))
                            if req.logprobs
                            else None
                        )
                        fin = c.finish_reason if c.finish_reason != "abort" else None
                        delta = {"content": c.delta_text} if c.delta_text else {}
                        yield _sse(
                            {
                                **chead,
                                "choices": [
                                    {
                                        "index": c.index,
                                        "delta": delta,
                                        "logprobs": lp,
                                        "finish_reason": fin,
                                    }
                                ],
                                **extra,
                            }
                        )
                    if o.finished:
                        finals[o.request_id] = o
                if include_usage:
                    yield _sse({**chead, "choices": [], "usage": usage([ids], finals)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        finals = {}
        async for o in results(rids, q, request):
            if o.finished:
                finals[o.request_id] = o

        def build() -> list[dict]:  # detokenises every log-prob token: off the event loop
            choices = []
            for c in finals[rids[0]].outputs:
                lp = _chat_logprobs(tok, c, 0, len(c.token_ids)) if req.logprobs else None
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


def server_fingerprint(model: Any, engine: Engine) -> str:
    from jdet.fingerprint import fingerprint

    return fingerprint(model, engine.plan, page_size=engine.page_size)


def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    dtype: str = "bfloat16",
    max_body_bytes: int = MAX_BODY_BYTES,
    public_metrics: bool = False,
    chat_template: str | None = None,
    **engine_kwargs: Any,
) -> None:
    """Blocking: load (if given a path), build the engine, serve until interrupted.

    `api_key` defaults to the `JDET_API_KEY` environment variable (a key on the command line is
    visible to every user in `ps`). `engine_kwargs` are `Engine`'s settings: invariance, tp,
    max_num_batched_tokens, max_num_seqs, max_model_len, page_size, num_pages, ...
    """
    api_key = api_key or os.environ.get("JDET_API_KEY") or None
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    import uvicorn

    from jdet.loader import load  # the loader module, not the jdet package (whose serve() is here)

    if model is None or isinstance(model, str | Path):
        model = load(model, dtype=dtype)
    engine = Engine(model, **engine_kwargs)
    name = served_model_name or (Path(model.path).name if getattr(model, "path", None) else "jdet")
    app = build_app(
        engine,
        model_name=name,
        fingerprint=server_fingerprint(model, engine),
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        public_metrics=public_metrics,
        chat_template=read_chat_template(chat_template),
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def read_chat_template(arg: str | None) -> str | None:
    """--chat-template: a file holding a Jinja chat template, or the template text itself."""
    if arg is None:
        return None
    p = Path(arg)
    if "{" not in arg and len(arg) < 4096 and p.is_file():
        return p.read_text()
    if "{" not in arg:
        raise ValueError(f"--chat-template {arg!r} is neither a file nor a Jinja template")
    return arg


if __name__ == "__main__":  # `python -m serving.server ...` is `jdet serve ...` (jdet/cli.py)
    import sys

    from jdet.cli import main

    sys.exit(main(["serve", *sys.argv[1:]]))
