"""OpenAI-compatible HTTP server: FastAPI + uvicorn around one engine driven by one thread.

Why one engine thread: the engine is single-threaded by design (scheduler, pages, device step);
HTTP handlers on the asyncio loop validate and tokenise, then hand requests over a queue; the
engine thread steps continuously and posts each output back to the request's asyncio queue with
`call_soon_threadsafe`. A handler that goes away (client disconnect, cancellation) sends an abort,
which releases the request's pages on the engine thread before its next step.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE with `stream=true`, ending in
`data: [DONE]`), GET /v1/models, /health, /metrics (Prometheus text). Binds 127.0.0.1 by default.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from serving.engine import CompletionOutput, Engine, RequestOutput
from serving.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    RequestError,
    check_prompt,
    parse,
    sampling_options,
)
from serving.sequence import SamplingOptions

log = logging.getLogger("jdet.server")

DISCONNECT_POLL_S = 0.1  # how often a non-streaming handler asks whether its client is still there


class ClientGone(Exception):
    """The client of a non-streaming request disconnected; its requests were aborted."""


class EngineDriver:
    """Runs `engine.step()` on a background thread; thread-safe submit/abort from asyncio."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
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

    def _run(self) -> None:
        eng = self.engine
        while not self.stopping:
            while True:
                try:
                    kind, rid, ids, opts = self.commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "add":
                    try:
                        eng.add_request(rid, ids, opts)
                    except ValueError as e:  # validated before; a last line of defence
                        self._post(rid, RequestError(str(e)))
                        self.routes.pop(rid, None)
                else:
                    eng.abort(rid)
                    self.routes.pop(rid, None)
                    eng.refresh_gauges()
            if not eng.has_unfinished():
                self.wakeup.wait(0.1)
                self.wakeup.clear()
                continue
            try:
                outs = eng.step()
            except Exception as e:  # noqa: BLE001 - fail the requests, keep the server up
                log.exception("engine step failed; aborting the running requests")
                self.error = e
                for rid in list(eng.requests):
                    eng.abort(rid)
                    self._post(rid, RequestError(f"engine error: {e}", status=500))
                    self.routes.pop(rid, None)
                continue
            for o in outs:
                self._post(o.request_id, o)
                if o.finished:
                    self.routes.pop(o.request_id, None)


