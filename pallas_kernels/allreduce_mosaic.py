"""The pairwise tree all-reduce as one Mosaic GPU kernel (Hopper): every device pulls each peer's
partial over NVLink and adds the whole tree itself (sharding/tree_allreduce.py's "pull").

Reduction plan (`reference`): n devices on the mesh axis (a power of two); device r holds its
partial as G leaf groups parts_r[g] [R, C] (G a power of two: the tree matmul's group results,
tree_mosaic.tree_parts; G = 1 for a plain partial). Every element of every device's result is the
one pairwise tree over the n*G leaves in rank-major order (leaf r*G + g):

    ((p0[0] + p0[1]) + (p1[0] + p1[1]))                                   (n = 2, G = 2)

that is `combine_tree` of each device's groups (its partial, as XLA would add them), then
`combine_tree` over the devices: the expression every tree_allreduce schedule computes. Each
addition is one f32 add rounded once to the parts' dtype (for a 16-bit dtype, its correctly rounded
add). With a residual x [R, C], the result is x + sum.astype(x.dtype), added in f32 and rounded
once to x.dtype: the correctly rounded sum, so the bits of XLA's `x + s.astype(x.dtype)`
(rms_norm.add_rms_norm makes the same add). Only rows [0, live) are reduced; rows [live, R) are
padding (`Ops.row_pad`'s rows): they are x's rows, or zeros without x.

Nothing else enters an element: one thread computes it whole from the same positions of the same
leaves, so how the rows are split over CTAs (`split`) moves work, never changes a bit.

Work: rows [0, live) of a leaf are one contiguous range, cut into `blocks` equal tiles of whole
UNITs (256 elements: 128 threads x 2), one tile per CTA of one warpgroup. A CTA loads its tile of
every leaf, its own and its peers' (`plgpu.remote_ref`), adds them in the tree's order (a binary
counter: at most log2(n*G) + 1 tiles live), adds x, stores. The first `pad_blocks` CTAs also copy
the padding rows. At most MAX_BLOCKS CTAs, fewer than an H100/H200 has SMs, so every CTA of a
launch is resident at once (CTA b waits for CTA b of each peer, never for an unscheduled one).

Synchronisation: once its loads are done, CTA b signals the semaphore of CTA b on every peer and
waits for n - 1 signals, so no device's kernel ends (and lets XLA reuse its partial) while a peer
may still read it. The semaphores are block-scoped scratch, zeroed for every call. XLA:GPU hands
the kernel its peers' buffer addresses (collective metadata) and launches it after a cross-device
barrier, so a peer's partial is complete when it is read.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.combine import combine_tree

VEC = 2  # elements a thread loads and stores at once: 8-byte f32 vectors, 4-byte 16-bit ones
UNIT = 128 * VEC  # elements: a tile is whole units of the warpgroup's strided layout
TILE_UNITS = 8  # the tile `split` aims for: 16 elements per thread per leaf
MAX_TILE_UNITS = 16  # 32 elements per thread per leaf; larger payloads are not supported
MAX_BLOCKS = 128  # CTAs of one launch (an H100/H200 has 132 SMs)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def split(units: int) -> tuple[int, int] | None:
    """(blocks, units per tile) for a range of `units` units: equal tiles of at most
    MAX_TILE_UNITS units, at most MAX_BLOCKS of them, as close above min(TILE_UNITS, units // 16)
    as the divisors of `units` allow (so a decode-sized range still spreads over 16 CTAs); None
    when no tiling fits."""
    want = max(1, min(TILE_UNITS, units // 16))
    fits = [d for d in range(1, min(units, MAX_TILE_UNITS) + 1)
            if units % d == 0 and units // d <= MAX_BLOCKS]  # fmt: skip
    if not fits:
        return None
    above = [d for d in fits if d >= want]
    tile = min(above) if above else max(fits)
    return units // tile, tile


def unsupported(parts_shape: tuple, dtype: Any, n: int, residual: Any = None,
                live: int | None = None) -> str | None:  # fmt: skip
    """Why `allreduce` cannot take these operands (a sentence), or None when it can.
    `residual`: the residual's (shape, dtype), or None."""
    if len(parts_shape) != 3:
        return f"parts must be [G, rows, cols], got shape {parts_shape}"
    g, rows, cols = parts_shape
    live = rows if live is None else live
    if n < 2 or n & (n - 1):
        return f"the mesh axis must have a power-of-two size >= 2, got {n}"
    if g < 1 or g & (g - 1):
        return f"the leaf groups must be a power of two, got {g}"
    if jnp.dtype(dtype) not in DTYPES:
        return f"parts must be float32, bfloat16 or float16, got {jnp.dtype(dtype)}"
    if residual is not None:
        shape, rdt = residual
        if tuple(shape) != (rows, cols) or jnp.dtype(rdt) not in DTYPES:
            return f"the residual must be a float [{rows}, {cols}], got {rdt}{list(shape)}"
    if not 0 < live <= rows:
        return f"live rows must be in 1..{rows}, got {live}"
    if (live * cols) % UNIT or ((rows - live) * cols) % UNIT:
        return f"live rows x cols ({live} x {cols}) and the padding rows must be whole {UNIT}s"
    if split(live * cols // UNIT) is None or (live < rows and split((rows - live) * cols // UNIT)
                                              is None):  # fmt: skip
        return (f"{live} x {cols} elements do not fit {MAX_BLOCKS} CTAs of at most "
                f"{MAX_TILE_UNITS * UNIT} elements; use an NCCL schedule")  # fmt: skip
    return None


def _add(a: jax.Array, b: jax.Array) -> jax.Array:
    """a + b as one f32 add rounded once to their dtype (tree_sum_reference's add, any float)."""
    if a.dtype == jnp.float32:
        return a + b
    return (a.astype(jnp.float32) + b.astype(jnp.float32)).astype(a.dtype)


def _kernel(*refs, axis_name: str, n: int, groups: int, leaf_stride: int, blocks: int, tile: int,
            pad_blocks: int, pad_tile: int, pad_start: int, has_residual: bool):  # fmt: skip
    if has_residual:
        parts_ref, res_ref, out_ref, done = refs
    else:
        (parts_ref, out_ref, done), res_ref = refs, None
    b = lax.axis_index("blocks")
    me = lax.axis_index(axis_name)
    grid = max(blocks, pad_blocks)

    def reduce() -> None:
        layout = plgpu.Layout.WG_STRIDED((tile,), vec_size=VEC)
        start = b * tile
        stack: list[tuple[int, jax.Array]] = []
        for i in range(n * groups):  # leaf i = group g of rank r, in the tree's order
            r, g = divmod(i, groups)
            peer = plgpu.remote_ref(parts_ref, {axis_name: r})
            node = plgpu.load(peer, pl.ds(g * leaf_stride + start, tile), layout=layout)
            height = 0
            while stack and stack[-1][0] == height:  # the lower block always on the left
                node = _add(stack.pop()[1], node)
                height += 1
            stack.append((height, node))
        [(_, total)] = stack
        if res_ref is not None:
            x = plgpu.load(res_ref, pl.ds(start, tile), layout=layout)
            f32 = jnp.float32
            total = (x.astype(f32) + total.astype(x.dtype).astype(f32)).astype(x.dtype)
        out_ref[pl.ds(start, tile)] = total
        for d in range(1, n):  # "done reading your tile b" to every peer, then wait for theirs
            pl.semaphore_signal(done, 1, device_id={axis_name: (me + d) % n})
        pl.semaphore_wait(done, n - 1)

    def pad() -> None:
        start = pad_start + b * pad_tile
        if res_ref is not None:
            layout = plgpu.Layout.WG_STRIDED((pad_tile,), vec_size=VEC)
            out_ref[pl.ds(start, pad_tile)] = plgpu.load(res_ref, pl.ds(start, pad_tile),
                                                         layout=layout)  # fmt: skip
        else:
            out_ref[pl.ds(start, pad_tile)] = jnp.zeros((pad_tile,), out_ref.dtype)

    for body, count in ((reduce, blocks), (pad, pad_blocks)):
        if count == grid:
            body()
        elif count:
            pl.when(b < count)(body)

    # Never runs: a write to the partial makes XLA:GPU place it where peers can read it (as jax's
    # ops/gpu/all_gather_mgpu.py does for its operand).
    @pl.when(me == -1)
    def _never() -> None:
        parts_ref[0] = jnp.asarray(0, parts_ref.dtype)


def allreduce(parts: jax.Array, axis_name: str, n: int, *, residual: jax.Array | None = None,
              live: int | None = None) -> jax.Array:  # fmt: skip
    """The tree sum over mesh axis `axis_name` (size n) of the partials given as leaf groups
    parts [G, R, C], plus `residual` [R, C] if given, over rows [0, live) (default all); rows past
    `live` are the residual's (zeros without one). Returns [R, C] in the residual's dtype, else
    the parts'. Call inside `shard_map` on Hopper GPUs of one process; raises ValueError for
    operands it does not take (`unsupported`)."""
    g, rows, cols = parts.shape
    live = rows if live is None else int(live)
    res = None if residual is None else (residual.shape, residual.dtype)
    if why := unsupported(parts.shape, parts.dtype, n, res, live):
        raise ValueError(f"the pull all-reduce cannot run: {why}")
    blocks, tile_units = split(live * cols // UNIT)
    pad_blocks, pad_units = split((rows - live) * cols // UNIT) if live < rows else (0, 0)
    out_dtype = parts.dtype if residual is None else residual.dtype
    kernel = functools.partial(
        _kernel, axis_name=axis_name, n=n, groups=g, leaf_stride=rows * cols, blocks=blocks,
        tile=tile_units * UNIT, pad_blocks=pad_blocks, pad_tile=pad_units * UNIT,
        pad_start=live * cols, has_residual=residual is not None,
    )  # fmt: skip
    operands = [parts.reshape(-1)] + ([] if residual is None else [residual.reshape(-1)])
    out = plgpu.kernel(
        _named(kernel),
        out_type=jax.ShapeDtypeStruct((rows * cols,), out_dtype),
        grid=(max(blocks, pad_blocks),),
        grid_names=("blocks",),
        scratch_types=[plgpu.SemaphoreType.REGULAR],
        compiler_params=plgpu.CompilerParams(),
    )(*operands)
    return out.reshape(rows, cols)


def _named(kernel: functools.partial) -> Any:
    """The kernel under the name profiles show for it (plgpu.kernel names it after the body)."""

    def tree_allreduce_pull(*refs: Any) -> None:
        kernel(*refs)

    return tree_allreduce_pull


def reference(parts: list, residual: np.ndarray | None = None,
              live: int | None = None) -> np.ndarray:  # fmt: skip
    """Pure-numpy result of `allreduce` on every device: parts[r] is device r's [G, R, C]."""
    p0 = np.asarray(parts[0])
    rows = p0.shape[1]
    live = rows if live is None else live
    total = combine_tree([combine_tree(list(np.asarray(p)[:, :live])) for p in parts])
    if residual is None:
        return np.concatenate([total, np.zeros((rows - live, p0.shape[2]), p0.dtype)])
    x = np.asarray(residual)
    return np.concatenate([x[:live] + total.astype(x.dtype), x[live:]])
