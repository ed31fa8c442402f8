"""matmul (BIO): accuracy, every element written, rows independent of M, negative control.

On CPU the kernels run in interpret mode (JDET_PALLAS_INTERPRET=1, set by conftest),
where Pallas starts every output buffer as NaN: a finite
result therefore proves every element was written (the poison check).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import matmul, matmul_reference
from tests.pallas_kernels.variants import first_row_changes, split_k_by_m

M_SIZES = (1, 2, 3, 17, 64, 130)


def _rand(key: int, shape: tuple[int, ...], dtype) -> jax.Array:
    return jax.random.normal(jax.random.PRNGKey(key), shape, jnp.float32).astype(dtype)


def _rel_err(out: jax.Array, a: jax.Array, b: jax.Array) -> float:
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize(
    "dtype,k,n,tol",
    [
        (jnp.bfloat16, 192, 40, 8e-3),  # 3 K tiles of 64, odd N
        (jnp.float32, 160, 33, 1e-5),  # 5 K tiles of 32, odd N
        (jnp.bfloat16, 100, 130, 8e-3),  # ragged K (padded tile) and two N blocks
    ],
)
def test_matmul_matches_float64_and_writes_every_element(dtype, k, n, tol):
    a, b = _rand(0, (70, k), dtype), _rand(1, (k, n), dtype)
    out = matmul(a, b)
    assert out.shape == (70, n) and out.dtype == jnp.dtype(dtype)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, a, b) < tol
    out32 = matmul(a, b, jnp.float32)
    assert out32.dtype == jnp.float32 and _rel_err(out32, a, b) < (
        1e-5 if dtype == jnp.float32 else 1e-3
    )


@pytest.mark.parametrize("dtype,k,n", [(jnp.bfloat16, 192, 40), (jnp.float32, 160, 33)])
def test_matmul_row_bits_do_not_depend_on_batch_size(dtype, k, n):
    a, b = _rand(2, (max(M_SIZES), k), dtype), _rand(3, (k, n), dtype)
    full = np.asarray(matmul(a, b, jnp.float32))
    for m in M_SIZES:
        part = np.asarray(matmul(a[:m], b, jnp.float32))
        assert np.array_equal(part, full[:m]), f"rows changed at M={m}"


def test_negative_control_a_batch_dependent_matmul_changes_row_bits():
    """The row comparison can fail: XLA's own f32 dot (where it follows M on this backend) or
    else a split-K chosen from M changes row 0 with M; ours does not on the same data."""
    a, b = _rand(4, (300, 512), jnp.float32), _rand(5, (512, 96), jnp.float32)
    dot = jax.jit(lambda x, y: jnp.dot(x, y, precision=jax.lax.Precision.HIGHEST))
    sizes = (2, 3, 17, 64, 130, 300)
    differs = first_row_changes(lambda x: dot(x, b), a, sizes)
    differs = differs or first_row_changes(lambda x: split_k_by_m(x, b), a, sizes)
    assert differs, "neither XLA's dot nor the split-K variant changed row 0 with M"
    ours = [np.asarray(matmul(a[:m], b))[0] for m in (1, differs[0])]
    assert np.array_equal(ours[0], ours[1])


def test_matmul_reference_matches_float64():
    a, b = _rand(6, (9, 64), jnp.float32), _rand(7, (64, 11), jnp.float32)
    assert _rel_err(matmul_reference(a, b), a, b) < 1e-5


def test_matmul_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="a\\[M, K\\] @ b\\[K, N\\]"):
        matmul(jnp.ones((2, 3)), jnp.ones((4, 5)))


# ---------------------------------------------------------------- GPU (compiled, realistic shapes)
GPU_M = (1, 7, 128, 256, 1000, 8192)


@pytest.mark.gpu
def test_gpu_xla_bf16_matmul_is_not_batch_invariant():
    """Negative control: XLA's bf16 `a[:M] @ b` changes row 0 as M grows (measured: M >= 256)."""
    a, b = _rand(10, (8192, 4096), jnp.bfloat16), _rand(11, (4096, 6144), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    row0 = np.asarray(f(a[:1], b)[0].astype(jnp.float32))
    differs = [
        m
        for m in GPU_M[1:]
        if not np.array_equal(np.asarray(f(a[:m], b)[0].astype(jnp.float32)), row0)
    ]
    assert differs, "XLA's bf16 matmul was batch invariant at every M (unexpected on a GPU)"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "pallas"])
@pytest.mark.parametrize("k,n", [(4096, 6144), (12288, 4096), (2048, 1024)])
def test_gpu_matmul_row_bits_do_not_depend_on_batch_size(backend, k, n):
    """M = 1 and 7 run on the Mosaic kernel's 64-row decode CTAs, M >= 128 on 128-row CTAs: the
    rows must not see the difference."""
    a, b = _rand(12, (8192, k), jnp.bfloat16), _rand(13, (k, n), jnp.bfloat16)
    full = np.asarray(matmul(a, b, backend=backend).astype(jnp.float32))
    assert np.isfinite(full).all()
    assert _rel_err(full[:256], a[:256], b) < 8e-3
    for m in GPU_M:
        part = np.asarray(matmul(a[:m], b, backend=backend).astype(jnp.float32))
        assert np.array_equal(part, full[:m]), f"rows changed at M={m} ({backend})"


@pytest.mark.gpu
@pytest.mark.parametrize("cta_n,tile_k", [(64, 64), (64, 128), (128, 128), (128, 64)])
def test_gpu_decode_cta_width_and_k_step_keep_the_bits(cta_n, tile_k):
    """The decode CTA (64 rows) holds one or two 64 x 64 warpgroup accumulators side by side
    (`DecodeTiles.cta_n`) and takes `DecodeTiles.tile_k` columns of K per pipeline step: each
    only moves work between CTAs or groups the same sequence of K=16 wgmma instructions into
    fewer pipeline steps, never changes an element's chain of MMAs. Checked for BIO and the tree
    at the Llama-3-8B decode shapes against the 128-row plan (M = 256)."""
    from pallas_kernels.decode_tiles import DecodeTiles
    from pallas_kernels.tree_matmul import tree_matmul

    tiles = DecodeTiles(cta_n=cta_n, tile_k=tile_k)
    for f, k, n in ((matmul, 4096, 6144), (matmul, 4096, 28672), (tree_matmul, 4096, 4096),
                    (tree_matmul, 14336, 4096)):  # fmt: skip
        a, b = _rand(21, (256, k), jnp.bfloat16), _rand(22, (k, n), jnp.bfloat16)
        full = np.asarray(f(a, b).astype(jnp.float32))
        for m in (1, 7, 64):
            part = np.asarray(f(a[:m], b, tiles=tiles).astype(jnp.float32))
            where = f"{f.__name__} K={k} N={n} M={m} {cta_n}x{tile_k}"
            assert np.array_equal(part, full[:m]), where
