"""Data parallelism (`jdet serve --data-parallel N`): N engine replicas, each a `jdet serve`
subprocess on its own devices and loopback port, behind one OpenAI-compatible endpoint.

Why subprocesses: a replica is then exactly the single-engine server (same code, same bits, same
fingerprint), one replica's crash cannot take the others down, and the router below is a thin
HTTP relay that never touches JAX or a device.

Routing: a request goes to the replica ranked first for a hash of its prompt's prefix
(`route_key`: the first ROUTE_PREFIX_CHARS characters of the prompt or the conversation),
ranked by rendezvous hashing: requests that share a prefix land on the same replica, so its
prefix cache holds their common pages, and when a replica is down only its share moves. A
replica more than BALANCE_SLACK requests busier than the least busy one is passed over for it
(a popular prefix must not pin all load on one replica). Bits never depend on the choice: every
replica runs the same model and plan, a replica whose fingerprint differs from the one most
replicas report gets no requests (`ReplicaSet.decide`), and a request's bits depend only on the
request.

Failures: a request whose replica dies before any byte reached the client is retried on the next
replica in its ranking (the same bits, since every replica gives them); a stream already under
way ends with an error event. A replica that exits is restarted (its port kept); /health
aggregates the replicas (200 while any serves) and /metrics relays each replica's series with a
`replica` label beside the router's own (router_metrics.py).

Shutdown: uvicorn stops accepting connections and waits for the requests in flight (drain);
then each replica gets SIGTERM (it drains its own) and, after REPLICA_STOP_TIMEOUT, SIGKILL.

The replicas themselves (processes, devices, health checks, restarts) are in replicas.py; this
module routes and relays.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from serving.http.auth import ApiKeyMiddleware
from serving.http.protocol import RequestError
from serving.http.replicas import Replica, ReplicaSet
from serving.http.router_metrics import RouterStats, label_series, merge_families, router_metrics

log = logging.getLogger("jdet.router")

ROUTE_PREFIX_CHARS = 1024  # characters (or token ids) of the prompt that pick the replica
BALANCE_SLACK = 16  # in-flight requests a replica may hold beyond the least busy one's
DISCONNECT_POLL = 0.5  # seconds between checks that a waiting client is still there
_HOP_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding"}


# ---------------------------------------------------------------------------------- routing
def route_key(body: Any) -> bytes:
    """The bytes that pick a request's replica: the start of its prompt (completions: the text or
    token ids of its first prompt; chat: the conversation's roles and text), so requests sharing
    a prefix share a replica and its prefix cache. Anything else: the body itself."""
    if isinstance(body, dict):
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch: its first prompt
        if isinstance(prompt, str):
            return prompt[:ROUTE_PREFIX_CHARS].encode("utf-8", "replace")
        if isinstance(prompt, list):
            return json.dumps(prompt[:ROUTE_PREFIX_CHARS]).encode()
        messages = body.get("messages")
        if isinstance(messages, list):
            text = "".join(
                f"{m.get('role')}\n{m.get('content')}\n" if isinstance(m, dict) else str(m)
                for m in messages
            )
            return text[:ROUTE_PREFIX_CHARS].encode("utf-8", "replace")
    return json.dumps(body, sort_keys=True, default=str)[:ROUTE_PREFIX_CHARS].encode()


def ranking(key: bytes, replicas: Sequence[int]) -> list[int]:
    """Rendezvous (highest-random-weight) order of `replicas` for `key`: each replica's rank
    depends on the key and its own index only, so removing one moves only its keys."""

    def weight(i: int) -> bytes:
        return hashlib.blake2b(key, digest_size=8, salt=i.to_bytes(16, "little")).digest()

    return sorted(replicas, key=weight, reverse=True)


# ----------------------------------------------------------------------------------- router
class ReplicaLost(Exception):
    """The replica closed the connection or could not be reached (died, restarting)."""


class ClientGone(Exception):
    """The client closed its connection before the answer was complete."""


def build_router(
    replicas: ReplicaSet,
    *,
    api_key: str | None = None,
    public_metrics: bool = False,
    max_body_bytes: int = 4 << 20,
) -> FastAPI:
    """The endpoint in front of `replicas`: the generation routes relayed to a replica chosen by
    prefix hash, /v1/models from any replica, /health and /metrics over all of them."""
    stats = RouterStats()
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0), trust_env=False)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        replicas.start_all()
        task = asyncio.create_task(replicas.watch(client))
        try:
            yield
        finally:  # uvicorn has drained the requests in flight by now
            task.cancel()
            await asyncio.to_thread(replicas.stop)
            await client.aclose()

    app = FastAPI(title="jdet router", version="1", lifespan=lifespan)
    if api_key:
        open_paths = ("/health", "/metrics") if public_metrics else ("/health",)
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, open_paths=open_paths)
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def relay(request: Request) -> Response:
        body = await read_body(request, max_body_bytes)
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None  # the replica answers the 400
        streaming = isinstance(parsed, dict) and parsed.get("stream") is True
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS}
        tried: list[int] = []
        order = ranking(route_key(parsed), range(len(replicas.replicas)))
        while True:
            r = pick(replicas, order, tried)
            if r is None:
                stats.unroutable += 1
                what = "no replica is serving" if not tried else \
                    f"replicas {tried} failed this request and no other is serving"  # fmt: skip
                err = RequestError(f"{what}; retry shortly", None, 503, "service_unavailable")
                return JSONResponse(err.body(), status_code=503)
            tried.append(r.index)
            try:
                return await forward(r, request, headers, body, streaming)
            except ClientGone:
                return Response(status_code=499)  # nobody reads it
            except ReplicaLost as e:
                r.failed += 1
                if not r.alive:  # exited: not tried again until restarted and healthy
                    r.ready = r.healthy = False
                stats.retries += 1
                log.warning("replica %d lost a request (%s); retrying elsewhere", r.index, e)

    async def forward(r: Replica, request: Request, headers: dict, body: bytes,
                      streaming: bool) -> Response:  # fmt: skip
        path = request.url.path
        req = client.build_request("POST", r.base + path, headers=headers, content=body)
        r.in_flight += 1
        r.routed += 1
        try:
            resp = await unless_gone(client.send(req, stream=True), request)
        except (httpx.TransportError, ClientGone) as e:
            r.in_flight -= 1
            if isinstance(e, ClientGone):
                raise
            raise ReplicaLost(type(e).__name__) from e
        if resp.status_code == 503:  # warming up or shutting down: another replica may serve
            await resp.aclose()
            r.in_flight -= 1
            raise ReplicaLost("503")
        keep = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
        if not streaming:
            try:
                content = await unless_gone(resp.aread(), request)
            except httpx.TransportError as e:
                raise ReplicaLost(type(e).__name__) from e
            finally:
                await resp.aclose()
                r.in_flight -= 1
            return Response(content, status_code=resp.status_code, headers=keep)
        chunks = resp.aiter_raw()
        try:  # the first bytes before answering, so a replica lost before them is retried
            first = await unless_gone(anext(chunks, b""), request)
        except (httpx.TransportError, ClientGone) as e:
            await resp.aclose()
            r.in_flight -= 1
            if isinstance(e, ClientGone):
                raise
            raise ReplicaLost(type(e).__name__) from e

        async def rest() -> AsyncIterator[bytes]:
            try:
                yield first
                async for chunk in chunks:
                    yield chunk
            except httpx.TransportError as e:
                r.failed += 1
                log.warning("replica %d lost a stream under way (%s)", r.index, e)
                err = RequestError(f"replica {r.index} was lost mid-stream; resend the request "
                                   "(same seed, same bits)", None, 502, "replica_lost")  # fmt: skip
                yield f"data: {json.dumps(err.body())}\n\n".encode()
            finally:
                await resp.aclose()
                r.in_flight -= 1

        return StreamingResponse(rest(), status_code=resp.status_code, headers=keep)

    app.post("/v1/completions")(relay)
    app.post("/v1/chat/completions")(relay)

    @app.get("/v1/models")
    async def models() -> Response:
        for i in replicas.serving():
            try:
                resp = await client.get(replicas.replicas[i].base + "/v1/models", headers=auth)
            except httpx.TransportError:
                continue
            return Response(resp.content, status_code=resp.status_code,
                            media_type="application/json")  # fmt: skip
        err = RequestError("no replica is serving; retry shortly", None, 503)
        return JSONResponse(err.body(), status_code=503)

    @app.get("/health")
    async def health() -> JSONResponse:
        rs = replicas.replicas
        up = replicas.serving()
        status = "ok" if len(up) == len(rs) else "degraded" if up else "unavailable"
        body = {
            "status": status,
            "system_fingerprint": replicas.fingerprint,
            "replicas": [
                {"replica": r.index, "status": r.status if r.alive else "exited",
                 "ready": r.ready and r.alive,
                 "pid": r.proc.pid if r.proc else None, "port": r.port, "in_flight": r.in_flight,
                 "restarts": r.restarts, "system_fingerprint": r.fingerprint}  # fmt: skip
                for r in rs
            ],
        }
        return JSONResponse(body, status_code=200 if up else 503)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        parts = [router_metrics(replicas, stats)]
        for r in replicas.replicas:
            if not r.alive:
                continue
            try:
                resp = await client.get(r.base + "/metrics", headers=auth, timeout=5)
            except httpx.HTTPError:
                continue
            if resp.status_code == 200:
                parts.append(label_series(resp.text, r.index))
        return PlainTextResponse(merge_families(parts), media_type="text/plain; version=0.0.4")

    return app


def pick(replicas: ReplicaSet, order: list[int], tried: list[int]) -> Replica | None:
    """The first replica of `order` that serves and was not tried, unless it is BALANCE_SLACK
    requests busier than the least busy candidate (then that one). When none passes its health
    check, any running replica that was warm once: a replica too busy to answer /health in
    time is still the best place for a request."""
    up = set(replicas.serving()) or {r.index for r in replicas.replicas if r.alive and r.warm}
    cands = [replicas.replicas[i] for i in order if i in up and i not in tried]
    if not cands:
        return None
    least = min(cands, key=lambda r: r.in_flight)
    return least if cands[0].in_flight > least.in_flight + BALANCE_SLACK else cands[0]


async def unless_gone(aw: Any, request: Request) -> Any:
    """`await aw` (a step of the exchange with a replica), unless the client goes away first:
    then it is cancelled, which closes the replica's connection, so the replica aborts the
    request (its server watches for that) instead of generating for nobody; ClientGone."""
    task = asyncio.ensure_future(aw)
    while True:
        done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                await task
            raise ClientGone


async def read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise RequestError(f"request body exceeds {limit} bytes; send a shorter request",
                               None, 413, "request_too_large")  # fmt: skip
        chunks.append(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------------------ entry points
def serve_data_parallel(n: int, serve_kwargs: dict, *, host: str, port: int, log_level: str,
                        api_key: str | None, public_metrics: bool, max_body_bytes: int) -> None:
    """Blocking: `n` replicas of `jdet serve` (`serve_kwargs`: its settings, JSON-able) behind
    one endpoint on host:port, until interrupted."""
    if n < 1:
        raise ValueError(f"--data-parallel must be >= 1, got {n}")
    replicas = ReplicaSet(serve_kwargs, n, api_key)
    app = build_router(replicas, api_key=api_key, public_metrics=public_metrics,
                       max_body_bytes=max_body_bytes)  # fmt: skip
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def main(argv: list[str] | None = None) -> None:
    """`python -m serving.http.router --replicas URL,URL,...`: the router alone, in front of
    replicas that run elsewhere (docs/deployment.md). The API key, if any, is $JDET_API_KEY."""
    ap = argparse.ArgumentParser(prog="python -m serving.http.router", description=main.__doc__)
    ap.add_argument("--replicas", required=True, help="comma-separated replica base URLs")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--public-metrics", action="store_true", help="/metrics without the key")
    ap.add_argument("--log-level", default="info")
    a = ap.parse_args(argv)
    replicas = ReplicaSet.external([u for u in a.replicas.split(",") if u])
    app = build_router(replicas, api_key=os.environ.get("JDET_API_KEY") or None,
                       public_metrics=a.public_metrics)  # fmt: skip
    uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level)


if __name__ == "__main__":
    main()
