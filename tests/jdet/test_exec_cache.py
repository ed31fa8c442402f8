"""jdet's executable cache (jdet/exec_cache.py) on a toy jitted step: a second process's warm-up
loads the executable instead of tracing it, with the same bits; a corrupt entry falls back to a
compile with a warning; the key moves with every input that changes the executable.

The two-process test on the model is tests/serving/engine/test_compile.py (restart test)."""

from __future__ import annotations

import functools
import importlib
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet import compile_cache, exec_cache, exec_key


def toy_step(params, kv, batch, extra):
    """A step-shaped function: the 'cache' is donated and updated, a sum is taken over rows."""
    kv = {"k": kv["k"] + batch["x"][:, None] * params["w"][0]}
    return kv, (jnp.tanh(kv["k"] @ params["w"]) * extra).sum(axis=0)


@pytest.fixture(autouse=True)
def _no_xla_persistent_cache(monkeypatch):
    """These tests exercise jdet's executable cache alone: an earlier test (or another pytest-xdist
    process) may have enabled JAX's persistent compilation cache and put the toy step in it, and
    on a CPU an executable loaded from there is not written (jdet/exec_cache.py `warm`)."""
    from jax._src import compilation_cache

    monkeypatch.setattr(compilation_cache, "is_cache_used", lambda backend: False)


def fresh_jit():
    # a new jit object each time: nothing in memory carries over, as in a new process
    return jax.jit(functools.partial(toy_step), donate_argnums=(1,))


def args(n=8, d=16, seed=0):
    rng = np.random.default_rng(seed)
    params = {"w": jnp.asarray(rng.standard_normal((d, d)), jnp.float32)}
    kv = {"k": jnp.asarray(rng.standard_normal((n, d)), jnp.float32)}
    batch = {"x": rng.standard_normal(n).astype(np.float32)}
    return params, kv, batch, rng.standard_normal(d).astype(np.float32)


def wrapped(directory, name="toy", static=None, load_on_call=False):
    return exec_cache.wrap(
        fresh_jit(), name=name, static=static or {"cfg": "toy"}, devices=jax.devices()[:1],
        directory=directory, load_on_call=load_on_call,
    )  # fmt: skip


def traces() -> int:
    return compile_cache.traced().get("toy_step", 0)


def test_a_second_start_loads_the_executable_without_tracing(tmp_path):
    compile_cache.install_counter()
    _, plain = fresh_jit()(*args())
    first = wrapped(tmp_path)
    assert isinstance(first, exec_cache.CachedFn)
    assert first.warm(*args()) == "compiled"
    assert len(list(tmp_path.glob("*" + exec_cache.SUFFIX))) == 1
    _, want = first(*args())

    before, loads = traces(), exec_cache.stats()["loads"]
    second = wrapped(tmp_path)  # a new function object: what a restart has
    assert second.warm(*args()) == "loaded"
    assert traces() == before and exec_cache.stats()["loads"] == loads + 1
    _, got = second(*args())
    assert traces() == before  # the warmed shape runs the loaded executable, no jit
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(plain))

    # Negative control: the trace counter sees a start that finds no entry.
    third = wrapped(tmp_path / "elsewhere")
    assert third.warm(*args()) == "compiled" and traces() == before + 1
    # ... and a shape nobody warmed takes the plain jit (traced)
    second(*args(n=4))
    assert traces() == before + 2


def test_load_on_call_writes_then_loads_the_shapes_a_process_meets(tmp_path):
    """`jdet generate`'s mode (EngineConfig.exec_cache_on_call): no warm-up; the first call of a
    shape writes its entry, and the next process's first call loads it (no trace), with the same
    bits."""
    compile_cache.install_counter()
    _, want = fresh_jit()(*args())
    # no warm(): the call itself compiles and writes
    _, got = wrapped(tmp_path, load_on_call=True)(*args())
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert len(list(tmp_path.glob("*" + exec_cache.SUFFIX))) == 1
    before, loads = traces(), exec_cache.stats()["loads"]
    _, got = wrapped(tmp_path, load_on_call=True)(*args())  # a restart
    assert traces() == before and exec_cache.stats()["loads"] == loads + 1
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # Negative control: without load_on_call the same call runs the plain jit (traced, nothing
    # loaded), as every caller but `jdet generate` does.
    wrapped(tmp_path)(*args())
    assert traces() == before + 1 and exec_cache.stats()["loads"] == loads + 1


