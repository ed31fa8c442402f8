"""The data-parallel router's replicas (serving/http/router.py): each a `jdet serve` subprocess on
its own loopback port and devices (`ReplicaSet` starts, health-checks and restarts them, replica
0 first), or a server someone else runs (`ReplicaSet.external`), and which of them may serve
(`decide`: the healthy ones agreeing on the fingerprint most report).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence

import httpx

log = logging.getLogger("jdet.router")

REPLICA_STOP_TIMEOUT = 30.0  # seconds a replica gets to drain after SIGTERM
RESTART_BACKOFF = (1.0, 30.0)  # first and longest wait before restarting a replica that exited


@dataclasses.dataclass(frozen=True)
class Health:
    """How a ReplicaSet checks its replicas. Data, not module state: a test that wants faster
    checks builds its own."""

    interval: float = 1.0  # seconds between health checks of each replica
    misses: int = 5  # unanswered checks in a row before a running replica counts as down
    timeout: float = 10.0  # seconds a replica has to answer /health


@dataclasses.dataclass
class Replica:
    """One engine replica: a `jdet serve` subprocess on 127.0.0.1:port, or a server someone else
    runs at `url` (`ReplicaSet.external`: pods of an orchestrator)."""

    index: int
    port: int
    devices: str | None  # CUDA_VISIBLE_DEVICES for it (None: inherit)
    url: str | None = None
    proc: subprocess.Popen | None = None
    ready: bool = False  # healthy and agreeing with the others' fingerprint: gets requests
    healthy: bool = False  # its last /health said 200
    warm: bool = False  # passed a health check since it was (re)started
    status: str = "starting"
    fingerprint: str | None = None
    in_flight: int = 0
    restarts: int = 0
    misses: int = 0  # health checks in a row without an answer
    routed: int = 0
    failed: int = 0
    next_start: float = 0.0

    @property
    def base(self) -> str:
        return self.url or f"http://127.0.0.1:{self.port}"

    @property
    def alive(self) -> bool:
        """Its process runs (an external replica: always; its health check decides)."""
        if self.url is not None:
            return True
        return self.proc is not None and self.proc.poll() is None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_devices(n: int, tp: int, visible: str | None) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES: consecutive groups of `tp` of the visible GPUs (the
    parent's CUDA_VISIBLE_DEVICES, else 0, 1, ...). On a host without GPUs the variable is
    ignored and every replica has the host's CPU devices to itself."""
    ids = visible.split(",") if visible else [str(i) for i in range(n * tp)]
    if len(ids) < n * tp:
        raise ValueError(
            f"--data-parallel {n} x --tp {tp} needs {n * tp} GPUs but CUDA_VISIBLE_DEVICES "
            f"lists {len(ids)}; lower --data-parallel or --tp"
        )
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(n)]  # fmt: skip


