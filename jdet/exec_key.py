"""The key of an executable cache entry (jdet/exec_cache.py), computed without tracing.

It must cover everything that can change the executable, since nothing checks the HLO: a wrong
hit would be a silent bug. What it covers, and why it is conservative, is in exec_cache's
docstring. Here: the argument signature (shapes, dtypes, shardings up to equivalence), the source
and runtime-code digests of jdet's packages, the environment, and the sha256 of it all.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import sys
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib

from jdet import version
from jdet.plan import backend
from pallas_kernels import kernel_backend

FORMAT = 1  # bump when the entry layout changes
PACKAGES = ("jdet", "pallas_kernels", "sharding", "serving")
CODE_PACKAGES = ("jdet", "pallas_kernels", "sharding")  # what a step's trace runs
_NOT_TRACED = (
    "jdet.__main__", "jdet.api", "jdet.cli", "jdet.train", "jdet.exec_cache", "jdet.exec_key",
)  # fmt: skip
_ENV_PREFIXES = ("XLA_", "JAX_", "JDET_")
_ENV_EXTRA = ("LIBTPU_INIT_ARGS", "NVIDIA_TF32_OVERRIDE")
_ENV_SKIP = ("JDET_CACHE_DIR", "JDET_WARMUP", "JDET_EXEC_CACHE", "JDET_EXEC_CACHE_MAX_BYTES")
_CONFIG_SKIP = ("compilation_cache", "persistent_cache")
# Modules only a Hopper GPU's kernels trace (pallas_kernels.matmul.resolve_backend gives
# "mosaic" on sm_90 alone). Off a GPU the runtime digest leaves them out instead of importing
# them: their import pulls in jax.experimental.pallas.mosaic_gpu, a slow import, in every
# `jdet generate` on a CPU (it keys its steps at their first call), and off a GPU no step can
# trace them, so no monkeypatch of theirs can change the executable. Their files are still in
# `source_hash`, and the platform is in the key.
_GPU_ONLY = (
    "pallas_kernels.allreduce_mosaic", "pallas_kernels.matmul_mosaic", "pallas_kernels.tree_mosaic",
)  # fmt: skip


# ---------------------------------------------------------------------- the key
def _leaf(x: Any) -> list:
    shape = tuple(int(d) for d in getattr(x, "shape", ()))
    dtype = str(getattr(x, "dtype", type(x).__name__))
    if isinstance(x, jax.Array):
        s = x.sharding
        p = _placement(s, x.ndim)  # up to equivalence: see _placement
        where = [str(p[0]), list(p[1])] if isinstance(p, tuple) else repr(s)
        mem = getattr(s, "memory_kind", None)
        return [shape, dtype, bool(getattr(x, "weak_type", False)), where, mem]
    if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:  # a warm-up's stand-in
        p = _placement(x.sharding, len(shape))
        where = [str(p[0]), list(p[1])] if isinstance(p, tuple) else repr(x.sharding)
        return [shape, dtype, bool(x.weak_type), where, getattr(x.sharding, "memory_kind", None)]
    return [shape, dtype, False, type(x).__name__, None]


def args_signature(args: Sequence[Any]) -> dict:
    leaves, tree = jax.tree_util.tree_flatten(tuple(args))
    return {"tree": str(tree), "leaves": [_leaf(x) for x in leaves]}


@functools.cache
def source_hash() -> str:
    """sha256 over every .py file (relative path and bytes) of jdet's packages, in path order."""
    h = hashlib.sha256()
    for pkg in PACKAGES:
        mod = sys.modules.get(pkg)
        if mod is None:
            try:
                mod = __import__(pkg)
            except Exception:  # noqa: BLE001 - a package this install lacks
                h.update(f"{pkg}:absent;".encode())
                continue
        root = Path(mod.__file__).parent
        for f in sorted(root.rglob("*.py")):
            h.update(f"{pkg}/{f.relative_to(root).as_posix()}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def _const_repr(c: Any) -> str:
    if isinstance(c, frozenset):  # iteration order follows string hashing: sort
        return "frozenset(" + ",".join(sorted(_const_repr(x) for x in c)) + ")"
    if isinstance(c, tuple):
        return "(" + ",".join(_const_repr(x) for x in c) + ")"
    return f"{type(c).__name__}:{c!r}"


def _code_digest(co: types.CodeType, h: Any) -> None:
    h.update(co.co_code)
    h.update(repr((co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars)).encode())
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _code_digest(c, h)
        else:
            h.update(_const_repr(c).encode())


def _callable_digest(obj: Any, h: Any, depth: int = 0) -> None:
    """What identifies a callable's behaviour: its type, home and code (through wrappers)."""
    h.update(f"{type(obj).__module__}.{type(obj).__qualname__}|".encode())
    h.update(f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', None)}|".encode())
    if isinstance(obj, staticmethod | classmethod):
        obj = obj.__func__
    if isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                _callable_digest(f, h, depth + 1)
        return
    if isinstance(obj, functools.partial):
        _callable_digest(obj.func, h, depth + 1)
        h.update(_const_repr(obj.args).encode() if _simple(obj.args) else b"args")
        return
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):
        _code_digest(code, h)
        for d in getattr(obj, "__defaults__", None) or ():
            h.update(_const_repr(d).encode() if _simple(d) else type(d).__name__.encode())
    wrapped = getattr(obj, "__wrapped__", None)
    if wrapped is not None and depth < 8:
        _callable_digest(wrapped, h, depth + 1)


def _simple(v: Any) -> bool:
    if isinstance(v, bool | int | float | str | bytes | type(None)):
        return True
    return isinstance(v, tuple | frozenset) and all(_simple(x) for x in v)


@functools.cache
def _code_modules() -> tuple[str, ...]:
    """Every module of the packages whose code a step can trace (from the files on disk), but the
    entry points; serving's code is never traced (its source is in `source_hash`)."""
    names = []
    for pkg in CODE_PACKAGES:
        try:
            root = Path(importlib.import_module(pkg).__file__).parent
        except Exception:  # noqa: BLE001
            continue
        for f in sorted(root.rglob("*.py")):
            parts = [pkg, *f.relative_to(root).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            name = ".".join(parts)
            if name not in _NOT_TRACED:
                names.append(name)
    return tuple(names)


def runtime_code_digest() -> str:
    """A digest of the code of jdet's traced packages as this process runs it: each module's
    functions, the methods of the classes it defines, and its UPPER_CASE constants. A monkeypatch
    (a test's batch-dependent attention, a changed tile size) or an edit made after import changes
    it. Every module is imported first, so the digest does not depend on what ran before (but
    `_GPU_ONLY`'s off a GPU)."""
    h = hashlib.sha256()
    skip = () if backend().gpu else _GPU_ONLY
    for name in _code_modules():
        if name in skip:
            h.update(f"\0module {name} not traced off a GPU\0".encode())
            continue
        try:
            mod = importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the same failure in every process
            h.update(f"\0module {name} unimportable: {type(e).__name__}\0".encode())
            continue
        h.update(f"\0module {name}\0".encode())
        for attr, obj in sorted(vars(mod).items()):
            if attr.startswith("__"):
                continue
            if isinstance(obj, type):
                if getattr(obj, "__module__", None) != name:
                    h.update(f"{attr}=class {obj.__module__}.{obj.__qualname__};".encode())
                    continue
                h.update(f"{attr}=class;".encode())
                for m, v in sorted(vars(obj).items()):
                    if callable(v) or isinstance(v, staticmethod | classmethod | property):
                        h.update(f"{m}:".encode())
                        _callable_digest(v, h)
                    elif m.isupper() and _simple(v):
                        h.update(f"{m}={_const_repr(v)};".encode())
            elif isinstance(obj, types.ModuleType):
                continue
            elif callable(obj):
                h.update(f"{attr}:".encode())
                _callable_digest(obj, h)
            elif attr.isupper() and _simple(obj):
                h.update(f"{attr}={_const_repr(obj)};".encode())
    return h.hexdigest()


def _config_values() -> dict[str, str]:
    vals = getattr(jax.config, "values", {}) or {}
    return {k: repr(v) for k, v in sorted(vals.items()) if not any(s in k for s in _CONFIG_SKIP)}


def _abstract_mesh() -> str:
    """The mesh context a trace would see (`jax.sharding.use_mesh`), if this JAX has one."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    try:
        return repr(get()) if get is not None else "?"
    except Exception:  # noqa: BLE001
        return "?"


_held: list[dict | None] = []  # `held_environment`'s value while one is open


@contextlib.contextmanager
def held_environment() -> Any:
    """Inside it, `environment()` is computed once and then reused. Why: it digests the code of
    every traced module (CPU time, holding the GIL), and a warm-up keys one entry per step
    shape and sampler in threads: a few seconds of a restart spent recomputing a value nothing
    can change while the warm-up runs (it monkeypatches nothing)."""
    _held.append(None)
    try:
        yield
    finally:
        _held.pop()


def environment() -> dict:
    """Everything outside the function and its arguments that the key covers (computed once
    inside `held_environment`)."""
    if _held:
        if _held[-1] is None:
            _held[-1] = _environment()
        return _held[-1]
    return _environment()


def _environment() -> dict:
    dev = jax.devices()[0]
    env = {
        k: v
        for k, v in sorted(os.environ.items())
        if (k.startswith(_ENV_PREFIXES) or k in _ENV_EXTRA) and k not in _ENV_SKIP
    }
    return {
        "jdet": version.__version__,  # read at call time: a patched version is another key
        "source": source_hash(),
        "code": runtime_code_digest(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "python": sys.version,
        "platform": dev.platform,
        "platform_version": getattr(dev.client, "platform_version", "?"),
        "device_kinds": sorted({d.device_kind for d in jax.devices()}),
        "device_count": jax.device_count(),
        "process": [jax.process_index(), jax.process_count()],
        "kernel_backend": kernel_backend(),
        "config": _config_values(),
        "abstract_mesh": _abstract_mesh(),
        "env": env,
    }


def key_parts(name: str, static: dict, devices: Sequence[Any], args: Sequence[Any]) -> dict:
    return {
        "format": FORMAT,
        "fn": name,
        "static": static,
        "devices": [[d.id, d.device_kind, d.platform] for d in devices],
        "args": args_signature(args),
        "env": environment(),
    }


def key_json(parts: dict) -> str:
    """The key parts as canonical JSON (an entry records them; a load compares them)."""
    return json.dumps(parts, sort_keys=True, default=repr)


def entry_key(parts: dict) -> str:
    return hashlib.sha256(key_json(parts).encode()).hexdigest()


# ---------------------------------------------------------------------- the wrapper
_placements: dict[Any, Any] = {}


def _placement(s: Any, ndim: int) -> Any:
    """A sharding up to equivalence: (HLO sharding, device order). A loaded executable returns
    its outputs under shardings rebuilt from the HLO (a 1-device mesh's P(None, 'tp') comes back
    as P()): equal placements, unequal objects, and the next step must still find its executable."""
    k = (s, ndim)
    p = _placements.get(k)
    if p is None:
        try:
            p = (s._to_xla_hlo_sharding(ndim), tuple(d.id for d in s._device_assignment))
        except Exception:  # noqa: BLE001 - private API moved: compare the objects themselves
            p = s
        if len(_placements) > 4096:
            _placements.clear()
        _placements[k] = p
    return p
