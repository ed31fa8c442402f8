"""What a cold `jdet generate` on a CPU must not pay for (issue 17): importing the Mosaic GPU
kernels, and compiling a small XLA program per weight shape while the model loads and the "tp"
runtime lays its weights and KV cache out. Each such compile cost 0.02-0.2 s of CPU (~0.6 s in
all on the 2-core machine, of a ~6 s command); the host (numpy) does the same copies instead.
The values and placements are those of the jnp versions (np.array_equal)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import dispatch, monitoring

from jdet import plan


@contextmanager
def backend_compiles() -> Iterator[list[float]]:
    """The XLA compiles (durations) JAX runs inside the block, with the persistent compilation
    cache off (the tests' cache is shared by the run's workers: a hit would hide a compile)."""
    seen: list[float] = []

    def listener(event: str, duration: float, **_: object) -> None:
        if event == dispatch.BACKEND_COMPILE_EVENT:
            seen.append(duration)

    cache_was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_enable_compilation_cache", cache_was)


def test_the_counter_sees_a_compile():
    """Control for the tests below: a jnp op on a concrete array of a shape this process has not
    compiled for is counted (what plan.pad_params did per FFN weight before)."""
    x = jnp.asarray(np.arange(7 * 13, dtype=np.float32).reshape(7, 13))
    with backend_compiles() as seen:
        jnp.pad(x, ((0, 0), (0, 5)))
    assert len(seen) >= 1


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the host path is the CPU's")
def test_loading_and_laying_out_the_embedded_model_compiles_nothing_on_a_cpu():
    import jdet
    from sharding.tp import make_tp_runtime

    with backend_compiles() as seen:
        model = jdet.load()
        rt = make_tp_runtime(model.params, model.cfg, 1, "tp")  # what `jdet generate` builds
        params, kv = rt.params, rt.init_kv(16, 16, jnp.bfloat16)
    assert seen == [], f"{len(seen)} XLA compiles while loading and laying out the model"
    assert jax.tree.leaves(params)
    jitted = jax.jit(
        lambda: {n: jnp.zeros(kv["k"].shape, kv["k"].dtype) for n in ("k", "v")},
        out_shardings={n: kv[n].sharding for n in ("k", "v")},
    )()
    for n in ("k", "v"):
        assert kv[n].sharding == jitted[n].sharding and kv[n].dtype == jitted[n].dtype
        assert np.array_equal(np.asarray(kv[n]), np.asarray(jitted[n]))


def test_host_pad_and_transpose_equal_the_jnp_ones():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 6, 10)).astype(jnp.bfloat16)
    widths = ((0, 0), (0, 0), (0, 6))
    for x in (w, jnp.asarray(w), jax.device_put(w, jax.devices()[0])):
        got = plan._pad(x, widths)
        assert isinstance(got, jax.Array) and got.dtype == jnp.bfloat16
        assert np.array_equal(np.asarray(got), np.asarray(jnp.pad(jnp.asarray(x), widths)))
        committed = isinstance(x, jax.Array) and x.committed
        assert got.committed == committed
        t = plan._transposed(x[0])
        assert np.array_equal(np.asarray(t), np.asarray(jnp.asarray(x[0]).T))
    # under jit (a tracer) the jnp ops run, and give the same values
    traced = jax.jit(lambda a: (plan._pad(a, widths), plan._transposed(a[0])))(jnp.asarray(w))
    assert np.array_equal(np.asarray(traced[0]), np.asarray(jnp.pad(jnp.asarray(w), widths)))
    assert np.array_equal(np.asarray(traced[1]), w[0].T)


def test_the_cli_path_does_not_import_the_mosaic_gpu_kernels_off_a_gpu():
    """Ops.row_pad (every forward trace) imported pallas_kernels.matmul_mosaic, and with it
    jax.experimental.pallas.mosaic_gpu (~0.3 s), before asking whether Mosaic runs at all. A
    fresh interpreter: this one may have imported them for another test."""
    from pallas_kernels import _platform

    mods = ["pallas_kernels.matmul_mosaic", "jax.experimental.pallas.mosaic_gpu"]
    code = (
        "import json, sys; from jdet.ops import Ops; "
        "rows = [Ops(invariance=m).row_pad(5) for m in ('tp', 'batch', 'none')]; "
        f"print(json.dumps([rows, [m for m in {mods!r} if m in sys.modules]]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    rows, imported = json.loads(out.stdout.strip().splitlines()[-1])
    if _platform.is_hopper():
        assert rows[0] == 64, rows  # padded to the Mosaic matmul's CTA rows
    else:
        assert rows == [5, 5, 5] and imported == [], (rows, imported)


def test_generate_prefills_in_decode_sized_chunks_on_a_cpu_unless_told_otherwise():
    """`jdet generate` on a CPU runs one step shape: the prompt in chunks of the smallest token
    bucket (chunked prefill has the same bits: tests/jdet/test_invariance.py), unless the budget
    is given or a speculative verify needs more tokens than one chunk."""
    from jdet.cli import _one_shape_budget
    from jdet.settings import EngineConfig
    from serving.engine.shapes import default_min_tokens_bucket

    on_cpu = jax.default_backend() == "cpu"
    got = _one_shape_budget(EngineConfig(), None).max_num_batched_tokens
    assert got == (default_min_tokens_bucket() if on_cpu else EngineConfig().max_num_batched_tokens)
    assert _one_shape_budget(EngineConfig(min_tokens_bucket=16), None).max_num_batched_tokens == (
        16 if on_cpu else EngineConfig().max_num_batched_tokens
    )
    told = EngineConfig(max_num_batched_tokens=64)
    assert _one_shape_budget(told, None) == told
    assert _one_shape_budget(EngineConfig(), object()) == EngineConfig()


def test_the_command_line_exits_at_once_with_its_output_flushed():
    """`jdet generate` from the command line ends with os._exit (jdet/cli.py `_exit_now`: the
    interpreter's and JAX's teardown cost ~0.45 s) after flushing its output; `main(argv)`
    called with arguments (tests, other programs) returns. Control: os._exit without the flush
    loses what a pipe's buffer held."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a buffered pipe
    code = "import sys; from jdet import cli; sys.stdout.write('last words'); cli._exit_now(3)"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert (run.returncode, run.stdout) == (3, "last words")
    bare = "import os, sys; sys.stdout.write('last words'); os._exit(3)"
    run = subprocess.run([sys.executable, "-c", bare], capture_output=True, text=True, env=env)
    assert (run.returncode, run.stdout) == (3, "")
