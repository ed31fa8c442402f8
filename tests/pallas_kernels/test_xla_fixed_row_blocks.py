"""The CPU matmuls' small row blocks (`xla_fixed.row_block`, issue 17): a product of 1-4 rows runs
[2 or 4, K] x [K, 128] dots instead of 8-row ones, and each row must keep the 8-row dot's bits.

That holds because XLA CPU computes every row of an [m, K] x [K, 128] dot the same way for m = 2..8
(benchmarks/row_block_probe.py measured it on the CI machine at every K probed); a 1-row dot takes
a matrix-vector path whose bits differ once K >= 384, which is why a 1-row product pads to 2 rows.
These tests hold the row block to that at the shapes models use (BIO and tree plans, arrays and
blocked weights); the negative control runs 1-row blocks and must see a row change.

The equality is measured, not constructed, so the small blocks are on only for the jaxlib and CPU
where it was measured (`_platform.small_row_blocks_verified`; JAX 0.11.2 broke it on an AVX-512
Xeon). Where they are off, the same tests hold every product of 1-7 rows to 8-row dots.
"""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import pytest

from pallas_kernels import _platform, xla_blocked, xla_fixed

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the row blocks are XLA CPU's dots"
)


def _rand(key: int, shape: tuple[int, ...], dtype, scale: float = 1.0) -> np.ndarray:
    x = scale * np.random.default_rng(key).standard_normal(shape, np.float32)
    return np.asarray(jnp.asarray(x).astype(dtype))


def _rows_changed(a: np.ndarray, b, leaf_k: int, num_leaves: int) -> list[int]:
    """The m < 8 at which the rows of a[:m] @ b differ bitwise from those rows of a[:8] @ b."""
    f = lambda x: np.asarray(xla_fixed.tree_subtree(  # noqa: E731
        jnp.asarray(x), b, leaf_k=leaf_k, num_leaves=num_leaves, out_dtype=jnp.float32))
    full = f(a[:8])
    return [m for m in (1, 2, 3, 4, 5, 7) if not np.array_equal(f(a[:m]), full[:m])]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize(
    "k,n,num_leaves",
    [(256, 512, 1), (256, 8192, 1), (1024, 256, 8), (512, 256, 8), (4096, 384, 1),
     (4096, 256, 32), (1536, 200, 1)],
)  # fmt: skip
def test_small_row_blocks_give_each_row_the_8_row_blocks_bits(dtype, k, n, num_leaves):
    a = _rand(0, (8, k), dtype)
    b = _rand(1, (k, n), dtype, k**-0.5)
    leaf_k = k // num_leaves
    small = [2, 2, 4, 4, 8, 8] if _platform.small_row_blocks() else [8] * 6
    assert [xla_fixed.row_block(m) for m in (1, 2, 3, 4, 5, 8)] == small
    assert _rows_changed(a, jnp.asarray(b), leaf_k, num_leaves) == []
    if dtype == jnp.bfloat16:  # the engine's weights: bf16 bits held for f32 dots, blocked
        w = xla_blocked.block_weight(b, num_leaves=num_leaves, leaf_k=leaf_k, bn=xla_fixed.BN,
                                     compute=jnp.float32)  # fmt: skip
        assert _rows_changed(a, w, leaf_k, num_leaves) == []


def test_negative_control_one_row_blocks_change_a_row_at_a_wide_k(monkeypatch):
    """A 1-row product as a 1-row dot (the matrix-vector path): its row differs from the 8-row
    dot's at K = 1024, which is what the 2-row minimum avoids."""
    a, b = _rand(2, (8, 1024), jnp.float32), jnp.asarray(_rand(3, (1024, 256), jnp.float32))
    xla_fixed.tree_subtree.clear_cache()
    monkeypatch.setattr(xla_fixed, "row_block", lambda m: 1 if m == 1 else xla_fixed.BM)
    try:
        assert _rows_changed(a, b, 1024, 1) == [1]
    finally:
        xla_fixed.tree_subtree.clear_cache()  # no 1-row trace left for other tests


def test_small_row_blocks_are_on_only_where_measured(monkeypatch):
    """The gate: a listed jaxlib on x86-64 with AVX2 and without AVX-512, else off;
    JDET_SMALL_ROW_BLOCKS forces either way. This machine's setting is the gate's answer."""
    verified = _platform.small_row_blocks_verified
    avx2 = frozenset({"sse4_2", "avx", "avx2", "fma"})
    assert verified("0.10.2", "x86_64", avx2)
    assert not verified("0.11.2", "x86_64", avx2)  # measured: other rows (module docstring)
    assert not verified("0.10.2", "x86_64", avx2 | {"avx512f"})
    assert not verified("0.10.2", "aarch64", frozenset())
    assert not verified("0.10.2", "x86_64", frozenset())  # flags unknown (no /proc/cpuinfo)
    monkeypatch.delenv(_platform.SMALL_ROW_BLOCKS_ENV, raising=False)
    here = _platform.small_row_blocks_verified_here()
    assert here == verified(jaxlib.__version__, platform.machine(), _platform.host_cpu_flags())
    assert _platform.small_row_blocks() == here
    for value, want in (("1", True), ("0", False), ("true", True)):
        monkeypatch.setenv(_platform.SMALL_ROW_BLOCKS_ENV, value)
        assert _platform.small_row_blocks() == want


def test_without_small_row_blocks_every_product_runs_8_row_dots(monkeypatch):
    """Off, a 1-row product pads to an 8-row dot, and so its row is the 8-row product's: the
    equality by construction that unmeasured machines rely on (K = 4096, where JAX 0.11.2's 2-row
    dot gave another row)."""
    a, b = _rand(4, (8, 4096), jnp.float32), jnp.asarray(_rand(5, (4096, 384), jnp.float32))
    xla_fixed.tree_subtree.clear_cache()
    monkeypatch.setenv(_platform.SMALL_ROW_BLOCKS_ENV, "0")
    try:
        assert [xla_fixed.row_block(m) for m in (1, 2, 4, 8)] == [8, 8, 8, 8]
        assert _rows_changed(a, b, 4096, 1) == []
    finally:
        xla_fixed.tree_subtree.clear_cache()
