"""One engine over several processes (sharding/distributed.py): every process runs the same
deterministic engine on the same request stream.

Why not "process 0 schedules and broadcasts each step's inputs": the engine's step is already a
function of (engine state, the requests added and aborted before it), so replaying the request
stream reproduces every batch on every process without the engine knowing it runs on several
hosts. Only requests cross the network (a few hundred bytes when one arrives), not each step's
token ids, positions, slots, page tables and sampling inputs; and every kind of step the engine
runs (prefill, decode dispatched ahead, score rows, speculative verifies, warm-up) needs no
broadcast of its own. The price is that everything the scheduler reads must be equal on every
process, which this module arranges: every process checks that it sized the same KV pool
(`check_same_pool`), a request's seed is drawn once on process 0 and sent with it, and commands
land between the same two steps.

Serving (`jdet serve --num-processes N`): process 0 runs the HTTP server on a `LeaderEngine`,
which applies each add / abort locally and sends it to the followers with the next step; a
follower runs `follow`, replaying them. Outputs: sampled tokens and log-probs are replicated over
the mesh, so process 0 reads them from its own devices; nothing is gathered.

Offline (`jdet.LLM(..., num_processes=N)`): every process runs the same script (JAX's
multi-controller model); `spmd_inputs` checks that every process passes the same prompts and
gives unseeded requests process 0's seeds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import secrets
from collections.abc import Sequence
from typing import Any

from serving.engine.engine import Engine
from serving.engine.faults import EngineBroken, EngineStepError
from serving.sampling_options import SamplingOptions
from sharding import distributed
from sharding.distributed import Cluster

log = logging.getLogger("jdet.multihost")


def check_same_pool(engine: Engine) -> None:
    """In a multi-process job, raise unless every process built a KV pool of the same number of
    pages (one collective): the pool is one global array, and each process sizes its own from
    its own device's memory, which hosts of one kind share. Different hosts: give --num-pages."""
    if distributed.current() is None:
        return
    n = engine.page_manager.num_pages
    lo, hi = distributed.agree_min(n), -distributed.agree_min(-n)
    if lo != hi:
        raise ValueError(
            f"the processes sized KV pools of {lo} to {hi} pages (this one: {n}), but the pool "
            f"is one array over all of them; start every process with --num-pages {lo}"
        )


def _opts_json(opts: SamplingOptions) -> dict:
    return dataclasses.asdict(opts)


def _opts_from_json(d: dict) -> SamplingOptions:
    def tup(v: Any) -> Any:
        return tuple(tup(x) for x in v) if isinstance(v, list) else v

    return SamplingOptions(**{k: tup(v) for k, v in d.items()})


class LeaderEngine:
    """Process 0's engine: every call that changes the engine's state is replayed by the
    followers. Reads (metrics, requests, tokenizer, ...) go to the engine itself."""

    def __init__(self, engine: Engine, cluster: Cluster) -> None:
        self.engine = engine
        self.cluster = cluster
        self._commands: list[list] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: Any = None,
        arrival_time: float | None = None, *, checked: bool = False,
    ) -> int:  # fmt: skip
        opts = SamplingOptions.from_any(params)
        seed = self.engine.add_request(request_id, prompt_token_ids, opts, arrival_time,
                                       checked=checked)  # fmt: skip
        # the followers get the seed drawn here, never their own (Engine.add_request)
        sent = _opts_json(dataclasses.replace(opts, seed=seed))
        self._commands.append(["add", request_id, [int(t) for t in prompt_token_ids], sent])
        return seed

    def add_score(self, request_id: str, token_ids: list[int], arrival_time: float | None = None
                  ) -> None:  # fmt: skip
        self.engine.add_score(request_id, token_ids, arrival_time)
        self._commands.append(["score", request_id, [int(t) for t in token_ids]])

    def abort(self, request_id: str) -> bool:
        done = self.engine.abort(request_id)
        if done:
            self._commands.append(["abort", request_id])
        return done

    def step(self) -> list:
        self._send({"commands": self._commands, "step": True})
        self._commands = []
        return self.engine.step()

    def warmup(self, kind: str = "step", progress: bool = False, should_stop: Any = None
               ) -> float:  # fmt: skip
        # every process compiles and runs the same warm-up steps (collectives): none stops early
        self._send({"warmup": kind})
        return self.engine.warmup(kind, progress=progress)

    def stop(self) -> None:
        """Tell the followers to leave (a server shutting down)."""
        self._send({"stop": True})

    def _send(self, msg: dict) -> None:
        self.cluster.broadcast(json.dumps(msg).encode())


def apply_command(engine: Engine, cmd: list) -> None:
    kind, rid = cmd[0], cmd[1]
    if kind == "add":
        engine.add_request(rid, cmd[2], _opts_from_json(cmd[3]), checked=True)  # by process 0
    elif kind == "score":
        engine.add_score(rid, cmd[2])
    elif kind == "abort":
        engine.abort(rid)
    else:
        raise ValueError(f"unknown command {kind!r} from process 0")


def follow(engine: Engine, cluster: Cluster) -> None:
    """A follower's loop: replay process 0's request stream and steps until it says stop."""
    log.info("process %d: following process 0's request stream", cluster.process_id)
    while True:
        raw = cluster.receive()
        if raw is None:  # process 0 left without a stop (its process ended)
            return
        msg = json.loads(raw)
        if msg.get("stop"):
            return
        if "warmup" in msg:
            engine.warmup(msg["warmup"])
            continue
        for cmd in msg["commands"]:
            apply_command(engine, cmd)
        if msg.get("step"):
            try:
                engine.step()
            except EngineBroken:
                raise
            except EngineStepError:  # process 0's step failed alike; it ends those requests
                log.exception("engine step failed on process %d", cluster.process_id)


def spmd_inputs(token_ids: Sequence[Sequence[int]], params: Sequence[Any] | None) -> list | None:
    """`jdet.LLM` in a multi-process job: check that every process passes the same prompts and
    sampling parameters (a process that did not would run other steps than its peers and hang
    them in a collective), and return `params` with process 0's seed in each request that gives
    none (each process would draw its own). One or two collectives per call;
    single process: `params` unchanged."""
    if distributed.current() is None:
        return None if params is None else list(params)
    opts = None if params is None else [SamplingOptions.from_any(p) for p in params]
    h = hashlib.sha256(json.dumps([list(map(int, t)) for t in token_ids]).encode())
    if opts is not None:
        h.update(json.dumps([_opts_json(o) for o in opts], sort_keys=True, default=str).encode())
    if not distributed.same_everywhere(h.digest()):
        raise ValueError(
            "the processes of this multi-process job passed different prompts or sampling "
            "parameters to jdet.LLM: every process must make the same calls with the same "
            "arguments (JAX's multi-controller model)"
        )
    if opts is None:
        return None
    unseeded = [i for i, o in enumerate(opts) if o.seed is None]
    seeds = distributed.broadcast_u32([secrets.randbits(32) for _ in unseeded])
    out = list(params)  # type: ignore[arg-type]
    for i, s in zip(unseeded, seeds, strict=True):
        p = out[i]
        out[i] = dataclasses.replace(p if dataclasses.is_dataclass(p) else opts[i], seed=s)
    return out
