"""Looped (prefill) paged attention as a Hopper Mosaic GPU kernel: TMA page loads into a ring of
SMEM slots filled by a producer warpgroup, wgmma on a consumer warpgroup (docs/PREFILL_ATTENTION.md,
step 2), and `paged_attention_mosaic`, the family's entry (structure looped, split or auto).
The partition body, merge and producer ring live in paged_attention_mosaic_body.py, shared with
the split (decode) pair of paged_attention_mosaic_decode.py: one plan, two layouts, one set of
bits. `Ops` runs it on Hopper under JDET_ATTENTION=mosaic (pallas_kernels/_platform.py); launch
candidates are measured by benchmarks/attention_mosaic*.py and attention_steps.py.

Reduction plan (version 2 of pallas_kernels/paged_attention.py's; other bits than the Triton
kernel, the same structure):
- Query tiles as `attention_meta` cuts them (64 rows = block_q tokens x G_pad heads of one KV
  head, one sequence per tile); a tile is one wgmma M. Grid (KV head, tile), longest tiles first.
- KV partitions of `partition_size` aligned to position 0; inside partition j, the online softmax
  over blocks of `block_kv` in increasing order from the sentinel (-inf, 0, 0), with c =
  scale*log2(e) and qk the f32 wgmma result:
      s = qk, or -inf where kv_pos >= lim (blocks that reach past the tile's lowest row limit)
      m' = max(m, rowmax(s) * c);  m* = (m' == -inf ? 0 : m')
      p = exp2(s * c - m*);  alpha = exp2(m - m*);  l = l*alpha + rowsum p
      acc = acc*alpha + p.astype(v) @ v  (wgmma, P from registers);  m = m'
  The max is taken on raw qk and scaled once (exact: rounding is monotone and c > 0); exp2 is
  the approximate instruction (`approx_math`). A block is masked only where some valid row of
  the tile has lim below its end: `where` with an all-true mask is an identity, so which blocks
  take the masked loop never changes a bit (benchmarks/attention_mosaic.py checks the compiled
  code keeps that: one-shot, chunked and single-token decodes give equal rows).
- Partitions fold in increasing j by `paged_attention_kernels._merge`'s rule (the same
  expressions on the consumer's registers); out = A / L (0 where L = 0).
- The tile stops after its last needed block (`n_blk`): blocks past a row's own limit are exact
  identities on that row, so the rows' bits do not depend on their neighbours.
Fixed per model: 64 rows, block_kv, partition_size. Pipeline depth (`steps`), the grid order,
whether two tiles share a CTA and the looped or split layout are launch choices, never bits.

Paged K/V: the cache is one pool [L*K*P, page, E] (`layer` given) or [K*P, page, E]; a block of
block_kv tokens is block_kv / page TMA copies of [page, E] into consecutive rows of its slot, the
page index read as a scalar from the tile's page table (`attention_meta`'s `pt`) and offset by
(layer*K + k)*P. Pages past a context point at page 0 (finite, loaded and masked).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention_kernels import ROWS, _next_pow2
from pallas_kernels.paged_attention_mosaic_body import (
    _LOG2E,
    _interpret_params,
    _load_lim,
    _sentinel,
    _Static,
    compute_registers,
    finish,
    merge,
    partition_body,
    produce,
)

_BIG = 2**30  # a row limit above any context: "no valid row" for the tile's lowest limit


def tile_bounds(lim: jax.Array, consumers: int = 1) -> jax.Array:
    """[NT, consumers, 2] int32 per 64-row part of a tile: (highest row limit, lowest limit of
    a valid row), from `attention_meta`'s lim [NT, rows] (-1 marks a padding row).
    Batch-derived, no arithmetic of the attention: the kernel reads them as scalars to size its
    loops."""
    lim = lim.reshape(lim.shape[0], consumers, -1)
    hi = jnp.max(lim, axis=2)
    lo = jnp.min(jnp.where(lim >= 0, lim, _BIG), axis=2)
    return jnp.stack([hi, lo], axis=2).astype(jnp.int32)


def _kernel(layer_ref, bounds_ref, pt_ref, lim_ref, q_ref, k_ref, v_ref, o_ref, scoped, *,
            st: _Static, nt: int, consumers: int):  # fmt: skip
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (q_smem2, lim_smem2, k_smem, v_smem), (k_full, v_full, q_bar), (k_used, v_used) = scoped
    ring = (k_smem, v_smem, k_full, v_full, k_used, v_used)
    _, rows, e = q_smem2.shape
    kvh = lax.axis_index("kvh")
    tile = (nt - 1) - lax.axis_index("tile")  # a sequence's later tiles (longer) first
    wg = lax.axis_index("wg")
    # the producer streams the blocks of the tile's longest part
    n_blocks = st.blocks(functools.reduce(jnp.maximum, [bounds_ref[tile, w, 0]
                                                        for w in range(consumers)]))  # fmt: skip

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(compute_registers(consumers), action="increase")
        q_smem, lim_smem = q_smem2.at[wg], lim_smem2.at[wg]
        my_blocks = st.blocks(bounds_ref[tile, wg, 0])  # this part's own (module docstring)
        n_parts = lax.div(my_blocks + (st.nb - 1), jnp.int32(st.nb))
        lo = bounds_ref[tile, wg, 1]
        part_rows = pl.ds(wg * rows, rows)
        plgpu.copy_gmem_to_smem(q_ref.at[tile, kvh, part_rows], q_smem, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(lim_ref.at[tile, part_rows], lim_smem, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        lim = _load_lim(lim_smem, st)

        def fold(j, state):
            return merge(state, partition_body(j, 0, my_blocks, lo, q_smem, lim, ring, st))

        state = lax.fori_loop(0, n_parts, fold, _sentinel(rows, e, st))

        @pl.loop(my_blocks, n_blocks)
        def _(i):  # release the slots of blocks only the other part needs, in order
            slot = lax.rem(i, jnp.int32(st.steps))
            plgpu.barrier_wait(k_full.at[slot])
            plgpu.barrier_arrive(k_used.at[slot])
            plgpu.barrier_wait(v_full.at[slot])
            plgpu.barrier_arrive(v_used.at[slot])

        q_smem[...] = finish(state).astype(q_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[tile, kvh, part_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        base = (layer_ref[0] * st.kv_heads + kvh) * st.num_pages
        produce(jnp.int32(0), n_blocks, base, lambda x: pt_ref[tile, x], k_ref, v_ref, ring, st)


def looped_tiles(q_tiles, k_pool, v_pool, pt, lim, bounds, layer, *, scale: float,
                 num_pages: int, kv_heads: int, block_kv: int = 64, partition_size: int = 512,
                 steps: int = 2, mask_all: bool = False, consumers: int = 1,
                 interpret=None) -> jax.Array:  # fmt: skip
    """The kernel on query tiles [NT, K, rows, E] (`attention_meta`'s layout): [NT, K, rows, E].

    k_pool/v_pool [pages, page, E] (the stacked cache flattened: (layer*K + k)*P + page), pt and
    lim `attention_meta`'s, bounds `tile_bounds(lim)`, layer [1] int32 (0 for a one-layer pool).
    """
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nt, kh, rows, e = q_tiles.shape
    page = k_pool.shape[1]
    dtype = q_tiles.dtype
    if rows != ROWS * consumers or partition_size % block_kv or block_kv % page or block_kv % 64:
        raise ValueError(f"rows {rows} must be {ROWS} per consumer, block_kv ({block_kv}) a "
                         f"multiple of 64 and of the page ({page}) dividing partition_size "
                         f"({partition_size})")  # fmt: skip
    steps = max(2, steps)
    tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
    fills = block_kv // page

    def entry(layer_ref, bounds_ref, pt_ref, lim_ref, q_ref, k_ref, v_ref, o_ref):
        from jax.experimental import pallas as pl

        smem = (
            plgpu.SMEM((consumers, ROWS, e), dtype, transforms=tr),
            plgpu.SMEM((consumers, ROWS), jnp.int32),
            plgpu.SMEM((steps, block_kv, e), dtype, transforms=tr),
            plgpu.SMEM((steps, block_kv, e), dtype, transforms=tr),
        )
        st = _Static(block_kv, partition_size, page, steps, float(scale) * _LOG2E,
                     interpret is not None, mask_all, num_pages, kv_heads)  # fmt: skip
        kern = functools.partial(_kernel, st=st, nt=nt, consumers=consumers)
        pl.run_scoped(
            lambda *args: kern(layer_ref, bounds_ref, pt_ref, lim_ref, q_ref, k_ref, v_ref,
                               o_ref, args),
            smem,
            (plgpu.Barrier(num_arrivals=fills, num_barriers=steps),
             plgpu.Barrier(num_arrivals=fills, num_barriers=steps),
             plgpu.Barrier(num_arrivals=2, num_barriers=consumers)),
            (plgpu.Barrier(num_arrivals=consumers, num_barriers=steps),) * 2,
            collective_axes="wg",
        )  # fmt: skip

    return plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(q_tiles.shape, dtype),
        grid=(kh, nt),
        grid_names=("kvh", "tile"),
        num_threads=consumers + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else {"interpret": _interpret_params()}),
    )(layer, bounds, pt, lim, q_tiles, k_pool, v_pool)


# The Hopper plan's fixed block (part of the bits) and the launch the engine runs (not bits):
# 128-token blocks, two consumer warpgroups on a 128-row tile of one sequence where the looped
# layout runs (benchmarks/attention_mosaic.py: 0.83-0.84x cuDNN flash at 8k-32k on an H200).
BLOCK_KV = 128
CONSUMERS = 2


def launch_plan(t: int, page_table_shape: tuple, kv_heads: int, g: int, e: int, page: int,
                partition_size: int, structure: str = "auto",
                consumers: int = CONSUMERS) -> tuple[str, int]:  # fmt: skip
    """(structure, consumers) from static shapes alone: "auto" takes
    paged_attention_mosaic_decode's `auto_structure`; the split layout runs one consumer. The
    query tiles then hold 64 * consumers rows (`attention_meta`'s `block_rows`). Never a bit."""
    from pallas_kernels import paged_attention_mosaic_decode as dec

    if structure == "auto":
        structure = dec.auto_structure(t, page_table_shape, kv_heads, _next_pow2(g), e, page,
                                       partition_size)  # fmt: skip
    if structure not in ("split", "looped"):
        raise ValueError(f"structure must be auto, split or looped; got {structure!r}")
    return structure, 1 if structure == "split" else consumers


@functools.partial(
    jax.jit,
    static_argnames=("scale", "partition_size", "block_kv", "steps", "mask_all", "consumers",
                     "structure", "reverse_merge", "interpret", "q_heads", "out_rows"),
)
def paged_attention_mosaic(q, k_cache, v_cache, page_table, context_lens, query_start, positions,
                           *, scale: float, partition_size: int = 512, layer=None,
                           block_kv: int = 64, steps: int = 2, mask_all: bool = False,
                           consumers: int = 1, structure: str = "looped",
                           reverse_merge: bool = False, interpret=None, meta: dict | None = None,
                           q_heads: int | None = None,
                           out_rows: int | None = None) -> jax.Array:  # fmt: skip
    """Causal attention of q[T, H, E] over the paged cache (`paged_attention`'s arguments;
    k/v caches [K, P, B, E], or [L, K, P, B, E] with `layer`). Returns [T, H, E] ([out_rows,
    H, E] given `out_rows`); rows of padding tokens are zeros. `structure`: "looped" (this
    module's kernel), "split" (one consumer: paged_attention_mosaic_decode's split kernel and
    merge) or "auto" (`launch_plan`); the same bits. `meta`: the step's `attention_meta`, cut
    for `launch_plan`'s 64 * consumers rows; `q_heads` (H): q is already its query tiles [NT,
    K, rows, E] (pallas_kernels/rope_kv.py). `reverse_merge`: the split merge folds in
    decreasing order (a negative control for the tests, never a plan). `interpret`: Mosaic
    GPU's interpreter."""
    from pallas_kernels import paged_attention_mosaic_decode as dec
    from pallas_kernels.paged_attention_pallas import attention_meta

    if layer is None:
        k_cache, v_cache = k_cache[None], v_cache[None]
        layer = jnp.int32(0)
    _, kh, num_pages, page, e = k_cache.shape
    h = q.shape[1] if q_heads is None else q_heads
    t = q.shape[0] if q_heads is None else meta["tok_tile"].shape[0]
    g = h // kh
    gp = _next_pow2(g)
    structure, consumers = launch_plan(t, page_table.shape, kh, g, e, page, partition_size,
                                       structure, consumers)  # fmt: skip
    if meta is None:
        meta = attention_meta(page_table, context_lens, query_start, positions, t=t, g=g,
                              num_pages=num_pages, page_size=page,
                              partition_size=partition_size,
                              block_rows=ROWS * consumers)  # fmt: skip
    lim, pt = meta["lim"], meta["pt"]
    if lim.shape[1] != ROWS * consumers:
        raise ValueError(f"attention_meta cut {lim.shape[1]}-row tiles; the {structure} launch "
                         f"runs {ROWS * consumers}: cut it with launch_plan's consumers")
    nt, block_q = meta["tok_c"].shape
    if q_heads is None:
        qg = q.reshape(t, kh, g, e)
        if gp != g:
            qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
        q = qg[meta["tok_c"]].transpose(0, 2, 1, 3, 4).reshape(nt, kh, ROWS * consumers, e)
    bounds = tile_bounds(lim, consumers)
    kw = dict(scale=scale, num_pages=num_pages, kv_heads=kh, block_kv=block_kv,
              partition_size=partition_size, steps=steps, mask_all=mask_all,
              interpret=interpret)  # fmt: skip
    kv = (k_cache.reshape(-1, page, e), v_cache.reshape(-1, page, e))
    args = (q, *kv, pt, lim, bounds, jnp.asarray(layer, jnp.int32).reshape(1))
    if structure == "split":
        parts = dec.split_tiles(*args, **kw)
        out = dec.merge_tiles(*parts, bounds, dtype=q.dtype, block_kv=block_kv,
                              partition_size=partition_size, steps=steps,
                              reverse=reverse_merge, interpret=interpret)  # fmt: skip
    else:
        out = looped_tiles(*args, consumers=consumers, **kw)
    tok_ok, tok_tile, tok_row = meta["tok_ok"], meta["tok_tile"], meta["tok_row"]
    out = out.reshape(nt, kh, block_q, gp, e)[tok_tile, :, tok_row][:, :, :g]
    out = jnp.where(tok_ok[:, None, None, None], out, jnp.zeros((), q.dtype)).reshape(t, h, e)
    if out_rows is not None and out_rows > t:
        out = jnp.pad(out, ((0, out_rows - t), (0, 0), (0, 0)))
    return out