class ReplicaSet:
    """Starts, watches and restarts the replicas; knows which can serve."""

    def __init__(
        self, serve_kwargs: dict, n: int, api_key: str | None, health: Health = Health()
    ) -> None:
        self.serve_kwargs = serve_kwargs
        self.health = health
        self.api_key = api_key
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = replica_devices(n, int(serve_kwargs.get("tp", 1)), visible)
        self.replicas = [Replica(i, free_port(), gpus[i]) for i in range(n)]
        self.fingerprint: str | None = None  # the replicas' common one (`decide`)
        self.stopping = False

    def command(self, r: Replica) -> list[str]:
        kw = {**self.serve_kwargs, "host": "127.0.0.1", "port": r.port, "data_parallel": 1}
        return [sys.executable, "-m", "serving.http.replica", json.dumps(kw)]

    def start(self, r: Replica) -> None:
        env = dict(os.environ)
        if r.devices is not None and visible_gpus_matter():
            env["CUDA_VISIBLE_DEVICES"] = r.devices
        if self.api_key:
            env["JDET_API_KEY"] = self.api_key  # not on the command line, which ps shows
        r.proc = subprocess.Popen(self.command(r), env=env)
        r.ready, r.healthy, r.warm, r.status, r.misses = False, False, False, "starting", 0
        log.info("replica %d: started (pid %d, port %d)", r.index, r.proc.pid, r.port)

    @classmethod
    def external(cls, urls: Sequence[str], health: Health = Health()) -> ReplicaSet:
        """Replicas that run elsewhere (e.g. one `jdet serve` pod each): routed to and checked,
        never started or restarted here."""
        rs = cls.__new__(cls)
        rs.serve_kwargs, rs.api_key, rs.fingerprint, rs.stopping = {}, None, None, False
        rs.health = health
        rs.replicas = [Replica(i, 0, None, url=u.rstrip("/")) for i, u in enumerate(urls)]
        return rs

    def start_all(self) -> None:
        """Replica 0 first, the others once it is warm: they then load its compiled steps from
        the persistent caches instead of compiling the same shapes at the same time."""
        if self.replicas[0].url is None:
            self.start(self.replicas[0])

    async def watch(self, client: httpx.AsyncClient) -> None:
        """Every `health.interval` seconds: each replica's /health; start the waiting ones,
        restart the ones that exited (with a growing backoff)."""
        while not self.stopping:
            first = self.replicas[0]
            for r in self.replicas:
                if r.url is not None:
                    pass
                elif r.proc is None and r is not first and (first.ready or not first.alive):
                    self.start(r)
                elif r.proc is not None and not r.alive and not self.stopping:
                    if r.status != "exited":
                        r.ready, r.healthy, r.status = False, False, "exited"
                        r.restarts += 1
                        wait = min(RESTART_BACKOFF[0] * 2 ** (r.restarts - 1), RESTART_BACKOFF[1])
                        r.next_start = time.monotonic() + wait
                        log.error("replica %d exited (status %s); restarting in %.0f s",
                                  r.index, r.proc.returncode, wait)  # fmt: skip
                    elif time.monotonic() >= r.next_start:
                        self.start(r)
            alive = [r for r in self.replicas if r.alive]
            answers = await asyncio.gather(*(self.ask(r, client) for r in alive))
            for r, answer in zip(alive, answers, strict=True):  # no await from here to decide():
                self.check(r, answer)  # /health never sees a round half applied
            self.decide()
            await asyncio.sleep(self.health.interval)

    async def ask(self, r: Replica, client: httpx.AsyncClient) -> tuple[int, dict] | None:
        """`r`'s /health: (status code, body), or None when it did not answer."""
        try:
            resp = await client.get(r.base + "/health", timeout=self.health.timeout)
            return resp.status_code, resp.json()
        except (httpx.HTTPError, ValueError):
            return None

    def check(self, r: Replica, answer: tuple[int, dict] | None) -> None:
        """Apply one /health answer of `r` (`ask`): whether it answers 200 and with which
        fingerprint. Applied with the round's others just before `decide`, never across an
        await: a /health of the router in between saw a replica's new status beside its old
        readiness (the status "ok" of one whose fingerprint differs)."""
        if answer is None:
            # a busy replica may answer late; a dead one is caught by its exit or a lost request
            r.misses += 1
            if r.status == "starting" or r.misses >= self.health.misses:
                r.healthy = False
                r.status = "starting" if r.status == "starting" else "unreachable"
            return
        code, body = answer
        r.misses = 0
        r.fingerprint = body.get("system_fingerprint")
        r.healthy = code == 200 and r.fingerprint is not None
        r.status = body.get("status", str(code))

    def decide(self) -> None:
        """Which replicas serve: the healthy ones that report the fingerprint most healthy
        replicas report (ties: the lowest replica's). A replica with another fingerprint (other
        weights, settings, versions or device kind) would give other bits: it gets nothing."""
        fps = [r.fingerprint for r in self.replicas if r.healthy]
        if fps:
            counts = Counter(fps)
            ref = next(f for f in fps if counts[f] == max(counts.values()))
            if self.fingerprint not in (None, ref):
                log.warning("replicas now agree on fingerprint %s, not %s", ref, self.fingerprint)
            self.fingerprint = ref
        for r in self.replicas:
            r.ready = r.healthy and r.fingerprint == self.fingerprint
            r.warm = r.warm or r.ready
            if r.healthy and not r.ready:
                r.status = f"fingerprint {r.fingerprint} differs from {self.fingerprint}"

    def serving(self) -> list[int]:
        return [r.index for r in self.replicas if r.ready and r.alive]

    def stop(self) -> None:
        """SIGTERM to every replica (each drains its requests), SIGKILL after the timeout."""
        self.stopping = True
        procs = [r.proc for r in self.replicas if r.alive]
        for p in procs:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + REPLICA_STOP_TIMEOUT
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def visible_gpus_matter() -> bool:
    """Whether to give each replica its own CUDA_VISIBLE_DEVICES: not when JAX is held to the
    CPU, where the replicas share the host's CPU devices anyway."""
    return os.environ.get("JAX_PLATFORMS", "").strip().lower() not in ("cpu",)
