"""The grouped matmul's Pallas kernel in slot order: for steps of many rows.

The same products as pallas_kernels/grouped_matmul.py's row-order kernel (`_grouped_pallas`),
with the rows copied into the layout's slots first (`gather_rows`) and the results copied back
(`scatter_rows`): each program loads its tile's [block_m, block_k] blocks of the slot array and
stores one [block_m, block_n] output block, where the row-order kernel gathers each tile's rows
from x and scatters its results with masked stores.

Reduction plan: grouped_matmul.py's, unchanged. The tile config (`matmul.tile_config` of the
whole K, N and dtype), the leaves of k_first block_k steps into an f32 accumulator, the binary
counter that combines the leaves (lower K on the left), the MMA shape [block_m, block_k] x
[block_k, block_n] and the Triton pipeline depth are the row-order kernel's; a row's values in
its slot are the values the row-order kernel gathers, and the rows of an MMA are independent. So
every row has the same bits in either kernel (tests/pallas_kernels/test_grouped_matmul.py holds
them to it, in interpret mode and compiled at Qwen3-30B-A3B's expert shapes with `-m gpu`).

Why two kernels: at a decode step most tiles are empty and the copies into and out of the slots
cost more than the experts' weights (grouped_matmul.py, "Why the Pallas kernel works in row
order"); at 32 and 64 tokens of Qwen3-30B-A3B nearly every tile holds rows, and there the
row-order kernel's gathered loads and masked stores made the MoE layer slower than this kernel
with its copies (benchmarks/moe_layer_probe.py times both: tp-new against tp-old).
`grouped_matmul._subtree` picks by the step's row count, a static shape: one compiled program
per step shape, never a choice that follows the data.
Tiles that hold no row (tile_group -1) run and store nothing: `scatter_rows` reads only the
slots of rows.
"""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform
from pallas_kernels import grouped_launch as glaunch

_mm = importlib.import_module("pallas_kernels.matmul")

# Steps of at least this many (token, expert) rows run the slot-order kernel: 32 tokens of a
# top-8 model. Below it (decode buckets) the row-order kernel.
SLOT_ORDER_MIN_ROWS = 256


def tree_product(x_block, w_ref, layer, g, *, rows: int, k_first: int, num_leaves: int,
                 live_tiles: int, bk: int, precision,
                 first_leaf: int = 0) -> jax.Array:  # fmt: skip
    """One program's [rows, block_n] f32 product in the grouped matmul's reduction plan, shared
    by both kernels (so their plans are one): `num_leaves` leaves of `k_first` block_k steps
    into an f32 accumulator, combined by the tree kernel's binary counter (leaves added
    pairwise, lower K on the left). K tiles past `live_tiles` hold zero weights: an exact zero
    stands in for their sum. `x_block(start)` loads the tile's [rows, bk] block of x at column
    `start` (slot order here, rows gathered from x in grouped_matmul.py). `first_leaf`: the
    leaves are the plan's first_leaf.. (a whole subtree of a k_split launch, grouped_launch.py).
    """

    def leaf(first: int) -> jax.Array:
        n = max(0, min(k_first, live_tiles - first))

        def body(i, acc):
            start = pl.multiple_of((first + i) * bk, bk)
            a = x_block(start)
            b = w_ref[layer, g, pl.ds(start, bk), :]
            return acc + jnp.dot(a, b, preferred_element_type=jnp.float32,
                                 precision=precision)  # fmt: skip

        acc0 = jnp.zeros((rows, w_ref.shape[3]), jnp.float32)
        return lax.fori_loop(0, n, body, acc0) if n else acc0

    stack: list[tuple[int, jax.Array]] = []
    for i in range(first_leaf, first_leaf + num_leaves):
        node, height = leaf(i * k_first), 0
        while stack and stack[-1][0] == height:
            node = stack.pop()[1] + node
            height += 1
        stack.append((height, node))
    return stack[0][1]


