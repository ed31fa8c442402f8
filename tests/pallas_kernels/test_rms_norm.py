"""rms_norm: accuracy, every element written, row bits independent of the row count.

On CPU the kernel runs in interpret mode, where Pallas starts every output buffer as NaN: a finite
result therefore proves every element was written (the poison check).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.rms_norm import rms_norm, rms_norm_reference

T_SIZES = (1, 2, 3, 17, 64, 130)


def _rand(key: int, shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 1500), (jnp.float32, 96)])
def test_rms_norm_matches_float64_and_writes_every_element(dtype, d):
    x, w = _rand(0, (19, d), dtype) * 3, _rand(1, (d,), dtype)
    out = rms_norm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == jnp.dtype(dtype)
    got = np.asarray(out, np.float64)
    assert np.isfinite(got).all()
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    ref = w64 * x64 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + 1e-6)
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5  # two bf16 roundings (HF's rounding points)
    assert np.abs(got - ref).max() / np.abs(ref).max() < tol
    ref_j = np.asarray(rms_norm_reference(x, w, 1e-6), np.float64)
    assert np.abs(ref_j - ref).max() / np.abs(ref).max() < tol


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 1500), (jnp.float32, 2048)])
def test_rms_norm_row_bits_do_not_depend_on_row_count(dtype, d):
    x, w = _rand(2, (max(T_SIZES), d), dtype), _rand(3, (d,), dtype)
    full = np.asarray(rms_norm(x, w).astype(jnp.float32))
    for t in T_SIZES:
        assert np.array_equal(np.asarray(rms_norm(x[:t], w).astype(jnp.float32)), full[:t]), t


def test_xla_row_sum_negative_control():
    """Whether XLA's own sum(x*x, -1) of row 0 depends on the row count on this backend."""
    x = _rand(4, (300, 4096), jnp.float32)
    f = jax.jit(lambda v: jnp.sum(v * v, axis=-1))
    row0 = np.asarray(f(x[:1]))[0]
    differs = [b for b in (2, 3, 7, 17, 64, 130, 300) if np.asarray(f(x[:b]))[0] != row0]
    if not differs:
        pytest.skip(f"XLA's row sum is batch invariant on {jax.default_backend()} (measured)")
    w = _rand(5, (4096,), jnp.float32)
    assert np.array_equal(
        np.asarray(rms_norm(x[:1], w))[0], np.asarray(rms_norm(x[: differs[0]], w))[0]
    )


@pytest.mark.gpu
def test_gpu_rms_norm_row_bits_do_not_depend_on_row_count():
    x, w = _rand(6, (8192, 4096), jnp.bfloat16), _rand(7, (4096,), jnp.bfloat16)
    full = np.asarray(rms_norm(x, w).astype(jnp.float32))
    assert np.isfinite(full).all()
    for t in (1, 2, 7, 130, 1000, 8192):
        assert np.array_equal(np.asarray(rms_norm(x[:t], w).astype(jnp.float32)), full[:t]), t


@pytest.mark.gpu
def test_gpu_xla_row_sum_batch_dependence_is_recorded():
    """Negative control: whether XLA's sum(x*x, -1) of row 0 changes with B on this GPU."""
    x = _rand(8, (8192, 4096), jnp.float32)
    f = jax.jit(lambda v: jnp.sum(v * v, axis=-1))
    row0 = np.asarray(f(x[:1]))[0]
    if all(np.asarray(f(x[:b]))[0] == row0 for b in (2, 7, 64, 1000, 8192)):
        # Measured on an H100 with jax 0.11.2 for this f32 [B, 4096] input: no change.
        pytest.skip("XLA's f32 row sum of row 0 did not change with B here (measured)")
