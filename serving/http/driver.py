"""The engine thread behind the HTTP server: `EngineDriver` runs `engine.step()` on one background
thread and posts each output to the asyncio queue of the request it belongs to.

Why one engine thread: the engine is single-threaded by design (scheduler, pages, device step);
HTTP handlers on the asyncio loop validate and tokenise, then hand requests over a queue; the
engine thread steps continuously and posts each output back with `call_soon_threadsafe`. An abort
(client gone, cancellation) releases the request's pages on the engine thread before its next
step. A request the engine fails alone gets a 500 of its own; an engine failure nobody explains
ends the running requests with 500s, the engine resets itself, and if its page accounting is not
clean afterwards the process exits non-zero (EXIT_ENGINE_BROKEN).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import threading
import time
from typing import Any

from serving.engine.engine import Engine
from serving.engine.faults import EngineBroken, EngineStepError
from serving.http.protocol import RequestError, clip
from serving.sampling_options import SamplingOptions

log = logging.getLogger("jdet.server")

EXIT_ENGINE_BROKEN = 70  # process exit status when the engine cannot be trusted after a failure


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
                        eng.add_request(rid, ids, opts, checked=True)  # the server checked it
                    except Exception as e:  # noqa: BLE001 - a last line of defence
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


class ServerState:
    """What the app's handlers share: the engine, its driver thread, the model's name and
    fingerprint."""

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
