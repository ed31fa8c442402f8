"""TBIK on Hopper: how `tree_matmul`'s fixed tree is spread over the Mosaic kernel's work items
(`tree_strategy`), and its entry points (`tree_matmul`, `tree_parts`). The kernel itself, its tile
plans and the BIO matmul are in matmul_mosaic.py; its docstring states the reduction plan.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.combine import combine_tree
from pallas_kernels.decode_tiles import DEFAULT_TILES, DecodeTiles
from pallas_kernels.matmul_mosaic import (
    TREE_TILE_N,
    _leaf_products,
    _num_sms,
    decode_rows,
    tree_config,
)


@functools.partial(
    jax.jit,
    static_argnames=("out_dtype", "num_leaves", "subtree", "tile_n", "wide", "small", "tiles"),
)
def _tree(a, b, out_dtype, num_leaves: int, subtree: int, tile_n: int, wide: bool, small: bool,
          tiles: DecodeTiles = DEFAULT_TILES):  # fmt: skip
    m = a.shape[0]
    if min(subtree, num_leaves) == num_leaves:  # the whole tree in registers: cast in epilogue
        cfg = tree_config(num_leaves, tile_n, out_dtype, wide, small, tiles)
        return _leaf_products(a, b, out_dtype, num_leaves, cfg)[0, :m]
    cfg = tree_config(subtree, tile_n, jnp.float32, wide, small, tiles)
    parts = _leaf_products(a, b, jnp.dtype(jnp.float32), num_leaves, cfg)
    return combine_tree([parts[j, :m] for j in range(parts.shape[0])]).astype(out_dtype)


@functools.partial(
    jax.jit, static_argnames=("num_leaves", "subtree", "tile_n", "wide", "small", "tiles")
)
def _tree_parts(a, b, num_leaves: int, subtree: int, tile_n: int, wide: bool, small: bool,
                tiles: DecodeTiles = DEFAULT_TILES):  # fmt: skip
    m = a.shape[0]
    cfg = tree_config(min(subtree, num_leaves), tile_n, jnp.float32, wide, small, tiles)
    return _leaf_products(a, b, jnp.dtype(jnp.float32), num_leaves, cfg)[:, :m]


def tree_parts(a: jax.Array, b: jax.Array, *, num_leaves: int, tile_n: int = TREE_TILE_N,
               tiles: DecodeTiles = DEFAULT_TILES):  # fmt: skip
    """The f32 leaf-group results [G, M, N] of `tree_matmul` before XLA combines them:
    `combine_tree(list(parts)).astype(dtype)` is tree_matmul's result bitwise (G = 1 where the
    whole tree is reduced in registers). For a consumer that folds the combine into its own
    kernel (rms_norm.add_rms_norm: combine + residual add + the next RMSNorm, one launch)."""
    subtree, wide, small = tree_strategy(a.shape[0], b.shape[1], num_leaves, tiles)
    return _tree_parts(a, b, num_leaves, subtree, tile_n, wide, small, tiles)


def tree_strategy(m: int, n: int, num_leaves: int,
                  tiles: DecodeTiles = DEFAULT_TILES) -> tuple[int, bool, bool]:  # fmt: skip
    """(subtree, wide, small) for an M x N product: how the fixed tree is spread over work items.

    This is the one place M enters, and it cannot change a bit: every strategy performs the same
    f32 additions in the same order (tests/pallas_kernels/test_tree_matmul.py checks it on the
    GPU). When whole-tree work items fill the machine, the whole tree stays in
    registers (no f32 partials in HBM); otherwise groups of leaves run as separate work items
    (split-K parallelism for decode) and XLA (or the next kernel: add_rms_norm) adds the group
    results; at M <= 64 on 64-row CTAs. The group is the largest of 4, 2, 1 leaves that still
    gives at least half the SMs a work item: a narrow output (N = 1024, 8 column tiles) had 16
    work items in groups of 4 on 132 SMs, and this rule makes the small model's o and down
    projections about a third faster per layer on an H100 than fixed groups of 4, with equal
    bits (benchmarks/split_probe.py). A decode work item is 64 columns wide
    (`DecodeTiles.cta_n`), so the same rule gives the 8B o / down groups of 4 leaves
    (128 items) and fewer f32 parts to add.
    """
    small = decode_rows(m, tiles)
    whole = pl.cdiv(m, 128) * (n // 128)  # whole-tree work items of the narrow config
    if whole >= _num_sms():
        return num_leaves, TREE_WIDE, False
    cta_n = tiles.cta_n if small else 128
    items = pl.cdiv(m, 64 if small else 128) * (n // cta_n)  # work items per leaf group
    sub = min(4, num_leaves)
    while sub > 1 and (num_leaves // sub) * items < _num_sms() // 2:
        sub //= 2
    return sub, False, small


TREE_WIDE = False


def tree_matmul(
    a: jax.Array,
    b: jax.Array,
    out_dtype,
    *,
    k_total: int,
    num_leaves: int,
    subtree: int | None = None,
    tile_n: int = TREE_TILE_N,
    wide: bool = False,
    small: bool = False,
    tiles: DecodeTiles = DEFAULT_TILES,
):
    """TBIK subtree over a's K columns (num_leaves leaves of the plan of k_total) on Hopper.

    `subtree` leaves are combined in registers per work item, the rest by XLA; the bits do not
    depend on it (same additions, same order), only the speed does.
    """
    del k_total  # the leaf width is a.shape[1] / num_leaves == the plan's leaf_k
    if subtree is None:
        subtree, wide, small = tree_strategy(a.shape[0], b.shape[1], num_leaves, tiles)
    return _tree(a, b, jnp.dtype(out_dtype), num_leaves, subtree, tile_n, wide, small, tiles)
