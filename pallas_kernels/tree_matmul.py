"""Tree-reduce matmul (TBIK): batch- and tensor-parallel-invariant C[M, N] = A[M, K] @ B[K, N].

Reduction plan (`tree_plan`, a function of K and dtype only):
- K is cut into T = ceil(K / block_k) tiles (zero padded; zeros add exactly).
- The tiles form `num_leaves` equal leaves of `k_first` consecutive tiles, where
  num_leaves = min(largest power of two dividing T, TREE_WIDTH) and k_first = T / num_leaves.
  Inside a leaf the tiles are accumulated sequentially into an f32 accumulator that starts at zero
  (the MMA chain). This is the paper's k_first first level (Algorithm 1): when T is not a power of
  two (K = 6144 or 12288 with block_k = 64 give T = 96 or 192 = 3 * 2^p) the odd factor lives
  inside every leaf, not in one oversized leading leaf, so that contiguous *equal* K shards (what
  tensor parallelism hands each device) are exactly whole subtrees.
- The leaves are combined in a fixed perfect binary tree: node = left + right, lower K on the left,
  i.e. ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
- TREE_WIDTH = 8 = the largest tensor-parallel size we serve on one host. It bounds the live f32
  partials of a tile to log2(8) = 3 besides the running accumulator (what the Hopper kernel can
  keep on chip); a wider tree would add nothing to invariance.

Sharding (`tree_matmul_partial`): for C = num_shards (a power of two dividing num_leaves), shard i
holds K columns [i*K/C, (i+1)*K/C) = leaves [i*L/C, (i+1)*L/C) and returns that subtree's f32
value; all shards compute the same shape of subtree (the shard index only validates). Combining the
C results pairwise -- (0+1), (2+3), ..., then up, lower index on the left -- performs exactly the
additions of the upper tree levels, so it reproduces tree_matmul's f32 result bitwise. This is the
combination `sharding`'s tree all-reduce performs (partner rank ^ d, lower rank's block first).

Tiles along M and N are those of `matmul.tile_config` (never a function of M), so the result is
batch invariant like `matmul`. Backends as in `matmul`: Mosaic GPU on Hopper, Triton elsewhere,
`xla_fixed.tree_subtree` on CPU (the same leaves and tree, each leaf one fixed-shape XLA dot),
interpret mode on CPU with JDET_PALLAS_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import xla_fixed
from pallas_kernels.combine import combine_tree  # noqa: F401 (re-exported: the leaves' order)
from pallas_kernels.decode_tiles import DEFAULT_TILES, DecodeTiles

# By module path: the package re-exports the *function* `matmul` under the same name.
_mm = importlib.import_module("pallas_kernels.matmul")

TREE_WIDTH = 8


@dataclasses.dataclass(frozen=True)
class TreePlan:
    """How K is reduced: num_leaves leaves of k_first tiles of block_k columns each."""

    block_k: int
    num_tiles: int
    k_first: int
    num_leaves: int

    @property
    def leaf_k(self) -> int:
        """K columns per leaf."""
        return self.k_first * self.block_k


def tree_plan(k_total: int, dtype: jnp.dtype, block_k: int | None = None) -> TreePlan:
    """The K reduction tree for a K of `k_total` columns (a function of K and dtype only)."""
    if block_k is None:
        block_k = _mm.tile_config(k_total, 1, dtype).block_k
    num_tiles = max(1, pl.cdiv(k_total, block_k))
    num_leaves = min(num_tiles & -num_tiles, TREE_WIDTH)
    return TreePlan(block_k, num_tiles, num_tiles // num_leaves, num_leaves)


def _tree_kernel(a_ref, b_ref, o_ref, *, cfg, k_first: int, num_leaves: int, precision):
    # A binary counter over the leaves: after leaf j, pop and add (stack top on the left) while the
    # top holds a subtree of the same height. The structure is static (Python), so each tile runs
    # straight-line code with at most log2(num_leaves) partials alive.
    stack: list[tuple[int, jax.Array]] = []
    for j in range(num_leaves):
        node = _mm._mma_tiles(a_ref, b_ref, j * k_first, k_first, cfg, precision)
        height = 0
        while stack and stack[-1][0] == height:
            node = stack.pop()[1] + node
            height += 1
        stack.append((height, node))
    assert len(stack) == 1, "num_leaves must be a power of two"
    o_ref[...] = stack[0][1].astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("k_total", "num_leaves", "out_dtype"))
def _tree_pallas(a, b, *, k_total: int, num_leaves: int, out_dtype):
    """Subtree over a's K columns: num_leaves leaves of the plan of `k_total`."""
    dtype = _mm._check_operands(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    plan = tree_plan(k_total, dtype)
    cfg = _mm.tile_config(k_total, b.shape[1], dtype)
    kernel = functools.partial(
        _tree_kernel,
        cfg=cfg,
        k_first=plan.k_first,
        num_leaves=num_leaves,
        precision=_mm._precision(dtype),
    )
    return _mm.tiled_pallas_call(kernel, a, b, cfg, out_dtype, "tbik_matmul")


def _subtree(a, b, *, k_total: int, num_leaves: int, out_dtype, backend: str | None,
             tiles: DecodeTiles = DEFAULT_TILES):  # fmt: skip
    dtype = _mm._check_operands(a, b)
    resolved = _mm.resolve_backend(backend)
    if resolved == "xla":
        leaf_k = tree_plan(k_total, dtype).leaf_k
        return xla_fixed.tree_subtree(
            a, b, leaf_k=leaf_k, num_leaves=num_leaves, out_dtype=jnp.dtype(out_dtype)
        )
    if resolved == "mosaic":
        from pallas_kernels import matmul_mosaic, tree_mosaic  # slow Mosaic GPU import: Hopper only

        if matmul_mosaic.supports(k_total, b.shape[1], dtype, tree=True):
            return tree_mosaic.tree_matmul(
                a.astype(dtype),
                b.astype(dtype),
                out_dtype,
                k_total=k_total,
                num_leaves=num_leaves,
                tiles=tiles,
            )
    return _tree_pallas(a, b, k_total=k_total, num_leaves=num_leaves, out_dtype=out_dtype)


def tree_matmul(
    a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None, *, backend: str | None = None,
    tiles: DecodeTiles = DEFAULT_TILES,
) -> jax.Array:  # fmt: skip
    """TBIK a[M, K] @ b[K, N]: K tiles combined in the fixed tree of `tree_plan(K)`, f32 partials,
    cast to out_dtype (default: the operands' dtype) at the end. `tiles`: the Hopper kernel's
    decode CTAs (pallas_kernels/decode_tiles.py, never the bits)."""
    dtype = _mm._check_operands(a, b)
    plan = tree_plan(a.shape[1], dtype)
    return _subtree(
        a,
        b,
        k_total=a.shape[1],
        num_leaves=plan.num_leaves,
        out_dtype=jnp.dtype(out_dtype or dtype),
        backend=backend,
        tiles=tiles,
    )


def tree_matmul_parts(
    a: jax.Array, b: jax.Array, *, backend: str | None = None, tiles: DecodeTiles = DEFAULT_TILES
) -> jax.Array | None:
    """f32 parts [G, M, N] with `combine_tree(list(parts)).astype(dtype) == tree_matmul(a, b)`
    bitwise, where the Mosaic (Hopper) kernel runs; None elsewhere (the caller then uses
    tree_matmul). Lets the next kernel fold the combine in (`rms_norm.add_rms_norm`)."""
    dtype = _mm._check_operands(a, b)
    if _mm.resolve_backend(backend) != "mosaic":
        return None
    from pallas_kernels import matmul_mosaic, tree_mosaic  # slow Mosaic GPU import: Hopper only

    if not matmul_mosaic.supports(a.shape[1], b.shape[1], dtype, tree=True):
        return None
    plan = tree_plan(a.shape[1], dtype)
    return tree_mosaic.tree_parts(a.astype(dtype), b.astype(dtype), num_leaves=plan.num_leaves,
                                  tiles=tiles)  # fmt: skip


def tree_matmul_partial(
    a: jax.Array,
    b: jax.Array,
    *,
    k_total: int,
    shard: int,
    num_shards: int,
    backend: str | None = None,
) -> jax.Array:
    """f32 subtree of contiguous K shard `shard` of `num_shards` (a[M, k_total/C], b[k_total/C, N]).

    `combine_tree([partial(shard=i) for i in range(C)])` equals tree_matmul's f32 result bitwise.
    Raises ValueError when the shards cannot be whole subtrees of the plan of `k_total`.
    """
    plan = _shard_plan(a, b, k_total, shard, num_shards)
    return _subtree(
        a,
        b,
        k_total=k_total,
        num_leaves=plan.num_leaves // num_shards,
        out_dtype=jnp.dtype(jnp.float32),
        backend=backend,
    )


def tree_matmul_partial_parts(
    a: jax.Array, b: jax.Array, *, k_total: int, num_shards: int, backend: str | None = None
) -> jax.Array:
    """`tree_matmul_partial` (shard 0's shape; every shard's is the same) as f32 leaf groups
    [G, M, N]: `combine_tree(list(parts))` is its result bitwise. Where the Hopper kernel splits
    the shard's subtree over work items (tree_mosaic.tree_strategy), the G group results it
    wrote, which tree_matmul_partial adds in one more XLA pass; elsewhere the partial, [1, M, N].
    For a consumer that adds the groups itself: the tree all-reduce (sharding/tree_allreduce.py
    `tree_allreduce_parts`), which then reads them where the kernel wrote them."""
    plan = _shard_plan(a, b, k_total, 0, num_shards)
    dtype = _mm._check_operands(a, b)
    if _mm.resolve_backend(backend) == "mosaic":
        from pallas_kernels import matmul_mosaic, tree_mosaic  # slow Mosaic GPU import: Hopper only

        if matmul_mosaic.supports(k_total, b.shape[1], dtype, tree=True):
            return tree_mosaic.tree_parts(a.astype(dtype), b.astype(dtype),
                                          num_leaves=plan.num_leaves // num_shards)  # fmt: skip
    partial = tree_matmul_partial(a, b, k_total=k_total, shard=0, num_shards=num_shards,
                                  backend=backend)  # fmt: skip
    return partial[None]


def _shard_plan(a: jax.Array, b: jax.Array, k_total: int, shard: int, num_shards: int) -> TreePlan:
    """The plan of `k_total`, after checking that shard `shard` of `num_shards` is a whole
    subtree of it and that a holds that shard."""
    dtype = _mm._check_operands(a, b)
    plan = tree_plan(k_total, dtype)
    c = num_shards
    if c < 1 or c & (c - 1) or c > plan.num_leaves:
        raise ValueError(
            f"num_shards={c} must be a power of two <= the tree width {plan.num_leaves} for "
            f"K={k_total} ({plan.num_tiles} tiles of {plan.block_k} = {plan.num_leaves} leaves "
            f"of {plan.k_first} tiles); use a tensor-parallel size that divides it"
        )
    if c > 1 and k_total != plan.num_tiles * plan.block_k:
        raise ValueError(
            f"K={k_total} is not a multiple of block_k={plan.block_k}, so its shards would not "
            f"be whole subtrees; pad K to a multiple of {plan.block_k * c} or use num_shards=1"
        )
    k_shard = k_total // c
    if a.shape[1] != k_shard:
        raise ValueError(
            f"shard has K={a.shape[1]} columns but k_total={k_total} / num_shards={c} = {k_shard}"
        )
    if not 0 <= shard < c:
        raise ValueError(f"shard={shard} is outside 0..{c - 1}")
    return plan


def tree_matmul_reference(
    a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None
) -> jax.Array:
    """Plain XLA product with f32 accumulation (fast, neither batch nor TP invariant)."""
    return _mm.matmul_reference(a, b, out_dtype)
