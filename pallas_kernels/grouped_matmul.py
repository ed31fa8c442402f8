"""Grouped (ragged) matmul: out[r] = x[r // per_src] @ w[group[r]], batch invariant per row.

The R rows of one step (a mixture-of-experts layer's (token, slot) rows, row t*k + j reading
token t: `per_src` = k) are laid out in tiles of block_m slots, each tile's rows of one group
(pallas_kernels/grouped_layout.py; `layout` picks the kernel's). Every tile is one product of
its [block_m, K] rows with its group's weight w[g] [K, N], by the plan of the invariant matmul:

Reduction plan. K is cut into the leaves of `tree_plan(K_total, dtype)` (BIO: one leaf of the
whole K); each leaf is reduced in a fixed order into an f32 accumulator and the leaves are
combined in the fixed pairwise tree of `combine_tree` (lower K on the left), cast at the end.
- CPU (`xla_fixed` rules, backend 'xla'): block_m = BM = 8 rows; each (leaf, n block) is one
  fixed-shape [BM, leaf_k] x [leaf_k, BN] XLA dot with f32 accumulation, as xla_fixed's
  `tree_subtree` runs them.
- Pallas (`pl.pallas_call`; Triton on a GPU, interpret mode on a CPU for the tests): block_m,
  block_k, block_n from `matmul.tile_config(K, N, dtype)`; a leaf is k_first sequential block_k
  steps into an f32 accumulator (the BIO kernel's MMA chain), leaves combined by the tree kernel's
  binary counter. How the products are spread over programs (columns per program, warps,
  pipeline depth, a tree's subtrees in programs of their own) is a launch that changes none of
  this (pallas_kernels/grouped_launch.py), chosen from the step's static row count.
Every parameter is a function of (K, N, dtype) only. Which tile a row lands in, its place in it
and the tile's other rows change none of its arithmetic (the rows of a dot are independent, as
the BIO matmul relies on); the number of rows of its group decides how many tiles run. So row
r's bits are the same whether its group serves 1 row or 500, whatever the other groups hold, in
either layout and either Pallas kernel. A TP shard of K (`grouped_tree_partial`) computes whole
leaves: combining the shards' results pairwise finishes the same tree (the tree all-reduce).
Only tiles that hold rows run (a traced trip count on the CPU, `pl.when` on the GPU), each
reading its own group's weight: a decode step reads the weights of the groups its rows chose.

Why the Pallas kernel works in row order. A step's layout is sized for its static row count, so
most tiles may be empty: a 16-token bucket holding one decoding token has 128 rows (8,320
slots) of which 8 are real. In slot order every layer copied its inputs into the slots, wrote
every empty tile's zeros, ran SwiGLU over all slots and gathered the rows back: ~200 MB of
traffic a layer around 8 rows whose experts are ~75 MB (Qwen3-30B-A3B, 512 rows). So the kernel
gathers a tile's rows straight from x and scatters its results straight to their rows (masked
stores, as pallas_kernels/rope_kv.py does): an empty tile loads and stores nothing, and every
array outside the kernel is [R, ...]. A gathered row holds the values the slot copy held: the
same arithmetic. An empty slot of a live tile loads row 0 (never stored; rows do not mix). From
`SLOT_ORDER_MIN_ROWS` rows, where nearly every tile holds rows, the slot-order kernel of
pallas_kernels/grouped_slots.py runs instead (faster there; the same bits), and where a launch
says so (a layout of few slots: grouped_launch.py). Gate and up are one launch
(`grouped_matmul_pair`: the grid's column blocks run either weight), which also doubles a decode
step's programs (8 experts x 6 live column blocks: 48 programs for 132 SMs, 96).

Stacked weights: w may be a stack of every layer's experts [L, G, K, N] with `layer` (traced);
the kernels read layer `layer`'s groups in place. Why: w[layer] as an array is a copy of all G
experts (a Triton call takes whole buffers), and with the layers unrolled XLA may schedule every
layer's copies before the first layer runs (48 layers of 128 experts: ~70 GiB for a 16-token
step). `grouped_matmul_xla`: XLA's `lax.ragged_dot` (differentiable: "none" off a GPU,
jdet.train's gradient). `grouped_matmul_reference`: the pure-jnp definition.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform, xla_fixed
from pallas_kernels import grouped_launch as glaunch
from pallas_kernels.combine import combine_tree
from pallas_kernels.grouped_layout import (
    GroupedTiles,
    gather_rows,
    group_tiles,
    row_groups,
    row_tiles,
    scatter_rows,
)
from pallas_kernels.grouped_slots import (
    SLOT_ORDER_MIN_ROWS,
    grouped_pallas_slots,
    tree_product,
)
from pallas_kernels.tree_matmul import tree_plan

# By module path: the package re-exports the *function* `matmul` under the same name.
_mm = importlib.import_module("pallas_kernels.matmul")


def tile_rows(backend: str | None = None) -> int:
    """block_m of the kernel `backend` resolves to: 8 on the CPU path, the Pallas kernel's
    block_m otherwise (a constant: never a function of the rows)."""
    if _mm.resolve_backend(backend) == "xla":
        return xla_fixed.BM
    return _mm.tile_config(1, 1, jnp.bfloat16).block_m


def layout(group_ids: jax.Array, num_groups: int, backend: str | None = None) -> GroupedTiles:
    """The kernel's layout for rows with `group_ids` [R]: on the Pallas kernel `row_tiles`
    where R * R <= 2 * G (about one pair of rows shares a group under uniform routing: one
    Qwen3-30B-A3B or Mixtral token), `group_tiles` otherwise. Static shapes decide; neither
    layout changes a row's bits."""
    r = group_ids.shape[0]
    backend = _mm.resolve_backend(backend)
    if backend != "xla" and r * r <= 2 * num_groups:
        return row_tiles(group_ids, num_groups, tile_rows(backend))
    return group_tiles(group_ids, num_groups, tile_rows(backend))


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
def _store_rows(o_ref, rows, cols, val, ok) -> None:
    """o_ref[rows[i], cols] = val[i] where ok[i], in pallas_kernels/rope_kv.py `_store_cols`'
    form (array indices on both axes; a row not stored points one past the output)."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    mask = jnp.broadcast_to(ok[:, None], val.shape)
    pltriton.store(o_ref.at[rows[:, None], cols], val, mask=mask)


def _grouped_kernel(tg_ref, l_ref, sr_ref, x_ref, *refs, cfg, k_first: int, num_leaves: int,
                    precision, live_tiles: int, live_nb: int, nb: int, rows: int,
                    per_src: int, k_split: int):  # fmt: skip
    """Program (t, j): tile t's rows times column block j % nb of weight j // nb % len(ws)
    (one weight, or gate and up), subtree j // (nb * len(ws)) of k_split, stored to the rows'
    own output rows (column j's block of the output)."""
    *w_refs, o_ref = refs
    t, j = pl.program_id(0), pl.program_id(1)
    g = tg_ref[t]
    layer = l_ref[0]
    bk, bn = cfg.block_k, w_refs[0].shape[3]
    which, jj, part = j // nb % len(w_refs), j % nb, j // (nb * len(w_refs))
    sub = num_leaves // k_split
    slot_rows = sr_ref[...]  # [bm]: the row of each slot, `rows` for an empty one
    ok = slot_rows < rows
    src = jnp.where(ok, slot_rows // per_src, 0)  # empty slot: any row (never stored)
    dst = jnp.where(ok, slot_rows, rows)
    cols = j * bn + lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    live = g >= 0

    def product(w_ref, s: int) -> jax.Array:
        return tree_product(lambda start: x_ref[src, pl.ds(start, bk)], w_ref, layer, g,
                            rows=src.shape[0], k_first=k_first, num_leaves=sub,
                            live_tiles=live_tiles, bk=bk, precision=precision,
                            first_leaf=s * sub)  # fmt: skip

    for s in range(k_split):
        for i, w_ref in enumerate(w_refs):

            @pl.when(live & (part == s) & (which == i) & (jj < live_nb))
            def _run(w_ref=w_ref, s=s):
                _store_rows(o_ref, dst, cols, product(w_ref, s).astype(o_ref.dtype), ok)

    if live_nb < nb:  # the plan's zero columns: zeros, not read from the weight

        @pl.when(live & (jj >= live_nb))
        def _zero():
            _store_rows(o_ref, dst, cols, jnp.zeros((src.shape[0], bn), o_ref.dtype), ok)


@functools.partial(jax.jit, static_argnames=("per_src", "leaf_k", "num_leaves", "out_dtype",
                                             "live_k", "live_n", "num_stages", "block_n",
                                             "num_warps", "k_split"))
def _grouped_pallas(x, ws, layer, tile_group, slot_row, row_slot, *, per_src: int, leaf_k: int,
                    num_leaves: int, out_dtype, live_k: int | None = None,
                    live_n: int | None = None, num_stages: int | None = None,
                    block_n: int | None = None, num_warps: int | None = None,
                    k_split: int = 1):  # fmt: skip
    """[R, N] per weight of `ws` (stacks [L, G, K, N] of one shape), rows left out zero.
    `num_stages`, `block_n`, `num_warps`, `k_split`: a launch (pallas_kernels/grouped_launch.py;
    the tile config's by default), never an MMA, its operands or their order."""
    dtype = jnp.promote_types(x.dtype, ws[0].dtype)
    x, ws = x.astype(dtype), [w.astype(dtype) for w in ws]
    cfg = _mm.tile_config(leaf_k * num_leaves, ws[0].shape[3], dtype)
    k_first = -(-leaf_k // cfg.block_k)  # a tree leaf is whole block_k tiles; BIO pads K
    n = ws[0].shape[3]
    kp = num_leaves * k_first * cfg.block_k
    x = _mm._pad_to(x, 1, kp)
    # a copy of the whole stack where K or N is not a whole number of tiles (small test
    # shapes); the plan's padded FFN and the models' widths need none
    ws = [_mm._pad_to(_mm._pad_to(w, 2, kp), 3, cfg.block_n) for w in ws]
    bn = glaunch.check(cfg, block_n, k_split, num_leaves)
    nb = ws[0].shape[3] // bn
    nt = tile_group.shape[0]
    bm = slot_row.shape[0] // nt
    rows = row_slot.shape[0]
    live_tiles = -(-(kp if live_k is None else live_k) // cfg.block_k)
    live_nb = -(-(nb * bn if live_n is None else live_n) // bn)
    kernel = functools.partial(_grouped_kernel, cfg=cfg, k_first=k_first, num_leaves=num_leaves,
                               precision=_mm._precision(dtype), live_tiles=live_tiles,
                               live_nb=live_nb, nb=nb, rows=rows, per_src=per_src,
                               k_split=k_split)  # fmt: skip
    interpret = _platform.interpret_default()
    width = nb * bn
    part_dtype = jnp.dtype(jnp.float32) if k_split > 1 else out_dtype

    def whole(a):
        return pl.BlockSpec(a.shape, lambda t, j: (0,) * a.ndim)

    lw = jnp.asarray(layer, jnp.int32).reshape(1)
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((rows, k_split * len(ws) * width), part_dtype),
        grid=(nt, k_split * len(ws) * nb),
        in_specs=[
            whole(tile_group),
            whole(lw),
            pl.BlockSpec((bm,), lambda t, j: (t,)),  # the tile's slots
            whole(x),  # rows gathered in the kernel
            # every layer and group: the kernel reads its own (layer, group)'s tiles in place
            *[pl.BlockSpec((*w.shape[:2], kp, bn), lambda t, j: (0, 0, 0, j % nb)) for w in ws],
        ],
        out_specs=pl.BlockSpec((rows, k_split * len(ws) * width), lambda t, j: (0, 0)),
        interpret=interpret,
        compiler_params=glaunch.compiler_params(cfg, interpret, num_warps, num_stages),
        name="grouped_matmul" if len(ws) == 1 else "grouped_matmul_pair",
    )(tile_group, lw, slot_row, x, *ws)
    live = (row_slot < slot_row.shape[0])[:, None]
    out = jnp.where(live, out, jnp.zeros((), out.dtype))  # rows left out: never written
    if k_split > 1:  # the subtrees' f32 results: the upper levels of the tree, then the cast
        step = len(ws) * width
        out = combine_tree([out[:, s * step : (s + 1) * step] for s in range(k_split)])
        out = out.astype(out_dtype)
    return tuple(out[:, i * width : i * width + n] for i in range(len(ws)))


def _check(x: jax.Array, w: jax.Array, tiles: GroupedTiles, per_src: int, layer=None) -> jnp.dtype:
    want = 3 if layer is None else 4
    if x.ndim != 2 or w.ndim != want or x.shape[1] != w.shape[-2]:
        raise ValueError(
            f"grouped matmul expects x[S, K] and w[G, K, N] (or a stack w[L, G, K, N] with "
            f"`layer`); got x{tuple(x.shape)}, w{tuple(w.shape)}, layer={layer}"
        )
    if per_src < 1 or x.shape[0] * per_src < tiles.num_rows:
        raise ValueError(f"the layout has {tiles.num_rows} rows, row r reading x[r // {per_src}]"
                         f"; x has {x.shape[0]} rows")  # fmt: skip
    return jnp.promote_types(x.dtype, w.dtype)


def _stacked(w: jax.Array, layer) -> tuple[jax.Array, jax.Array]:
    """(w as a stack [L, G, K, N], the layer index as int32 [1]); a [G, K, N] weight is a
    stack of one layer (a reshape, no copy)."""
    if layer is None:
        return w[None], jnp.zeros((1,), jnp.int32)
    return w, jnp.asarray(layer, jnp.int32).reshape(1)


def _subtree(x, ws, tiles, *, per_src: int, leaf_k: int, num_leaves: int, out_dtype, backend,
             live_k=None, live_n=None, layer=None) -> tuple[jax.Array, ...]:  # fmt: skip
    """num_leaves leaves of leaf_k columns of K per tile, combined in the tree (module plan),
    for each weight of `ws` (one shape): [R, N] each, in row order, rows left out zero.
    `live_k` / `live_n`: w's rows / columns past them are zero (pad_params' FFN padding); the
    Pallas kernel neither reads nor multiplies the K tiles and n blocks wholly past them (an
    exact zero stands in: the same sums; the CPU path computes them). `layer`: w is a stack."""
    stacks = [_stacked(w, layer) for w in ws]
    lw = stacks[0][1]
    out_dtype = jnp.dtype(out_dtype)
    if _mm.resolve_backend(backend) == "xla":
        if tiles.block_m != tile_rows("xla") or not tiles.live_first:
            raise ValueError(f"the CPU path runs group_tiles' layout of {tile_rows('xla')}-row "
                             f"tiles, not {tiles.block_m}-row tiles (live_first="
                             f"{tiles.live_first}): lay them out with layout()")  # fmt: skip
        xs = gather_rows(x, tiles, per_src)
        return tuple(
            scatter_rows(_grouped_xla(xs, w, lw, tiles.tile_group, leaf_k=leaf_k,
                                      num_leaves=num_leaves, out_dtype=out_dtype), tiles)
            for w, _ in stacks
        )  # fmt: skip
    # no Mosaic grouped kernel (yet): the portable kernels on every GPU, row order or slot order
    # by the step's row count (the same bits: pallas_kernels/grouped_slots.py)
    # and a launch (grouped_launch.py), each a function of static shapes
    ws = tuple(w for w, _ in stacks)
    go = glaunch.launch_for(tiles.num_rows, len(ws), num_leaves)
    kw = dict(leaf_k=leaf_k, num_leaves=num_leaves, out_dtype=out_dtype, live_k=live_k,
              live_n=live_n, block_n=go.block_n, num_warps=go.num_warps,
              num_stages=go.num_stages)  # fmt: skip
    if glaunch.slot_order(go, tiles.num_rows, SLOT_ORDER_MIN_ROWS):
        xs = gather_rows(x, tiles, per_src)
        return tuple(scatter_rows(o, tiles)
                     for o in grouped_pallas_slots(xs, ws, lw, tiles.tile_group, **kw))  # fmt: skip
    return _grouped_pallas(x, ws, lw, tiles.tile_group, tiles.slot_row, tiles.row_slot,
                           per_src=per_src, k_split=go.k_split, **kw)  # fmt: skip


def grouped_matmul(x, w, tiles: GroupedTiles, out_dtype=None, *, per_src: int = 1,
                   backend: str | None = None, live_n: int | None = None,
                   live_k: int | None = None, layer=None) -> jax.Array:  # fmt: skip
    """BIO: row r of the layout, x[r // per_src] (x [S, K]), times its group's w [K, N] ->
    [R, N] in row order (rows left out: zeros); K reduced whole as one leaf (f32), cast to
    out_dtype (default: the operands' dtype). `live_n` / `live_k`: w's columns / rows past
    them are zero; `layer`: w is a stack [L, G, K, N] (`_subtree`)."""
    dtype = _check(x, w, tiles, per_src, layer)
    return _subtree(x, [w], tiles, per_src=per_src, leaf_k=x.shape[1], num_leaves=1,
                    backend=backend, out_dtype=out_dtype or dtype, live_n=live_n,
                    live_k=live_k, layer=layer)[0]  # fmt: skip


def grouped_matmul_pair(x, w1, w2, tiles: GroupedTiles, out_dtype=None, *, per_src: int = 1,
                        backend: str | None = None, live_n: int | None = None,
                        layer=None) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """`grouped_matmul` of the same rows by two weights of one shape (an expert's gate and up):
    one launch on the Pallas kernel, each product's bits exactly `grouped_matmul`'s."""
    dtype = _check(x, w1, tiles, per_src, layer)
    if w2.shape != w1.shape:
        raise ValueError(f"grouped_matmul_pair: weights of one shape; got {w1.shape}, {w2.shape}")
    return _subtree(x, [w1, w2], tiles, per_src=per_src, leaf_k=x.shape[1], num_leaves=1,
                    backend=backend, out_dtype=out_dtype or dtype, live_n=live_n,
                    layer=layer)  # fmt: skip


def grouped_tree_matmul(x, w, tiles: GroupedTiles, out_dtype=None, *, per_src: int = 1,
                        backend=None, live_k: int | None = None, layer=None):  # fmt: skip
    """TBIK: as `grouped_matmul`, K reduced in the leaves and tree of `tree_plan(K)`. `live_k`:
    w's rows past it are zero; `layer`: w is a stack (`_subtree`)."""
    dtype = _check(x, w, tiles, per_src, layer)
    plan = tree_plan(x.shape[1], dtype)
    return _subtree(x, [w], tiles, per_src=per_src, leaf_k=plan.leaf_k,
                    num_leaves=plan.num_leaves, out_dtype=out_dtype or dtype, backend=backend,
                    live_k=live_k, layer=layer)[0]  # fmt: skip


def grouped_tree_partial(x, w, tiles: GroupedTiles, *, k_total: int, num_shards: int,
                         per_src: int = 1, backend=None, live_k: int | None = None,
                         layer=None):  # fmt: skip
    """f32 subtree of one of `num_shards` contiguous K shards (x[S, k_total / C], w[G,
    k_total / C, N]): `combine_tree` over the shards' results (the tree all-reduce) is
    `grouped_tree_matmul`'s f32 result bitwise. The shard index is not needed: every shard's
    subtree has the same shape. `layer`: w is a stack (`_subtree`)."""
    dtype = _check(x, w, tiles, per_src, layer)
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
    if x.shape[1] != k_total // c:
        raise ValueError(f"shard has K={x.shape[1]}, expected {k_total} / {c}")
    return _subtree(x, [w], tiles, per_src=per_src, leaf_k=plan.leaf_k,
                    num_leaves=plan.num_leaves // c, out_dtype=jnp.float32, backend=backend,
                    live_k=live_k, layer=layer)[0]  # fmt: skip


def grouped_matmul_reference(x, w, tiles: GroupedTiles, out_dtype=None, *, per_src: int = 1):
    """Pure jnp: each row's x[r // per_src] times its group's weight, f32 accumulation (XLA's
    order), in row order; rows left out give zero rows."""
    dtype = _check(x, w, tiles, per_src)
    g = row_groups(tiles)
    xr = x[jnp.arange(tiles.num_rows) // per_src]
    out = jnp.einsum("rk,rkn->rn", xr.astype(dtype), w[jnp.maximum(g, 0)].astype(dtype),
                     preferred_element_type=jnp.float32,
                     precision=_mm._precision(dtype))  # fmt: skip
    out = jnp.where((g >= 0)[:, None], out, 0.0)
    return out.astype(out_dtype or dtype)


def grouped_matmul_xla(x, w, tiles: GroupedTiles, out_dtype=None, *, per_src: int = 1,
                       layer=None):  # fmt: skip
    """XLA's `lax.ragged_dot` over `group_tiles`' layout (f32 accumulation; its reduction order
    is XLA's, which may follow the group sizes), in row order. Differentiable. `layer`: w is a
    stack, of which ragged_dot takes layer `layer` as an array (on a GPU XLA rewrites ragged_dot
    into a dense dot over every group: jdet/model.py keeps layers that run it in a loop)."""
    dtype = _check(x, w, tiles, per_src, layer)
    if not tiles.live_first:
        raise ValueError("ragged_dot needs group_tiles' layout (each group's slots contiguous)")
    if layer is not None:
        w = lax.dynamic_index_in_dim(w, layer, keepdims=False)
    xs = gather_rows(x, tiles, per_src)
    out = lax.ragged_dot(xs.astype(dtype), w.astype(dtype), tiles.group_sizes,
                         preferred_element_type=jnp.float32)  # fmt: skip
    return scatter_rows(out.astype(out_dtype or dtype), tiles)
