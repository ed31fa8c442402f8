"""The data-parallel router's failure paths against fake replicas (no model, no JAX): a replica
that cannot be reached is skipped and the request retried, a stream that breaks under way ends
with an error event, a replica with another fingerprint is never used, /health aggregates."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from serving.http import router
from serving.http.replicas import Health, ReplicaSet
from serving.http.router import build_router


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_replica(fingerprint: str, *, break_stream: bool = False, seen: dict | None = None
                 ) -> FastAPI:  # fmt: skip
    """Answers like a jdet server, naming its fingerprint (`who`) in every body; with
    `break_stream` a stream dies after its first event. The prompt "slow" is answered after
    10 s, unless its client goes first (then `seen["gone"]` is set)."""
    app = FastAPI()

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({"status": "ok", "system_fingerprint": fingerprint})

    @app.post("/v1/completions")
    async def completions(body: dict, request: Request) -> object:
        if body["prompt"] == "slow":
            for _ in range(200):
                if await request.is_disconnected():
                    seen["gone"] = True
                    return {}
                await asyncio.sleep(0.05)
            return {"who": fingerprint}
        if not body.get("stream"):
            return {"who": fingerprint, "prompt": body["prompt"]}

        async def events() -> AsyncIterator[bytes]:
            yield f"data: {json.dumps({'who': fingerprint})}\n\n".encode()
            await asyncio.sleep(0.05)
            if break_stream:
                raise RuntimeError("replica lost")  # the connection closes mid-response
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


class Served:
    """An ASGI app on a loopback port in a thread, for the length of a `with`."""

    def __init__(self, app: FastAPI, port: int | None = None) -> None:
        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="critical"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline, "server did not start"
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


FAST_HEALTH = Health(interval=0.05, misses=10**6)  # a replica once up stays up here


def wait_health(base: str, want: str) -> dict:
    deadline = time.time() + 20
    while time.time() < deadline:
        h = httpx.get(base + "/health", timeout=5).json()
        if h["status"] == want:
            return h
        time.sleep(0.05)
    raise AssertionError(f"/health never said {want!r}: {h}")


def test_router_retries_skips_and_reports():
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    seen: dict = {}
    with (
        Served(fake_replica("fp_a", seen=seen)) as a,
        Served(fake_replica("fp_a", break_stream=True, seen=seen)) as b,
        Served(fake_replica("fp_other")) as c,
    ):
        urls = [a, b, c, dead]
        rs = ReplicaSet.external(urls, FAST_HEALTH)
        with Served(build_router(rs)) as base:
            h = wait_health(base, "degraded")
            ready = {r["replica"]: r["ready"] for r in h["replicas"]}
            assert ready == {0: True, 1: True, 2: False, 3: False}  # other fingerprint; dead
            assert "differs" in h["replicas"][2]["status"] and h["system_fingerprint"] == "fp_a"

            # the dead replica is the first choice of some prompts: never routed to while down
            whos = set()
            for i in range(40):
                r = httpx.post(base + "/v1/completions", json={"prompt": f"p{i}"}, timeout=10)
                assert r.status_code == 200 and r.json()["prompt"] == f"p{i}"
                whos.add(r.json()["who"])
            assert whos == {"fp_a"}

            # a replica lost between its health check and the request: retried elsewhere
            dead_one = rs.replicas[3]  # as if it had just passed a check, then died
            dead_one.healthy, dead_one.fingerprint, dead_one.status = True, "fp_a", "ok"
            time.sleep(0.3)  # the router's next health round: routed to
            prompts = [f"q{i}" for i in range(40)]
            firsts = [router.ranking(router.route_key({"prompt": p}), [0, 1, 3])[0]
                      for p in prompts]  # fmt: skip
            p = prompts[firsts.index(3)]
            r = httpx.post(base + "/v1/completions", json={"prompt": p}, timeout=10)
            assert r.status_code == 200 and r.json()["who"] == "fp_a"
            assert "jdet_router_retries_total 1.0" in httpx.get(base + "/metrics").text

            # a stream that breaks under way ends with an error event (bytes were sent: no retry)
            key = next(q for q in (f"s{i}" for i in range(200))
                       if router.ranking(router.route_key({"prompt": q}), [0, 1])[0] == 1)
            with httpx.stream("POST", base + "/v1/completions", timeout=10,
                              json={"prompt": key, "stream": True}) as s:  # fmt: skip
                events = [x for x in s.iter_lines() if x.startswith("data: ")]
            assert json.loads(events[0][6:]) == {"who": "fp_a"}
            assert json.loads(events[-1][6:])["error"]["code"] == "replica_lost"

            # a client that gives up: the router closes its request to the replica, which
            # then stops working for nobody
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(base + "/v1/completions", json={"prompt": "slow"}, timeout=1)
            deadline = time.time() + 5
            while "gone" not in seen:
                assert time.time() < deadline, "the replica never saw the client go"
                time.sleep(0.05)