# ---------------------------------------------------------------------- response pieces
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
    """`Authorization: Bearer <key>` on /v1/*, as a plain ASGI middleware: Starlette's
    `@app.middleware("http")` wraps `receive` so that `request.is_disconnected()` never sees the
    client go away, which the non-streaming handlers rely on to abort abandoned requests."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode("latin-1")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
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
    def __init__(self, engine: Engine, model_name: str, fingerprint: str) -> None:
        self.engine = engine
        self.driver = EngineDriver(engine)
        self.model_name = model_name
        self.fingerprint = fingerprint
        self.tokenizer = engine.tokenizer
        self.created = int(time.time())
        self.ids = itertools.count()


def build_app(
    engine: Engine, *, model_name: str, fingerprint: str, api_key: str | None = None
) -> Any:
    st = ServerState(engine, model_name, fingerprint)

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

    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = st.driver.thread.is_alive()
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
                f"model {name!r} does not exist; this server serves {st.model_name!r}",
                "model",
                404,
                "model_not_found",
            )

    def encode(text: str, add_special: bool = True) -> list[int]:
        if st.tokenizer is None:
            raise RequestError("this model has no tokenizer; send prompts as token ids", "prompt")
        return list(st.tokenizer(text, add_special_tokens=add_special)["input_ids"])

    def check_stop_ids(req: Any) -> None:
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < eng.cfg.vocab_size]
        if bad:
            raise RequestError(
                f"stop token id {bad[0]} is outside the vocabulary", "stop_token_ids"
            )
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

    def usage(prompts: list[list[int]], finals: dict[str, RequestOutput]) -> dict:
        p = sum(len(x) for x in prompts)
        c = sum(len(o.token_ids) for f in finals.values() for o in f.outputs)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # ------------------------------------------------------------------ completions
    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        req: CompletionRequest = parse(await request.body(), CompletionRequest)
        check_model(req.model)
        check_stop_ids(req)
        prompts = []
        for p in req.prompts():
            ids = encode(p) if isinstance(p, str) else list(p)
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
            )
            for ids in prompts
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
                async for o in results(rids, q):
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
        choices = []
        for rid in rids:
            for c in finals[rid].outputs:
                lp = _completion_logprobs(tok, c, 0, len(c.token_ids), 0) if want_lp else None
                choices.append(
                    {
                        "index": index[rid] * n + c.index,
                        "text": c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                        "seed": c.seed,
                    }
                )
        return {**head, "choices": choices, "usage": usage(prompts, finals)}

    # ------------------------------------------------------------------ chat
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        req: ChatCompletionRequest = parse(await request.body(), ChatCompletionRequest)
        check_model(req.model)
        check_stop_ids(req)
        tok = st.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError(
                "this model's tokenizer has no chat template; use /v1/completions instead",
                "messages",
            )
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template may reject a conversation
            raise RequestError(
                f"the chat template rejected these messages: {e}", "messages"
            ) from None
        ids = encode(text, add_special=False)
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
        )
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
                async for o in results(rids, q):
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
        return {**head, "choices": choices, "usage": usage([ids], finals)}

    return app


def server_fingerprint(model: Any, engine: Engine) -> str:
    from jdet.fingerprint import fingerprint
    from jdet.ops import Ops

    return fingerprint(
        model,
        engine.invariance,
        page_size=engine.page_size,
        tp=engine.tp,
        attn_partition=Ops(engine.invariance).attn_partition,
    )


def serve(
    model: Any = None,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    log_level: str = "info",
    dtype: str = "bfloat16",
    **engine_kwargs: Any,
) -> None:
    """Blocking: load (if given a path), build the engine, serve until interrupted.

    `engine_kwargs` are `Engine`'s settings: invariance, tp, max_num_batched_tokens,
    max_num_seqs, max_model_len, page_size, num_pages, enable_prefix_caching, scheduling, ...
    """
    import uvicorn

    import jdet

    if model is None or isinstance(model, str | Path):
        model = jdet.load(model, dtype=dtype)
    engine = Engine(model, **engine_kwargs)
    name = served_model_name or (Path(model.path).name if getattr(model, "path", None) else "jdet")
    app = build_app(
        engine, model_name=name, fingerprint=server_fingerprint(model, engine), api_key=api_key
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `jdet serve` flags (the CLI can reuse this)."""
    p.add_argument("model", nargs="?", default=None, help="model directory (default: embedded)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--invariance", default="tp", choices=["tp", "batch", "none"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--scheduling", default="stall_free", choices=["stall_free", "prefill_first"])
    p.add_argument(
        "--min-tokens-bucket",
        type=int,
        default=16,
        help="smallest padded token count (raise it to compile fewer shapes)",
    )
    p.add_argument("--min-seqs-bucket", type=int, default=8)
    p.add_argument("--min-pages-bucket", type=int, default=4)
    p.add_argument("--log-level", default="info")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="jdet serve", description=__doc__.splitlines()[0])
    add_arguments(p)
    a = p.parse_args(argv)
    serve(
        a.model,
        host=a.host,
        port=a.port,
        api_key=a.api_key,
        served_model_name=a.served_model_name,
        log_level=a.log_level,
        dtype=a.dtype,
        invariance=a.invariance,
        tp=a.tp,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        page_size=a.page_size,
        num_pages=a.num_pages,
        enable_prefix_caching=not a.no_prefix_caching,
        scheduling=a.scheduling,
        min_tokens_bucket=a.min_tokens_bucket,
        min_seqs_bucket=a.min_seqs_bucket,
        min_pages_bucket=a.min_pages_bucket,
    )


if __name__ == "__main__":
    main()
