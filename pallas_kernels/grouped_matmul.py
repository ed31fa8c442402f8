"""Grouped (ragged) matmul: out[r] = x[r] @ w[group[r]], batch invariant per row.

The rows of one step (e.g. a mixture-of-experts layer's (token, slot) rows, grouped by expert)
are laid out by `group_tiles`: sorted by (group, row) and each group's rows padded to a multiple
of `block_m`, so every tile of block_m rows belongs to one group. Every tile is then one product
of the [block_m, K] rows with its group's weight w[g] [K, N], by the plan of the invariant matmul:

Reduction plan. K is cut into the leaves of `tree_plan(K_total, dtype)` (BIO: one leaf of the
whole K); each leaf is reduced in a fixed order into an f32 accumulator and the leaves are
combined in the fixed pairwise tree of `combine_tree` (lower K on the left), cast at the end.
- CPU (`xla_fixed` rules, backend 'xla'): block_m = BM = 8 rows; each (leaf, n block) is one
  fixed-shape [BM, leaf_k] x [leaf_k, BN] XLA dot with f32 accumulation, as xla_fixed's
  `tree_subtree` runs them.
- Pallas (`pl.pallas_call`; Triton on a GPU, interpret mode on a CPU for the tests): block_m,
  block_k, block_n from `matmul.tile_config(K, N, dtype)`; a leaf is k_first sequential block_k
  steps into an f32 accumulator (the BIO kernel's MMA chain), leaves combined by the tree kernel's
  binary counter.
Every parameter is a function of (K, N, dtype) only. Which tile a row lands in, its position in
the tile and the other rows of the tile change none of its arithmetic (the rows of a dot are
independent, which the BIO matmul relies on too); the number of rows of its group only decides
how many tiles run. So row r's bits are the same whether its group serves 1 row or 500, and
whatever the other groups hold. A TP shard of K (`grouped_tree_partial`) computes whole leaves:
combining the shards' results pairwise finishes the same tree (the tree all-reduce).

Active bytes: at most ceil(R / block_m) + min(G, R) tiles hold rows; only those run (a loop with
a traced trip count on the CPU, `pl.when` on the GPU) and each reads only its own group's weight,
so a decode step reads the weights of the groups its rows chose, not all of w.

Stacked weights: w may be a model's stack of every layer's experts [L, G, K, N] with `layer` (a
traced index); the kernels then read layer `layer`'s groups in place. Why: w[layer] as an array
is a copy of all G experts (a Triton call, or the dense dot XLA makes of `ragged_dot` on a GPU,
takes whole buffers), and with the layers unrolled those copies depend on the weights only, so
XLA may schedule every layer's copies before the first layer runs (a 48-layer, 128-expert model:
~70 GiB of temporaries for a 16-token step). Indexing inside the kernel leaves no such array.

`grouped_matmul_xla` is the non-invariant baseline ("none" mode): XLA's `lax.ragged_dot` over the
same layout, differentiable. `grouped_matmul_reference` is the pure-jnp definition.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform, xla_fixed
from pallas_kernels.combine import combine_tree
from pallas_kernels.tree_matmul import tree_plan

# By module path: the package re-exports the *function* `matmul` under the same name.
_mm = importlib.import_module("pallas_kernels.matmul")


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_row", "row_slot", "tile_group", "group_sizes"],
    meta_fields=["block_m"],
)
@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Where every row sits in the grouped layout of P = num_tiles * block_m slots.

    slot_row [P]: the row held by each slot (R, one past the last row, for an empty slot);
    row_slot [R]: each row's slot (P for a row left out); tile_group [num_tiles]: each tile's
    group, -1 for a tile that holds no row (it does not run); group_sizes [G]: slots of each
    group (its row count padded to block_m: `lax.ragged_dot`'s group sizes over the layout)."""

    slot_row: jax.Array
    row_slot: jax.Array
    tile_group: jax.Array
    group_sizes: jax.Array
    block_m: int

    @property
    def num_slots(self) -> int:
        return self.slot_row.shape[0]


