"""JAX's persistent compilation cache for jdet, and a process-wide compile counter.

Why a persistent cache: without it every process start recompiles every step shape (seconds each
on an 8B model). With the cache on, a restart of the same model loads the executables from disk.

Where: `$JDET_CACHE_DIR` if set, else `~/.cache/jdet/xla`; `jdet.LLM(compile_cache=...)`,
`Engine(compile_cache=...)` and `jdet serve --compile-cache-dir DIR | --no-compile-cache` move or
disable it. A directory the user already gave JAX (`jax_compilation_cache_dir`) is kept when jdet
is asked for its default.

What the key covers (JAX's own key, jax/_src/cache_key.py): the lowered HLO module — which holds
the Pallas kernels' payloads (Triton IR on the Triton backend, the serialized Mosaic module on
Mosaic GPU, plain HLO in interpret mode on CPU), so any change of a kernel or its tile plan is a
different key — plus the jaxlib version, the backend platform and its version, the XLA flags, the
compile options and the device kind/count. jdet adds nothing of its own to the executable, so
nothing else can change it. Model weights are arguments, never constants, so one entry serves any
checkpoint of the same shapes.

Thresholds: JAX caches only compiles longer than 1 s by default; jdet sets the minimum compile
time to 0 and lifts the entry-size floor, so the small CPU compiles (tests, tiny models) are
cached too and a warm restart compiles nothing at all.

Compile counter: `stats()` counts backend compilations of this process from `jax.monitoring`
events ('/jax/core/compile/backend_compile_duration', which fires for every executable JAX
builds, a persistent-cache load included, and '/jax/compilation_cache/cache_hits' for the loads).
The server exports them on /metrics; the tests assert the count does not move after warm-up.
It also counts tracings ('/jax/core/compile/jaxpr_trace_duration') and lowerings to MLIR
('/jax/core/compile/jaxpr_to_mlir_module_duration'), per function name too (`traced()`): what
jdet's executable cache (jdet/exec_cache.py, in `exec_dir()`) skips on a restart.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import jax
from jax.experimental.compilation_cache import compilation_cache as cc

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
LOWER_EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"
EXEC_SUBDIR = "exec"  # jdet's executable cache, inside the compilation cache directory

CacheSetting = bool | str | os.PathLike | None


def default_dir() -> Path:
    """`$JDET_CACHE_DIR`, else `~/.cache/jdet/xla`."""
    env = os.environ.get("JDET_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jdet" / "xla"


_enabled_by_jdet: Path | None = None
_exec_dir: Path | None = None
_lock = threading.Lock()


def exec_dir() -> Path | None:
    """Where jdet's executable cache lives (`<cache dir>/exec`), None when `enable` turned the
    caches off or was never called."""
    return _exec_dir


def enable(setting: CacheSetting = True) -> Path | None:
    """Turn the persistent cache on (True: the default directory; a path: there) or off (False
    or None); returns the directory in use. Call before the compiles it should cover; a process
    that already compiled is switched over too (JAX decides once per process otherwise)."""
    global _enabled_by_jdet, _exec_dir
    with _lock:
        current = jax.config.jax_compilation_cache_dir
        if setting is False or setting is None:
            if current and _enabled_by_jdet is not None and Path(current) == _enabled_by_jdet:
                jax.config.update("jax_compilation_cache_dir", None)
                cc.reset_cache()
            _enabled_by_jdet = None
            _exec_dir = None
            return None
        if setting is True:
            if current and (_enabled_by_jdet is None or Path(current) != _enabled_by_jdet):
                _exec_dir = Path(current) / EXEC_SUBDIR
                return Path(current)  # the user's own JAX setting wins over jdet's default
            path = default_dir()
        else:
            path = Path(setting).expanduser()
        path.mkdir(parents=True, exist_ok=True)
        _exec_dir = path / EXEC_SUBDIR
        if current == str(path):
            return path
        jax.config.update("jax_compilation_cache_dir", str(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        cc.reset_cache()  # JAX checks "is the cache used" once per process: ask again
        _enabled_by_jdet = path
        return path


@dataclasses.dataclass(frozen=True)
class CompileStats:
    """Backend compilations of this process so far (persistent-cache loads included)."""

    compiles: int
    seconds: float
    cache_hits: int
    traces: int = 0  # jaxpr tracings (a jit's first call per shape; eager ops' too)
    lowerings: int = 0  # jaxpr -> MLIR lowerings
    trace_seconds: float = 0.0  # tracing + lowering


_counts = {"compiles": 0, "seconds": 0.0, "cache_hits": 0, "traces": 0, "lowerings": 0,
           "trace_seconds": 0.0}  # fmt: skip
_traced: dict[str, int] = {}
_installed = False


def _on_duration(event: str, duration: float, **kw: object) -> None:
    if event == BACKEND_COMPILE_EVENT:
        _counts["compiles"] += 1
        _counts["seconds"] += float(duration)
    elif event == TRACE_EVENT or event == LOWER_EVENT:
        _counts["traces" if event == TRACE_EVENT else "lowerings"] += 1
        _counts["trace_seconds"] += float(duration)
        if event == TRACE_EVENT:
            name = str(kw.get("fun_name", "?"))
            _traced[name] = _traced.get(name, 0) + 1


def _on_event(event: str, **_: object) -> None:
    if event == CACHE_HIT_EVENT:
        _counts["cache_hits"] += 1


def install_counter() -> None:
    """Register the jax.monitoring listeners (once per process)."""
    global _installed
    with _lock:
        if not _installed:
            jax.monitoring.register_event_duration_secs_listener(_on_duration)
            jax.monitoring.register_event_listener(_on_event)
            _installed = True


def stats() -> CompileStats:
    install_counter()
    c = _counts
    return CompileStats(
        c["compiles"], c["seconds"], c["cache_hits"], c["traces"], c["lowerings"],
        c["trace_seconds"],
    )  # fmt: skip


def traced() -> dict[str, int]:
    """Tracings of this process per function name (e.g. 'step', 'score')."""
    install_counter()
    return dict(_traced)