def test_a_corrupt_entry_falls_back_to_a_compile_with_a_warning(tmp_path, caplog):
    wrapped(tmp_path).warm(*args())
    (entry,) = tmp_path.glob("*" + exec_cache.SUFFIX)
    for junk in (b"not a pickle", entry.read_bytes()[: entry.stat().st_size // 2]):
        entry.write_bytes(junk)
        fn = wrapped(tmp_path)
        errors = exec_cache.stats()["errors"]
        with caplog.at_level(logging.WARNING, logger="jdet.exec_cache"):
            assert fn.warm(*args()) == "compiled"
        assert exec_cache.stats()["errors"] == errors + 1
        assert "could not use" in caplog.text and entry.name in caplog.text
        caplog.clear()
        _, got = fn(*args())
        _, want = fresh_jit()(*args())
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert wrapped(tmp_path).warm(*args()) == "loaded"  # the entry was rewritten whole


def test_the_key_changes_when_anything_that_changes_the_executable_does(monkeypatch):
    dev = jax.devices()[:1]

    def key(name="toy", static=None, a=None, devices=dev):
        parts = exec_key.key_parts(name, static or {"cfg": "toy"}, devices, a or args())
        return exec_key.entry_key(parts)

    base = key()
    assert key() == base  # stable
    p, kv, b, e = args()
    changed = {
        "function": key(name="other"),
        "config": key(static={"cfg": "toy2"}),
        "batch shape": key(a=args(n=4)),
        "cache shape": key(a=(p, {"k": jnp.zeros((8, 17), jnp.float32)}, b, e)),
        "params dtype": key(a=({"w": p["w"].astype(jnp.bfloat16)}, kv, b, e)),
        "batch dtype": key(a=(p, kv, {"x": b["x"].astype(np.float16)}, e)),
        "tree": key(a=(p, kv, {"x": b["x"], "y": b["x"]}, e)),
    }
    if len(jax.devices()) > 1:
        other = jax.devices()[1]
        changed["devices"] = key(devices=[other])
        changed["placement"] = key(a=(jax.device_put(p, other), kv, b, e))
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
        changed["XLA_FLAGS"] = key()
    with monkeypatch.context() as m:
        m.setenv("JDET_PALLAS_INTERPRET", "1")
        changed["a JDET_ variable"] = key()
    with jax.default_matmul_precision("highest"):
        changed["jax config"] = key()
    import jdet.ops
    import jdet.version

    rms = importlib.import_module("pallas_kernels.rms_norm")  # the package's name is the function

    with monkeypatch.context() as m:
        m.setattr(rms, "rms_norm", lambda x, w, eps: x)  # a patched kernel (tests do this)
        changed["patched kernel"] = key()
    with monkeypatch.context() as m:
        m.setattr(jdet.ops.Ops, "attention", lambda self, *a: None)  # a patched method
        changed["patched method"] = key()
    with monkeypatch.context() as m:
        m.setattr(jdet.version, "__version__", "9.9.9")
        changed["jdet version"] = key()
    with monkeypatch.context() as m:
        m.setattr(exec_key, "source_hash", lambda: "edited")
        changed["source files"] = key()
    for what, k in changed.items():
        assert k != base, f"the key ignores the {what}"
    assert key() == base  # every change undone: the same key again

    # What does not change the executable does not move the key (no needless misses).
    with monkeypatch.context() as m:
        m.setenv("JDET_CACHE_DIR", "/somewhere/else")
        m.setenv("JDET_WARMUP", "0")
        assert key() == base
    assert key(a=args(seed=1)) == base  # other values of the same shapes (new weights)


def test_off_with_the_compile_cache_or_its_own_switch(tmp_path, monkeypatch):
    fn = fresh_jit()
    assert exec_cache.wrap(fn, name="t", static={}, devices=[], directory=None) is fn
    monkeypatch.setenv("JDET_EXEC_CACHE", "0")
    assert exec_cache.wrap(fn, name="t", static={}, devices=[], directory=tmp_path) is fn
    monkeypatch.delenv("JDET_EXEC_CACHE")
    assert exec_cache.prepare(fn, *args()) is None  # warm-up's hook ignores a plain jit
    prev = jax.config.jax_compilation_cache_dir
    try:
        assert compile_cache.enable(tmp_path / "xla") == tmp_path / "xla"
        assert compile_cache.exec_dir() == tmp_path / "xla" / "exec"
        compile_cache.enable(False)
        assert compile_cache.exec_dir() is None
    finally:
        compile_cache.enable(prev or True)


def test_new_weights_keep_the_executable_other_dtypes_do_not(tmp_path):
    fn = wrapped(tmp_path)
    p, kv, b, e = args()
    compile_cache.install_counter()
    fn.warm(p, kv, b, e)
    new = {"w": p["w"] + 1}  # new weights, same shapes: still the cached executable
    before = traces()
    fn(new, *args()[1:])
    assert traces() == before
    wide = {"w": jnp.zeros((16, 16), jnp.bfloat16)}  # another dtype: the plain jit
    fn(wide, *args()[1:])
    assert traces() == before + 1


def test_the_directory_is_capped_least_recently_used_first(tmp_path, monkeypatch):
    import os

    entry = {}
    for age, n in enumerate((2, 4, 8)):
        before = set(tmp_path.glob("*" + exec_cache.SUFFIX))
        wrapped(tmp_path).warm(*args(n=n))
        (entry[n],) = set(tmp_path.glob("*" + exec_cache.SUFFIX)) - before
        os.utime(entry[n], (1000 + age, 1000 + age))  # n=2 the oldest, then 4, then 8
    assert wrapped(tmp_path).warm(*args(n=2)) == "loaded"  # n=2 used again: now the newest
    size = {n: f.stat().st_size for n, f in entry.items()}
    assert exec_cache.evict(tmp_path, max_bytes=sum(size.values())) == 0  # at the cap: kept
    cap = sum(size.values()) - 1  # past it: down to 3/4, least recently used first
    assert exec_cache.evict(tmp_path, max_bytes=cap) >= 1
    assert not entry[4].exists() and entry[2].exists()
    left = [n for n, f in entry.items() if f.exists()]
    assert sum(size[n] for n in left) <= cap * 3 // 4
    # a write past the cap trims by itself
    monkeypatch.setenv("JDET_EXEC_CACHE_MAX_BYTES", "1")
    wrapped(tmp_path).warm(*args(n=16))
    assert list(tmp_path.glob("*" + exec_cache.SUFFIX)) == []


def test_the_key_imports_the_mosaic_gpu_kernels_on_a_gpu_only():
    """Off a GPU the runtime digest leaves out the modules only a Hopper GPU traces
    (exec_key._GPU_ONLY): keying a CPU `jdet generate`'s step no longer imports
    jax.experimental.pallas.mosaic_gpu (~0.5 s of CPU). On a GPU it must import and digest
    them. A fresh interpreter: this one may have imported them for another test."""
    import json
    import subprocess
    import sys

    from pallas_kernels import _platform

    gpu_only = ["jax.experimental.pallas.mosaic_gpu", *exec_key._GPU_ONLY]
    code = (
        "import json, sys; from jdet import exec_key; exec_key.runtime_code_digest(); "
        f"print(json.dumps([m for m in {gpu_only!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imported = json.loads(out.stdout.strip().splitlines()[-1])
    if _platform.platform() == "gpu":
        assert len(imported) == len(gpu_only), imported
    else:
        assert imported == [], imported


def test_threads_warming_one_shape_compile_it_once(tmp_path):
    """Warm-up's threads may meet one shape at once (a step of two programs shares its forward
    between sampler variants): the first compiles, the others wait and find it made. Control: a
    second shape is compiled by its own warm."""
    from concurrent.futures import ThreadPoolExecutor

    compile_cache.install_counter()
    fn, a = wrapped(tmp_path), args()
    before = traces()
    with ThreadPoolExecutor(4) as pool:
        hows = list(pool.map(lambda _: fn.warm(*a), range(4)))
    assert sorted(hows) == ["compiled", "memory", "memory", "memory"]
    assert traces() == before + 1
    assert fn.warm(*args(n=4)) == "compiled" and traces() == before + 2  # the control


def test_a_function_of_activations_is_keyed_by_every_argument(tmp_path):
    """params_first=False (the sampler): the first argument is data like the rest, so another
    shape of it is another executable, and the same shape with other values runs the same one."""
    fn = exec_cache.wrap(
        jax.jit(lambda x, y: jnp.tanh(x) @ y), name="act", static={}, devices=jax.devices()[:1],
        directory=tmp_path, params_first=False,
    )  # fmt: skip
    x, y = np.ones((4, 8), np.float32), np.ones((8, 2), np.float32)
    assert fn.warm(jax.ShapeDtypeStruct(x.shape, x.dtype), y) == "compiled"
    assert fn.warm(x * 2, y) == "memory"  # the abstract stand-in made the same executable
    assert fn.warm(np.ones((2, 8), np.float32), y) == "compiled"
    np.testing.assert_array_equal(np.asarray(fn(x, y)), np.asarray(jnp.tanh(x) @ y))