def _slot_kernel(tg_ref, l_ref, x_ref, *refs, cfg, k_first: int, num_leaves: int, precision,
                 live_tiles: int, live_nb: int, nb: int):  # fmt: skip
    """Program (t, j): slot tile t times column block j % nb of weight j // nb."""
    *w_refs, o_ref = refs
    g = tg_ref[pl.program_id(0)]
    j = pl.program_id(1)
    which, jj = j // nb, j % nb
    layer = l_ref[0]
    bk = cfg.block_k
    live = g >= 0

    def product(w_ref) -> jax.Array:
        return tree_product(lambda start: x_ref[:, pl.ds(start, bk)], w_ref, layer, g,
                            rows=x_ref.shape[0], k_first=k_first, num_leaves=num_leaves,
                            live_tiles=live_tiles, bk=bk, precision=precision)  # fmt: skip

    for i, w_ref in enumerate(w_refs):

        @pl.when(live & (which == i) & (jj < live_nb))
        def _run(w_ref=w_ref):
            o_ref[...] = product(w_ref).astype(o_ref.dtype)

    if live_nb < nb:  # the plan's zero columns: zeros, not read from the weight

        @pl.when(live & (jj >= live_nb))
        def _zero():
            o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("leaf_k", "num_leaves", "out_dtype", "live_k",
                                             "live_n", "num_stages", "block_n", "num_warps"))
def grouped_pallas_slots(xs, ws, layer, tile_group, *, leaf_k: int, num_leaves: int, out_dtype,
                         live_k: int | None = None, live_n: int | None = None,
                         num_stages: int | None = None, block_n: int | None = None,
                         num_warps: int | None = None):  # fmt: skip
    """xs [P, K] in slot order (`gather_rows`) times each of `ws` (stacks [L, G, K, N] of one
    shape, layer `layer` [1]) -> [P, N] per weight in slot order; the slots of tiles that hold
    no row are not written. Arguments as grouped_matmul.py `_grouped_pallas`'s (no k_split:
    its f32 partials would be [P, N] each, P the layout's slots)."""
    dtype = jnp.promote_types(xs.dtype, ws[0].dtype)
    xs, ws = xs.astype(dtype), [w.astype(dtype) for w in ws]
    cfg = _mm.tile_config(leaf_k * num_leaves, ws[0].shape[3], dtype)
    k_first = -(-leaf_k // cfg.block_k)
    p, n = xs.shape[0], ws[0].shape[3]
    kp = num_leaves * k_first * cfg.block_k
    xs = _mm._pad_to(xs, 1, kp)
    ws = [_mm._pad_to(_mm._pad_to(w, 2, kp), 3, cfg.block_n) for w in ws]
    bn = glaunch.check(cfg, block_n, 1, num_leaves)
    nb = ws[0].shape[3] // bn
    bm = p // tile_group.shape[0]
    live_tiles = -(-(kp if live_k is None else live_k) // cfg.block_k)
    live_nb = -(-(nb * bn if live_n is None else live_n) // bn)
    kernel = functools.partial(_slot_kernel, cfg=cfg, k_first=k_first, num_leaves=num_leaves,
                               precision=_mm._precision(dtype), live_tiles=live_tiles,
                               live_nb=live_nb, nb=nb)  # fmt: skip
    interpret = _platform.interpret_default()
    params = glaunch.compiler_params(cfg, interpret, num_warps, num_stages)
    width = nb * bn
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((p, len(ws) * width), out_dtype),
        grid=(tile_group.shape[0], len(ws) * nb),
        in_specs=[
            pl.BlockSpec(tile_group.shape, lambda t, j: (0,)),
            pl.BlockSpec((1,), lambda t, j: (0,)),
            pl.BlockSpec((bm, kp), lambda t, j: (t, 0)),
            *[pl.BlockSpec((*w.shape[:2], kp, bn), lambda t, j: (0, 0, 0, j % nb)) for w in ws],
        ],
        out_specs=pl.BlockSpec((bm, bn), lambda t, j: (t, j)),
        interpret=interpret,
        compiler_params=params,
        name="grouped_matmul_slots" if len(ws) == 1 else "grouped_matmul_pair_slots",
    )(tile_group, jnp.asarray(layer, jnp.int32).reshape(1), xs, *ws)
    return tuple(out[:, i * width : i * width + n] for i in range(len(ws)))