def num_tiles(rows: int, groups: int, block_m: int) -> int:
    """Tiles of the layout: enough for any grouping of `rows` rows (each group wastes < 1)."""
    return -(-rows // block_m) + min(groups, rows)


def tile_rows(backend: str | None = None) -> int:
    """block_m of the kernel `backend` resolves to: 8 on the CPU path, the Pallas kernel's
    block_m otherwise (a constant: never a function of the rows)."""
    if _mm.resolve_backend(backend) == "xla":
        return xla_fixed.BM
    return _mm.tile_config(1, 1, jnp.bfloat16).block_m


def group_tiles(group_ids: jax.Array, num_groups: int, block_m: int) -> GroupedTiles:
    """The grouped layout of rows with `group_ids` [R] (int): rows sorted by (group, row index),
    each group's rows starting on a tile boundary. A row whose id is num_groups (or more) is
    left out (no slot, a zero output row: e.g. a step's padding rows, which then take no tile).
    Integer arithmetic only."""
    r = group_ids.shape[0]
    nt = num_tiles(r, num_groups, block_m)
    p = nt * block_m
    ids = jnp.minimum(group_ids.astype(jnp.int32), num_groups)
    order = jnp.argsort(ids * r + jnp.arange(r, dtype=jnp.int32))  # unique keys: one order
    counts = jnp.zeros(num_groups + 1, jnp.int32).at[ids].add(1)[:num_groups]
    padded = (counts + block_m - 1) // block_m * block_m
    start = jnp.append(jnp.cumsum(padded) - padded, p)  # first slot of each group; P: left out
    first = jnp.append(jnp.cumsum(counts) - counts, 0)  # first sorted position of each group
    sorted_ids = ids[order]
    rank = jnp.arange(r, dtype=jnp.int32) - first[sorted_ids]
    dest = jnp.where(sorted_ids < num_groups, start[sorted_ids] + rank, p)  # slot of sorted row
    slot_row = jnp.full(p, r, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    row_slot = jnp.zeros(r, jnp.int32).at[order].set(dest)
    ends = start[:num_groups] + padded
    tile_start = jnp.arange(nt, dtype=jnp.int32) * block_m
    # compare_all: one element-wise comparison [tiles, groups], no loop (the default binary
    # search is a loop, which a GPU runs as host-driven iterations in every layer)
    tg = jnp.searchsorted(ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    tile_group = jnp.where(tile_start < ends[-1], tg, -1)
    return GroupedTiles(slot_row, row_slot, tile_group, padded, block_m)


def gather_rows(x: jax.Array, tiles: GroupedTiles) -> jax.Array:
    """x [R, K] in the grouped layout [P, K]; empty slots hold zero rows."""
    xp = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    return xp[tiles.slot_row]


def scatter_rows(y: jax.Array, tiles: GroupedTiles) -> jax.Array:
    """The grouped layout's [P, N] back in row order [R, N] (zeros for rows left out)."""
    return jnp.take(y, tiles.row_slot, axis=0, mode="fill", fill_value=0)


# -- the CPU path (xla_fixed's dots) ---------------------------------------------------------------
@functools.partial(jax.jit, static_argnames=("leaf_k", "num_leaves", "out_dtype"))
def _grouped_xla(xs, w, layer, tile_group, *, leaf_k: int, num_leaves: int, out_dtype):
    bm = xla_fixed.BM
    dtype = jnp.promote_types(xs.dtype, w.dtype)
    p = xs.shape[0]
    _, _, k, n = w.shape
    nb = -(-n // xla_fixed.BN)
    kp = num_leaves * leaf_k
    xs = xla_fixed._pad_axis(xs.astype(dtype), 1, kp)
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize > 2 else None
    dims = (((3,), (2,)), ((0, 1), (0, 1)))  # batch (leaf, n block); contract leaf_k
    used = jnp.sum(tile_group >= 0)

    def tile(t, out):
        g = tile_group[t]
        wg = lax.dynamic_slice(w, (layer[0], g, 0, 0), (1, 1, k, n)).reshape(k, n)
        w4 = xla_fixed._cut(wg, dtype, leaf_k, num_leaves)  # [leaf, nb, leaf_k, BN]
        xt = lax.dynamic_slice_in_dim(xs, t * bm, bm).reshape(bm, num_leaves, leaf_k)
        xb = jnp.broadcast_to(xt.transpose(1, 0, 2)[:, None], (num_leaves, nb, bm, leaf_k))
        parts = lax.dot_general(xb, w4, dims, precision=precision,
                                preferred_element_type=jnp.float32)  # fmt: skip
        acc = combine_tree([parts[i] for i in range(num_leaves)])  # [nb, bm, BN]
        y = acc.transpose(1, 0, 2).reshape(bm, nb * xla_fixed.BN)
        return lax.dynamic_update_slice_in_dim(out, y, t * bm, 0)

    # the tiles that hold rows lead the layout; only they run (a traced trip count)
    out = lax.fori_loop(0, used, tile, jnp.zeros((p, nb * xla_fixed.BN), jnp.float32))
    return out[:, :n].astype(out_dtype)


# -- the Pallas kernel -----------------------------------------------------------------------------
def _grouped_kernel(tg_ref, l_ref, x_ref, w_ref, o_ref, *, cfg, k_first: int, num_leaves: int,
                    precision, live_tiles: int, live_nb: int):  # fmt: skip
    t = pl.program_id(0)
    g = tg_ref[t]
    layer = l_ref[0]
    bk = cfg.block_k
    run = (g >= 0) & (pl.program_id(1) < live_nb)

    @pl.when(run)
    def _run():
        def leaf(first: int) -> jax.Array:
            # K tiles past live_tiles hold zero weights: an exact zero stands in for their sum
            n = max(0, min(k_first, live_tiles - first))

            def body(i, acc):
                start = pl.multiple_of((first + i) * bk, bk)
                a = x_ref[:, pl.ds(start, bk)]
                b = w_ref[layer, g, pl.ds(start, bk), :]
                return acc + jnp.dot(a, b, preferred_element_type=jnp.float32,
                                     precision=precision)  # fmt: skip

            acc0 = jnp.zeros((x_ref.shape[0], w_ref.shape[3]), jnp.float32)
            return lax.fori_loop(0, n, body, acc0) if n else acc0

        # the tree kernel's binary counter: leaves added pairwise, lower K on the left
        stack: list[tuple[int, jax.Array]] = []
        for j in range(num_leaves):
            node, height = leaf(j * k_first), 0
            while stack and stack[-1][0] == height:
                node = stack.pop()[1] + node
                height += 1
            stack.append((height, node))
        o_ref[...] = stack[0][1].astype(o_ref.dtype)

    @pl.when(jnp.logical_not(run))
    def _skip():
        o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("leaf_k", "num_leaves", "out_dtype", "live_k",
                                             "live_n"))
def _grouped_pallas(xs, w, layer, tile_group, *, leaf_k: int, num_leaves: int, out_dtype,
                    live_k: int | None = None, live_n: int | None = None):  # fmt: skip
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    dtype = jnp.promote_types(xs.dtype, w.dtype)
    xs, w = xs.astype(dtype), w.astype(dtype)
    cfg = _mm.tile_config(leaf_k * num_leaves, w.shape[3], dtype)
    k_first = -(-leaf_k // cfg.block_k)  # a tree leaf is whole block_k tiles; BIO pads K
    p, n = xs.shape[0], w.shape[3]
    kp = num_leaves * k_first * cfg.block_k
    xs = _mm._pad_to(xs, 1, kp)
    # a copy of the whole stack where K or N is not a whole number of tiles (small test
    # shapes); the plan's padded FFN and the models' widths need none
    w = _mm._pad_to(_mm._pad_to(w, 2, kp), 3, cfg.block_n)
    nb = w.shape[3] // cfg.block_n
    bm = p // tile_group.shape[0]
    live_tiles = -(-(kp if live_k is None else live_k) // cfg.block_k)
    live_nb = -(-(nb * cfg.block_n if live_n is None else live_n) // cfg.block_n)
    kernel = functools.partial(_grouped_kernel, cfg=cfg, k_first=k_first, num_leaves=num_leaves,
                               precision=_mm._precision(dtype), live_tiles=live_tiles,
                               live_nb=live_nb)  # fmt: skip
    interpret = _platform.interpret_default()
    compiler_params = None
    if not interpret:
        compiler_params = pltriton.CompilerParams(num_warps=cfg.num_warps,
                                                  num_stages=cfg.num_stages)  # fmt: skip
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p, nb * cfg.block_n), out_dtype),
        grid=(tile_group.shape[0], nb),
        in_specs=[
            pl.BlockSpec(tile_group.shape, lambda t, j: (0,)),
            pl.BlockSpec((1,), lambda t, j: (0,)),
            pl.BlockSpec((bm, kp), lambda t, j: (t, 0)),
            # every layer and group: the kernel reads its own (layer, group)'s tiles in place
            pl.BlockSpec((*w.shape[:2], kp, cfg.block_n), lambda t, j: (0, 0, 0, j)),
        ],
        out_specs=pl.BlockSpec((bm, cfg.block_n), lambda t, j: (t, j)),
        interpret=interpret,
        compiler_params=compiler_params,
        name="grouped_matmul",
    )(tile_group, layer, xs, w)
    return out[:, :n]


def _check(xs: jax.Array, w: jax.Array, tiles: GroupedTiles, layer=None) -> jnp.dtype:
    want = 3 if layer is None else 4
    if xs.ndim != 2 or w.ndim != want or xs.shape[1] != w.shape[-2]:
        raise ValueError(
            f"grouped matmul expects xs[P, K] and w[G, K, N] (or a stack w[L, G, K, N] with "
            f"`layer`); got xs{tuple(xs.shape)}, w{tuple(w.shape)}, layer={layer}"
        )
    if xs.shape[0] != tiles.num_slots:
        raise ValueError(f"xs has {xs.shape[0]} rows; the layout has {tiles.num_slots} slots")
    return jnp.promote_types(xs.dtype, w.dtype)


def _stacked(w: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """(w as a stack [L, G, K, N], the layer index as int32 [1]); a [G, K, N] weight is a
    stack of one layer (a reshape, no copy)."""
    if layer is None:
        return w[None], jnp.zeros((1,), jnp.int32)
    return w, jnp.asarray(layer, jnp.int32).reshape(1)


def _subtree(xs, w, tiles, *, leaf_k: int, num_leaves: int, out_dtype, backend, live_k=None,
             live_n=None, layer=None):  # fmt: skip
    """num_leaves leaves of leaf_k columns of K per tile, combined in the tree (module plan).
    `live_k` / `live_n`: w's rows / columns past them are zero (jdet/plan.py pad_params' FFN
    padding); the Pallas kernel then neither reads nor multiplies the K tiles and n blocks wholly
    past them (an exact zero in their place: the same sums). The CPU path computes them.
    `layer`: w is a stack [L, G, K, N], read at that layer in place (module docstring)."""
    w, lw = _stacked(w, layer)
    if _mm.resolve_backend(backend) == "xla":
        if tiles.block_m != tile_rows("xla"):
            raise ValueError(f"the CPU path's tiles have {tile_rows('xla')} rows, not "
                             f"{tiles.block_m}: lay them out with tile_rows()")  # fmt: skip
        return _grouped_xla(xs, w, lw, tiles.tile_group, leaf_k=leaf_k, num_leaves=num_leaves,
                            out_dtype=jnp.dtype(out_dtype))  # fmt: skip
    # no Mosaic grouped kernel (yet): the portable kernel on every GPU
    return _grouped_pallas(xs, w, lw, tiles.tile_group, leaf_k=leaf_k, num_leaves=num_leaves,
                           out_dtype=jnp.dtype(out_dtype), live_k=live_k,
                           live_n=live_n)  # fmt: skip


def grouped_matmul(xs, w, tiles: GroupedTiles, out_dtype=None, *, backend: str | None = None,
                   live_n: int | None = None, layer=None):  # fmt: skip
    """BIO: xs[P, K] (the grouped layout, `gather_rows`) @ w[group] [K, N] per tile -> [P, N];
    K reduced whole as one leaf (f32), cast to out_dtype (default: the operands' dtype).
    `live_n`: w's columns past it are zero; `layer`: w is a stack [L, G, K, N] (`_subtree`)."""
    dtype = _check(xs, w, tiles, layer)
    return _subtree(xs, w, tiles, leaf_k=xs.shape[1], num_leaves=1, backend=backend,
                    out_dtype=out_dtype or dtype, live_n=live_n, layer=layer)  # fmt: skip


def grouped_tree_matmul(xs, w, tiles: GroupedTiles, out_dtype=None, *, backend=None,
                        live_k: int | None = None, layer=None):  # fmt: skip
    """TBIK: as `grouped_matmul`, K reduced in the leaves and tree of `tree_plan(K)`. `live_k`:
    w's rows past it are zero; `layer`: w is a stack (`_subtree`)."""
    dtype = _check(xs, w, tiles, layer)
    plan = tree_plan(xs.shape[1], dtype)
    return _subtree(xs, w, tiles, leaf_k=plan.leaf_k, num_leaves=plan.num_leaves,
                    out_dtype=out_dtype or dtype, backend=backend, live_k=live_k,
                    layer=layer)  # fmt: skip


def grouped_tree_partial(xs, w, tiles: GroupedTiles, *, k_total: int, num_shards: int,
                         backend=None, live_k: int | None = None, layer=None):  # fmt: skip
    """f32 subtree of one of `num_shards` contiguous K shards (xs[P, k_total / C], w[G,
    k_total / C, N]): `combine_tree` over the shards' results (the tree all-reduce) is
    `grouped_tree_matmul`'s f32 result bitwise. The shard index is not needed: every shard's
    subtree has the same shape. `layer`: w is a stack (`_subtree`)."""
    dtype = _check(xs, w, tiles, layer)
    plan = tree_plan(k_total, dtype)
    c = num_shards
    if c < 1 or c & (c - 1) or c > plan.num_leaves or (
        c > 1 and k_total != plan.num_tiles * plan.block_k
    ):
        raise ValueError(
            f"num_shards={c} cannot split K={k_total} into whole subtrees ({plan.num_leaves} "
            f"leaves of {plan.k_first} tiles of {plan.block_k}); pad K to a multiple of "
            f"{plan.block_k * c}"
        )
    if xs.shape[1] != k_total // c:
        raise ValueError(f"shard has K={xs.shape[1]}, expected {k_total} / {c}")
    return _subtree(xs, w, tiles, leaf_k=plan.leaf_k, num_leaves=plan.num_leaves // c,
                    out_dtype=jnp.float32, backend=backend, live_k=live_k,
                    layer=layer)  # fmt: skip


def _slot_groups(tiles: GroupedTiles) -> jax.Array:
    return jnp.repeat(tiles.tile_group, tiles.block_m)


def grouped_matmul_reference(xs, w, tiles: GroupedTiles, out_dtype=None):
    """Pure jnp: each slot's row times its group's weight, f32 accumulation (XLA's order); empty
    slots give zero rows."""
    dtype = _check(xs, w, tiles)
    g = _slot_groups(tiles)
    wg = w[jnp.maximum(g, 0)]
    out = jnp.einsum("pk,pkn->pn", xs.astype(dtype), wg.astype(dtype),
                     preferred_element_type=jnp.float32,
                     precision=_mm._precision(dtype))  # fmt: skip
    out = jnp.where((g >= 0)[:, None], out, 0.0)
    return out.astype(out_dtype or dtype)


def grouped_matmul_xla(xs, w, tiles: GroupedTiles, out_dtype=None, *, layer=None):
    """The "none" mode's grouped product: XLA's `lax.ragged_dot` over the layout (f32
    accumulation; its reduction order is XLA's, which may follow the group sizes).
    Differentiable. `layer`: w is a stack, of which ragged_dot takes layer `layer` as an array
    (on a GPU XLA rewrites ragged_dot into a dense dot over every group: jdet/model.py keeps
    such a model's "none" layers in a loop)."""
    dtype = _check(xs, w, tiles, layer)
    if layer is not None:
        w = lax.dynamic_index_in_dim(w, layer, keepdims=False)
    out = lax.ragged_dot(xs.astype(dtype), w.astype(dtype), tiles.group_sizes,
                         preferred_element_type=jnp.float32)  # fmt: skip
    return out.astype(out_dtype or dtype)
