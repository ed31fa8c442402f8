"""log_softmax / logsumexp: accuracy, every element written, batch invariance.

On CPU the kernels run in interpret mode (JDET_PALLAS_INTERPRET=1, set by conftest),
where Pallas starts every output buffer as NaN: a finite
result therefore proves every element was written (the poison check).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.vocab import (
    log_softmax,
    log_softmax_reference,
    logsumexp,
    logsumexp_reference,
)
from tests.pallas_kernels.variants import chunked_sum_by_rows, first_row_changes

N_SIZES = (1, 2, 3, 17, 64, 130)


def _logits(key: int, shape: tuple[int, ...], dtype=jnp.float32) -> jax.Array:
    """Normal samples made by numpy (bf16 by ml_dtypes), then put on the device. Why not
    jax.random: on a CPU each new shape of jax.random.normal and of its cast is an XLA compile."""
    x = 4 * np.random.default_rng(key).standard_normal(shape, np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def _lse64(x) -> np.ndarray:
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]


@pytest.mark.parametrize("dtype,v", [(jnp.float32, 5000), (jnp.bfloat16, 4096)])
def test_log_softmax_and_logsumexp_match_float64(dtype, v):
    x = _logits(0, (9, v), dtype)
    lse, ls = logsumexp(x), log_softmax(x)
    assert lse.dtype == jnp.float32 and ls.dtype == jnp.float32 and ls.shape == (9, v)
    assert np.isfinite(np.asarray(ls)).all() and np.isfinite(np.asarray(lse)).all()
    ref = _lse64(x)
    assert np.abs(np.asarray(lse, np.float64) - ref).max() < 1e-5 * np.abs(ref).max()
    ref_ls = np.asarray(x, np.float64) - ref[:, None]
    assert np.abs(np.asarray(ls, np.float64) - ref_ls).max() < 1e-5 * np.abs(ref_ls).max()
    assert np.allclose(logsumexp_reference(x), ref, rtol=1e-5)
    assert np.allclose(log_softmax_reference(x), ref_ls, rtol=1e-5, atol=1e-4)


def test_vocab_row_bits_do_not_depend_on_batch_size():
    x = _logits(1, (max(N_SIZES), 5000))  # 3 blocks of 2048, the last one ragged
    full_lse, full_ls = np.asarray(logsumexp(x)), np.asarray(log_softmax(x))
    for n in N_SIZES:
        assert np.array_equal(np.asarray(logsumexp(x[:n])), full_lse[:n]), n
        assert np.array_equal(np.asarray(log_softmax(x[:n])), full_ls[:n]), n


def test_multi_chunk_rows_with_all_inf_chunks():
    """V over several pass-1 chunks (the last ragged), a row whose first chunks are all -inf (the
    top-p filter's masked logits): finite where the logit is, -inf where it is not, float64
    accuracy, and the rows' bits independent of N."""
    from pallas_kernels.vocab import num_chunks

    v = 20000
    assert num_chunks(v) == 3
    x = _logits(6, (5, v)).at[1, : v - 100].set(-jnp.inf)
    ls, lse = np.asarray(log_softmax(x)), np.asarray(logsumexp(x))
    fin = np.isfinite(np.asarray(x))
    assert np.isneginf(ls[~fin]).all() and np.isfinite(ls[fin]).all()
    ref = _lse64(np.where(fin, np.asarray(x, np.float64), -np.inf))
    assert np.abs(lse - ref).max() < 1e-5 * np.abs(ref).max()
    err = np.abs(ls - (np.asarray(x, np.float64) - ref[:, None]))[fin]
    assert err.max() < 1e-5 * np.abs(ls[fin]).max()
    for n in (1, 2, 3):
        assert np.array_equal(np.asarray(log_softmax(x[:n])), ls[:n]), n
        assert np.array_equal(np.asarray(logsumexp(x[:n])), lse[:n]), n


def _near_zero_lse(x: jax.Array) -> jax.Array:
    """Rows shifted so that their logsumexp is ~0.3: there an ulp of the result (3e-8) is finer
    than the ~1e-7 relative change a reordered sum makes, which near lse ~ 15 would round away."""
    return x - jnp.asarray(_lse64(x), jnp.float32)[:, None] + 0.3


def _chunked_lse(x: jax.Array) -> jax.Array:
    """logsumexp whose exp-sum is chunked by the row count (the negative control's variant)."""
    m = jnp.max(x, axis=-1)
    return m + jnp.log(chunked_sum_by_rows(jnp.exp(x - m[:, None])))


def test_negative_control_a_batch_dependent_logsumexp_changes_row_bits():
    """The row comparison can fail: XLA's own logsumexp (where it follows the batch size on this
    backend) or else a sum chunked by the row count changes row 0; ours does not."""
    x = _near_zero_lse(_logits(2, (300, 8192)))
    sizes = (2, 3, 7, 17, 64, 130, 300)
    differs = first_row_changes(jax.jit(logsumexp_reference), x, sizes)
    differs = differs or first_row_changes(jax.jit(_chunked_lse), x, sizes)
    assert differs, "neither XLA's logsumexp nor the chunked variant changed row 0"
    assert np.asarray(logsumexp(x[:1]))[0] == np.asarray(logsumexp(x[: differs[0]]))[0]


@pytest.mark.gpu
def test_gpu_vocab_row_bits_do_not_depend_on_batch_size():
    x = _logits(4, (256, 151936))
    full_lse, full_ls = np.asarray(logsumexp(x)), np.asarray(log_softmax(x))
    assert np.isfinite(full_ls).all()
    assert np.abs(full_lse - _lse64(x)).max() < 1e-4
    for n in (1, 2, 7, 64, 256):
        assert np.array_equal(np.asarray(logsumexp(x[:n])), full_lse[:n]), n
        assert np.array_equal(np.asarray(log_softmax(x[:n])), full_ls[:n]), n


@pytest.mark.gpu
def test_gpu_xla_logsumexp_batch_dependence_is_recorded():
    """Negative control on the GPU: XLA's logsumexp of row 0 changes with N, or else the chunked
    variant does; either way the comparison is shown to fail, and ours holds."""
    x = _near_zero_lse(_logits(5, (256, 151936)))
    sizes = (2, 7, 64, 256)
    differs = first_row_changes(jax.jit(logsumexp_reference), x, sizes)
    print("XLA logsumexp: row 0 changed at N =", differs, "on", jax.devices()[0])
    differs = differs or first_row_changes(jax.jit(_chunked_lse), x, sizes)
    assert differs, "neither XLA's logsumexp nor the chunked variant changed row 0"
    assert np.asarray(logsumexp(x[:1]))[0] == np.asarray(logsumexp(x[: differs[0]]))[0]
