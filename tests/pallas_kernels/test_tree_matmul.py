"""tree_matmul (TBIK): accuracy, batch invariance, and the shard property behind TP invariance.

On CPU the kernels run in interpret mode, where Pallas starts every output buffer as NaN: a finite
result therefore proves every element was written (the poison check).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.tree_matmul import (
    combine_tree,
    tree_matmul,
    tree_matmul_partial,
    tree_matmul_reference,
    tree_plan,
)

M_SIZES = (1, 2, 3, 17, 64, 130)


def _rand(key: int, shape: tuple[int, ...], dtype) -> jax.Array:
    """Normal samples made by numpy (bf16 by ml_dtypes), then put on the device. Why not
    jax.random: on a CPU each new shape of jax.random.normal and of its cast is an XLA compile."""
    x = np.random.default_rng(key).standard_normal(shape, np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def _rel_err(out, a, b) -> float:
    ref = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    return float(np.abs(np.asarray(out, np.float64) - ref).max() / np.abs(ref).max())


def _shards(a, b, c: int, **kw):
    ks = a.shape[1] // c
    return [
        tree_matmul_partial(
            a[:, i * ks : (i + 1) * ks],
            b[i * ks : (i + 1) * ks],
            k_total=a.shape[1],
            shard=i,
            num_shards=c,
            **kw,
        )
        for i in range(c)
    ]


def test_tree_plan_puts_the_odd_factor_inside_equal_leaves():
    assert tree_plan(12288, jnp.bfloat16) == tree_plan(12288, jnp.bfloat16)
    p = tree_plan(12288, jnp.bfloat16)  # 192 tiles = 8 leaves of 24 tiles
    assert (p.block_k, p.num_tiles, p.num_leaves, p.k_first) == (64, 192, 8, 24)
    p = tree_plan(6144, jnp.bfloat16)  # 96 tiles = 8 leaves of 12
    assert (p.num_leaves, p.k_first) == (8, 12)
    p = tree_plan(192, jnp.bfloat16)  # 3 tiles: one leaf, sequential
    assert (p.num_leaves, p.k_first) == (1, 3)
    p = tree_plan(384, jnp.bfloat16)  # 6 tiles = 2 leaves of an odd group of 3
    assert (p.num_leaves, p.k_first) == (2, 3)


@pytest.mark.parametrize(
    "dtype,k,n,tol",
    [(jnp.bfloat16, 384, 40, 8e-3), (jnp.float32, 96, 33, 1e-5), (jnp.bfloat16, 100, 17, 8e-3)],
)
def test_tree_matmul_matches_float64_and_writes_every_element(dtype, k, n, tol):
    a, b = _rand(0, (70, k), dtype), _rand(1, (k, n), dtype)
    out = tree_matmul(a, b)
    assert out.shape == (70, n) and out.dtype == jnp.dtype(dtype)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    assert _rel_err(out, a, b) < tol
    assert _rel_err(tree_matmul_reference(a, b, jnp.float32), a, b) < 1e-3


@pytest.mark.parametrize("dtype,k,n", [(jnp.bfloat16, 384, 40), (jnp.float32, 96, 33)])
def test_tree_matmul_row_bits_do_not_depend_on_batch_size(dtype, k, n):
    # bf16: 6 tiles = 2 leaves of 3 (odd group); f32: 3 tiles of 32 = one odd leaf.
    a, b = _rand(2, (max(M_SIZES), k), dtype), _rand(3, (k, n), dtype)
    full = np.asarray(tree_matmul(a, b, jnp.float32))
    for m in M_SIZES:
        assert np.array_equal(np.asarray(tree_matmul(a[:m], b, jnp.float32)), full[:m]), m


@pytest.mark.parametrize("dtype,k", [(jnp.bfloat16, 1536), (jnp.float32, 512)])
def test_pairwise_combination_of_shard_subtrees_equals_tree_matmul_bitwise(dtype, k):
    # bf16 K=1536: 24 tiles = 8 leaves of an odd group of 3; f32 K=512: 16 tiles = 8 leaves of 2.
    a, b = _rand(4, (5, k), dtype), _rand(5, (k, 24), dtype)
    full32 = np.asarray(tree_matmul(a, b, jnp.float32))
    full = np.asarray(tree_matmul(a, b).astype(jnp.float32))
    for c in (1, 2, 4, 8):
        combined = combine_tree(_shards(a, b, c))
        assert combined.dtype == jnp.float32
        assert np.array_equal(np.asarray(combined), full32), f"C={c}"
        assert np.array_equal(np.asarray(combined.astype(dtype).astype(jnp.float32)), full), c


def test_shard_results_are_not_a_plain_sum_negative_control():
    """The shard property is not trivial: summing the shards left to right differs somewhere."""
    a, b = _rand(6, (16, 1536), jnp.float32), _rand(7, (1536, 24), jnp.float32)
    parts = _shards(a, b, 8)
    seq = parts[0]
    for p in parts[1:]:
        seq = seq + p
    assert not np.array_equal(np.asarray(seq), np.asarray(combine_tree(parts)))


def test_partial_rejects_shard_counts_the_tree_cannot_split():
    a, b = _rand(8, (2, 192), jnp.bfloat16), _rand(9, (192, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="power of two <= the tree width 1"):
        tree_matmul_partial(a[:, :96], b[:96], k_total=192, shard=0, num_shards=2)
    a2, b2 = _rand(8, (2, 512), jnp.bfloat16), _rand(9, (512, 8), jnp.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        tree_matmul_partial(a2[:, :170], b2[:170], k_total=512, shard=0, num_shards=3)
    with pytest.raises(ValueError, match="k_total=512 / num_shards=2"):
        tree_matmul_partial(a2[:, :128], b2[:128], k_total=512, shard=0, num_shards=2)
    with pytest.raises(ValueError, match="outside"):
        tree_matmul_partial(a2[:, :256], b2[:256], k_total=512, shard=2, num_shards=2)


# ---------------------------------------------------------------- GPU (compiled, realistic shapes)
GPU_M = (1, 7, 128, 256, 1000, 8192)


@pytest.mark.gpu
def test_gpu_mosaic_tree_strategies_give_identical_bits():
    """The Mosaic tree may spread its fixed tree over work items differently for different M
    (subtree groups, CTA shape); this proves every strategy yields the same bits."""
    from pallas_kernels import tree_mosaic as mm

    k, n = 12288, 4096
    leaves = tree_plan(k, jnp.bfloat16).num_leaves
    a, b = _rand(16, (1000, k), jnp.bfloat16), _rand(17, (k, n), jnp.bfloat16)
    for m in (1, 128, 1000):
        outs = [
            np.asarray(
                mm.tree_matmul(
                    a[:m], b, jnp.float32, k_total=k, num_leaves=leaves, subtree=s, wide=w, small=sm
                )
            )
            for s, w, sm in (
                (1, False, False),
                (2, False, False),
                (4, False, False),
                (8, False, False),
                (8, True, False),
                (2, True, False),
                (1, False, True),
                (2, False, True),
                (4, False, True),
                (8, False, True),
            )  # fmt: skip
        ]
        assert all(np.array_equal(outs[0], o) for o in outs[1:]), m


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "pallas"])
@pytest.mark.parametrize("k,n", [(4096, 4096), (12288, 4096)])
def test_gpu_tree_matmul_row_bits_do_not_depend_on_batch_size(backend, k, n):
    a, b = _rand(12, (8192, k), jnp.bfloat16), _rand(13, (k, n), jnp.bfloat16)
    full = np.asarray(tree_matmul(a, b, backend=backend).astype(jnp.float32))
    assert np.isfinite(full).all()
    assert _rel_err(full[:256], a[:256], b) < 8e-3
    for m in GPU_M:
        part = np.asarray(tree_matmul(a[:m], b, backend=backend).astype(jnp.float32))
        assert np.array_equal(part, full[:m]), f"rows changed at M={m} ({backend})"


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "pallas"])
def test_gpu_pairwise_combination_of_shard_subtrees_equals_tree_matmul_bitwise(backend):
    a, b = _rand(14, (300, 12288), jnp.bfloat16), _rand(15, (12288, 4096), jnp.bfloat16)
    full32 = np.asarray(tree_matmul(a, b, jnp.float32, backend=backend))
    for c in (1, 2, 4, 8):
        combined = combine_tree(_shards(a, b, c, backend=backend))
        assert np.array_equal(np.asarray(combined), full32), f"C={c} ({backend})"


def test_decode_split_gives_at_least_half_the_sms_a_work_item(monkeypatch):
    """tree_strategy's leaf groups (BENCHMARKS run 8): the largest of 4/2/1 leaves with at least
    half of the 132 H100 SMs busy; whole tree once whole-tree work items fill the SMs. Only the
    speed depends on it (test_gpu_mosaic_tree_strategies_give_identical_bits)."""
    from pallas_kernels import tree_mosaic

    monkeypatch.setattr(tree_mosaic, "_num_sms", lambda: 132)
    s = tree_mosaic.tree_strategy
    assert s(64, 4096, 8) == (4, False, True)  # Llama-3-8B o / down at batch 1: 128 items
    assert s(64, 1024, 8) == (1, False, True)  # Qwen3-0.6B o / down: 128 items of 64 columns
    assert s(64, 8192, 8)[0] == 4  # wider N: groups of 4 already give 128 items
    assert s(64, 28672, 8)[0] == 8  # 224 whole-tree items fill the SMs
    assert s(2048, 4096, 8) == (8, tree_mosaic.TREE_WIDE, False)  # prefill: the whole tree


def test_partial_parts_off_hopper_are_the_partial_itself():
    from pallas_kernels.tree_matmul import tree_matmul_partial_parts

    a, b = _rand(20, (5, 256), jnp.float32), _rand(21, (256, 128), jnp.float32)
    parts = tree_matmul_partial_parts(a[:, :128], b[:128], k_total=256, num_shards=2)
    want = tree_matmul_partial(a[:, :128], b[:128], k_total=256, shard=0, num_shards=2)
    assert parts.shape == (1, 5, 128) and np.array_equal(np.asarray(parts[0]), np.asarray(want))


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 300])
def test_gpu_partial_parts_combine_to_the_partial_bitwise(m):
    """The leaf groups the Hopper kernel leaves a TP shard's subtree in (the all-reduce adds
    them itself): combine_tree of them is tree_matmul_partial, at the decode sizes where they
    are several groups (8B o_proj / down_proj shards at TP 2 and 4) and at a prefill size."""
    from pallas_kernels.tree_matmul import tree_matmul_partial_parts

    several = False
    for k, n in ((4096, 4096), (14336, 4096)):
        a, b = _rand(22, (m, k), jnp.bfloat16), _rand(23, (k, n), jnp.bfloat16)
        for c in (2, 4):
            ks = k // c
            parts = tree_matmul_partial_parts(a[:, :ks], b[:ks], k_total=k, num_shards=c)
            want = tree_matmul_partial(a[:, :ks], b[:ks], k_total=k, shard=0, num_shards=c)
            assert parts.shape[1:] == (m, n)
            got = combine_tree(list(parts))
            assert np.array_equal(np.asarray(got), np.asarray(want)), (k, c)
            several |= parts.shape[0] > 1
    assert several or m > 64, "no shard came in several groups: the fused add went untested"
