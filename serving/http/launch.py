"""`jdet.serve` / `jdet serve`: load the model, build the engine and the app, run uvicorn."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import uvicorn

from jdet.fingerprint import fingerprint
from jdet.loader import load
from jdet.settings import EngineConfig
from serving.engine import multihost
from serving.engine.engine import Engine
from serving.http.router import serve_data_parallel
from serving.http.server import MAX_BODY_BYTES, build_app
from sharding import distributed


def server_fingerprint(model: Any, engine: Engine) -> str:
    return fingerprint(
        model, engine.plan, page_size=engine.page_size, speculative=engine.speculative
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
    max_body_bytes: int = MAX_BODY_BYTES,
    public_metrics: bool = False,
    chat_template: str | None = None,
    data_parallel: int = 1,
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
    if data_parallel != 1:  # replicas behind one endpoint (serving/http/router.py)
        replica = replica_settings(
            model, dtype=dtype, served_model_name=served_model_name, log_level=log_level,
            max_body_bytes=max_body_bytes, public_metrics=public_metrics,
            chat_template=chat_template, **engine_kwargs,
        )  # fmt: skip
        serve_data_parallel(
            data_parallel, replica, host=host, port=port, log_level=log_level, api_key=api_key,
            public_metrics=public_metrics, max_body_bytes=max_body_bytes,
        )  # fmt: skip
        return
    # a multi-host job (num_processes > 1) starts before the model touches a device
    cluster = distributed.initialize(
        distributed.resolve(engine_kwargs.get("num_processes"), engine_kwargs.get("process_id"),
                            engine_kwargs.get("coordinator_address")),
        heartbeat_timeout=engine_kwargs.get("heartbeat_timeout", 10),
    )  # fmt: skip
    if model is None or isinstance(model, str | Path):
        model = load(model, dtype=dtype)
    settings = {f.name for f in dataclasses.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in engine_kwargs.items() if k in settings})
    engine = Engine(model, config, **{k: v for k, v in engine_kwargs.items() if k not in settings})
    multihost.check_same_pool(engine)  # a multi-host job: one KV pool size everywhere
    if cluster is not None and not cluster.is_leader:
        multihost.follow(engine, cluster)  # process 0 serves; this one replays its requests
        return
    if cluster is not None:
        engine = multihost.LeaderEngine(engine, cluster)  # type: ignore[assignment]
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
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level)
    finally:
        if cluster is not None:
            engine.stop()  # the followers leave with process 0


def replica_settings(model: Any, **settings: Any) -> dict:
    """`serve`'s arguments for a data-parallel replica, as JSON-able values: the model as its
    directory (a replica loads it itself), the speculative config as a dict."""
    if settings.get("num_processes") not in (None, 1):
        raise ValueError(
            "--data-parallel and --num-processes do not combine: run one multi-host job per "
            "replica behind your own router (docs/deployment.md)"
        )
    if model is not None and not isinstance(model, str | Path):
        path = getattr(model, "path", None)
        if path is None:
            raise ValueError(
                "data-parallel replicas load the model themselves: pass its directory, not a "
                "model built in memory"
            )
        model = path
    spec = settings.get("speculative")
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        settings["speculative"] = dataclasses.asdict(spec)
    return {"model": None if model is None else str(model), **settings}


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
