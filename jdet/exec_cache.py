"""jdet's executable cache: a restart loads each warmed step executable from disk, skipping the
tracing and lowering that JAX's persistent compilation cache cannot skip.

Why: with the XLA cache hit, a restart still traces and lowers every step shape before JAX can
look its HLO up (the XLA key is a hash of the lowered module), and lowering the Pallas Mosaic GPU
kernels is Python-heavy: a large share of a cold start (BENCHMARKS.md, benchmarks/ready_bench.py).
Here the step's compiled executable is serialized (`jax.experimental.serialize_executable`) under
a key jdet computes *without* tracing, and loaded back at the next warm-up.

Where: `<compile cache dir>/exec/<sha256>.jdetexe` (jdet/compile_cache.py: `$JDET_CACHE_DIR` or
~/.cache/jdet/xla); `--no-compile-cache` / `compile_cache=False` turns this off too, and so does
`JDET_EXEC_CACHE=0` alone (the XLA cache stays). Entries are written atomically (a temporary file,
then `os.replace`). Only warm-up reads or writes them (`prepare`); a shape met later runs the
plain jit, unless the engine's config sets `exec_cache_on_call` (`wrap(load_on_call=True)`), as
`jdet generate` does, which warms up nothing: each shape it meets is loaded, or compiled and
written, at its first call. Any error loading an entry is logged as a warning and the shape is
compiled the ordinary way (its entry rewritten); an entry whose recorded key parts differ from
this process's is refused the same way. Like JAX's own cache, an entry is trusted code: it is
unpickled.
Size: past `JDET_EXEC_CACHE_MAX_BYTES` (default 4 GiB) a write deletes the least recently used
entries (a load refreshes an entry's time) down to 3/4 of it, so entries of old jdet sources do
not pile up.

The key (computed in jdet/exec_key.py) must cover everything that can change the executable,
since nothing checks the HLO: a wrong hit would be a silent bug. So it is conservative (a change
anywhere below is a miss):
- the function: its name (e.g. sharding.tp.make_tp_step), the model config, invariance mode, TP
  size and mesh (axis names, device ids and kinds), as the caller describes it (`wrap`), and its
  XLA compiler options (`jdet_xla_options`, set by jdet/step.py jit_step);
- every argument leaf's shape, dtype, weak type and sharding (params, KV cache, batch, sampling
  inputs) and the argument tree structure: the step shape (T, S, Pmax), the KV pool, the params;
- jdet's version, a hash of every .py file of jdet, pallas_kernels, sharding and serving, and a
  digest of the code this process runs (every function and method of the modules of jdet,
  pallas_kernels and sharding, their UPPER_CASE constants): a monkeypatched kernel or tile size
  is another key;
- jax, jaxlib and Python versions, backend platform and platform version (CUDA/driver on a GPU),
  process count and index, the kernel backend (pallas_kernels.kernel_backend), every
  jax.config value but the cache settings, and the XLA_*/JAX_*/JDET_* environment variables
  (but $JDET_CACHE_DIR, JDET_WARMUP, JDET_EXEC_CACHE) plus LIBTPU_INIT_ARGS and
  NVIDIA_TF32_OVERRIDE.
Model weights are arguments, never constants, so one entry serves any checkpoint of the shapes.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax

from jdet import compile_cache
from jdet.exec_key import FORMAT, args_signature, entry_key, key_json, key_parts
from jdet.plan import backend

log = logging.getLogger("jdet.exec_cache")

SUFFIX = ".jdetexe"
MAX_BYTES = 4 << 30  # default size cap of the exec directory

_counts: dict[str, float] = {"loads": 0, "writes": 0, "errors": 0, "load_s": 0.0}
_lock = threading.Lock()


def stats() -> dict[str, float]:
    """Entries loaded and written by this process, entries refused (corrupt, stale, ...), and
    the seconds spent keying and loading entries."""
    return dict(_counts)


def enabled_by_env() -> bool:
    return os.environ.get("JDET_EXEC_CACHE", "1") != "0"


def _serializer() -> Any:
    """jax.experimental.serialize_executable, or None where it is missing or incomplete."""
    try:
        from jax.experimental import serialize_executable as se
    except Exception:  # noqa: BLE001 - any JAX without it
        return None
    if not (
        callable(getattr(se, "serialize", None))
        and callable(getattr(se, "deserialize_and_load", None))
    ):
        return None
    return se


# ---------------------------------------------------------------------- the wrapper
class CachedFn:
    """A jitted step/score function whose warmed shapes run a cached executable.

    Called like the jitted function. `warm(*args)` (warm-up only) loads the executable of the
    arguments' shape from the cache directory, or compiles it (lower + compile, the XLA cache
    still applies) and writes it there; later calls with that shape run it directly, other
    shapes the plain jit. With `load_on_call` a shape's first call warms it instead (loads the
    executable, or compiles and writes it), for a process that warms nothing up: its second run
    then neither traces nor lowers the shapes it meets. Attributes it lacks (`lower`, ...) are
    the jitted function's.
    `params_first`: the first argument is the weights, checked apart from the shapes (`_sig`);
    False for a function of activations only (the sampler), whose every argument is keyed.
    Warm-ups of one shape in several threads compile it once (the others wait for it)."""

    def __init__(
        self, fn: Callable, *, name: str, static: dict, devices: Sequence[Any], directory: Path,
        params_first: bool = True, load_on_call: bool = False,
    ) -> None:  # fmt: skip
        self.fn = fn
        self.load_on_call = load_on_call
        self.name = name
        self.static = static
        self.devices = list(devices)
        self.directory = Path(directory)
        self.params_first = params_first
        self._exes: dict[Any, Any] = {}
        self._params: Any = None  # the params object the executables were last checked against
        self._params_sig: Any = None
        self._shape_locks: dict[Any, threading.Lock] = {}

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.fn, attr)

    def _sig(self, args: Sequence[Any]) -> Any:
        """The in-memory lookup key: the tree, shapes and dtypes of all but the params (checked
        apart). Not the placements: hashing a fresh output's sharding on every step cost more
        than the rest, and an executable never runs on misplaced inputs (a committed array on
        other devices is an error, a host array is placed as the executable wants); the engine's
        placements are fixed when it is built. The disk key does cover placements."""
        leaves, tree = jax.tree_util.tree_flatten(tuple(args[1:] if self.params_first else args))
        return tree, tuple((x.shape, x.dtype) for x in leaves)

    def _params_ok(self, params: Any) -> bool:
        if not self.params_first or params is self._params:
            return True
        if self._params_sig is not None and args_signature([params]) == self._params_sig:
            self._params = params  # new weights of the same shapes and placement (RL updates)
            return True
        return False

    def __call__(self, *args: Any) -> Any:
        if self._exes and self._params_ok(args[0]):
            exe = self._exes.get(self._sig(args))
            if exe is not None:
                return exe(*args)
        if self.load_on_call:  # warm this shape now, then run its executable
            self.warm(*args)
            return self._exes[self._sig(args)](*args)
        return self.fn(*args)

    def warm(self, *args: Any) -> str:
        """Make the executable of `args`' shape ready: 'loaded', 'compiled' (and written), or
        'memory' (already here)."""
        if self._params_sig is not None and not self._params_ok(args[0]):
            self._exes.clear()  # other params shapes: the old executables no longer apply
        sig = self._sig(args)
        with _lock:
            shape_lock = self._shape_locks.setdefault(sig, threading.Lock())
        with shape_lock:  # another thread warming this shape: wait for its executable
            if sig in self._exes:
                return "memory"
            return self._warm(sig, args)

    def compiled(self, *args: Any) -> Any:
        """The executable of `args`' shape, warmed first (`warm`): what the engine sizes its
        memory from (serving/engine/memory.py), the same executable the warm-up then runs."""
        self.warm(*args)
        return self._exes[self._sig(args)]

    def _warm(self, sig: Any, args: Sequence[Any]) -> str:
        t0 = time.perf_counter()
        # the function's XLA options (jdet/step.py jit_step): another option set, another
        # executable
        static = {**self.static, "xla_options": getattr(self.fn, "jdet_xla_options", None)}
        parts = key_parts(self.name, static, self.devices, args)
        path = self.directory / (entry_key(parts) + SUFFIX)
        exe, how = None, "compiled"
        if path.exists():
            try:
                exe = self._load(path, parts, args)
                how = "loaded"
                with _lock:
                    _counts["load_s"] += time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - any failure: compile as if it were absent
                with _lock:
                    _counts["errors"] += 1
                log.warning(
                    "jdet exec cache: could not use %s (%s: %s); compiling this shape instead",
                    path, type(e).__name__, e,
                )  # fmt: skip
        if exe is None:
            hits = compile_cache.stats().cache_hits
            exe = self.fn.lower(*args).compile()
            if compile_cache.stats().cache_hits > hits and backend().cpu:
                # An XLA:CPU executable that JAX's persistent compilation cache loaded (rather
                # than compiled) serializes, and even deserializes, but fails when run
                # ("NOT_FOUND: Function ... not found", JAX 0.10.2): write no entry a restart
                # would break on. The XLA cache still serves this shape on the next start.
                log.info("jdet exec cache: %s came from the XLA cache on a CPU; not written", path)
            else:
                self._write(path, parts, exe)
        self._exes[sig] = exe
        if self.params_first:
            self._params, self._params_sig = args[0], args_signature([args[0]])
        return how

    def _load(self, path: Path, parts: dict, args: Sequence[Any]) -> Any:
        se = _serializer()
        if se is None:
            raise RuntimeError("this JAX has no jax.experimental.serialize_executable")
        with open(path, "rb") as fh:
            entry = pickle.load(fh)
        if not isinstance(entry, dict) or entry.get("format") != FORMAT:
            raise ValueError(f"not a jdet exec cache entry of format {FORMAT}")
        if entry.get("parts") != key_json(parts):
            raise ValueError("the entry's recorded key differs from this process's")
        in_tree = jax.tree_util.tree_structure((tuple(args), {}))
        if entry["in_tree"] != in_tree:
            raise ValueError("the entry's argument structure differs")
        exe = se.deserialize_and_load(
            entry["payload"], entry["in_tree"], entry["out_tree"],
            execution_devices=self.devices,
        )  # fmt: skip
        with _lock:
            _counts["loads"] += 1
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass
        return exe

    def _write(self, path: Path, parts: dict, exe: Any) -> None:
        se = _serializer()
        try:
            if se is None:
                raise RuntimeError("this JAX has no jax.experimental.serialize_executable")
            payload, in_tree, out_tree = se.serialize(exe)
            buf = io.BytesIO()
            pickle.dump(
                {"format": FORMAT, "parts": key_json(parts), "payload": payload,
                 "in_tree": in_tree, "out_tree": out_tree},
                buf, protocol=pickle.HIGHEST_PROTOCOL,
            )  # fmt: skip
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=SUFFIX)
            try:
                with os.fdopen(fd, "wb") as fh:
                    fh.write(buf.getvalue())
                os.replace(tmp, path)  # readers see the whole entry or none
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
            with _lock:
                _counts["writes"] += 1
            evict(path.parent)
        except Exception as e:  # noqa: BLE001 - the executable still serves this process
            log.warning(
                "jdet exec cache: could not write %s (%s: %s); a restart will trace this shape",
                path, type(e).__name__, e,
            )  # fmt: skip


def evict(directory: Path, max_bytes: int | None = None) -> int:
    """If the entries in `directory` exceed `max_bytes` (default `JDET_EXEC_CACHE_MAX_BYTES` or
    4 GiB), delete the least recently used (oldest mtime) down to 3/4 of it, and temporary files
    of writers dead for an hour. Returns how many entries were deleted."""
    if max_bytes is None:
        max_bytes = int(os.environ.get("JDET_EXEC_CACHE_MAX_BYTES") or MAX_BYTES)
    now, entries = time.time(), []
    for f in Path(directory).glob("*" + SUFFIX):
        try:
            st = f.stat()
        except OSError:
            continue  # deleted meanwhile
        if f.name.startswith(".tmp-"):
            if now - st.st_mtime > 3600:
                f.unlink(missing_ok=True)
            continue
        entries.append((st.st_mtime, st.st_size, f))
    total = sum(size for _, size, _ in entries)
    if total <= max_bytes:
        return 0
    removed = 0
    for _, size, f in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes * 3 // 4:
            break
        f.unlink(missing_ok=True)
        total -= size
        removed += 1
    return removed


def wrap(
    fn: Callable, *, name: str, static: dict, devices: Sequence[Any], directory: Path | None,
    params_first: bool = True, load_on_call: bool = False,
) -> Callable:  # fmt: skip
    """`fn` behind the executable cache in `directory`, or `fn` itself when the cache is off
    (no directory, JDET_EXEC_CACHE=0, or a JAX without executable serialization).
    `load_on_call`: each shape is loaded (or compiled and written) at its first call, not only
    at warm-up (CachedFn)."""
    if directory is None or not enabled_by_env() or _serializer() is None:
        return fn
    if not callable(getattr(fn, "lower", None)):
        return fn  # not a jitted function
    return CachedFn(fn, name=name, static=static, devices=devices, directory=directory,
                    params_first=params_first, load_on_call=load_on_call)  # fmt: skip


def prepare(fn: Callable, *args: Any) -> str | None:
    """Warm-up's hook: load or compile `args`' shape if `fn` is cached (a CachedFn, or a wrapper
    with its own `warm`: serving/host_inputs.PackedStep); None for a plain jit."""
    warm = getattr(type(fn), "warm", None)  # on the type: CachedFn forwards unknown attributes
    return warm(fn, *args) if warm is not None else None
