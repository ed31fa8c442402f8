"""Looped (prefill) paged attention as a Hopper Mosaic GPU kernel: TMA page loads into a ring of
SMEM slots filled by a producer warpgroup, wgmma on a consumer warpgroup (docs/PREFILL_ATTENTION.md,
step 2). Not wired into `Ops`: a candidate measured by benchmarks/attention_mosaic.py.

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
Fixed per model: 64 rows, block_kv, partition_size. Pipeline depth (`steps`), the grid order and
whether two tiles share a CTA are launch choices, never bits.

Paged K/V: the cache is one pool [L*K*P, page, E] (`layer` given) or [K*P, page, E]; a block of
block_kv tokens is block_kv / page TMA copies of [page, E] into consecutive rows of its slot, the
page index read as a scalar from the tile's page table (`attention_meta`'s `pt`) and offset by
(layer*K + k)*P. Pages past a context point at page 0 (finite, loaded and masked).
"""

from __future__ import annotations

import functools
import inspect
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention_kernels import ROWS, _next_pow2

_LOG2E = math.log2(math.e)
_BIG = 2**30  # a row limit above any context: "no valid row" for the tile's lowest limit


def compute_registers(consumers: int, producer: int = 40) -> int:
    """setmaxnreg of a consumer warpgroup (as Pallas's warp-specialised pipeline computes it)."""
    return int(min(256, (512 - producer) // consumers) // 8 * 8)


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
            num_pages: int, kv_heads: int, page: int, block_kv: int, partition_size: int,
            steps: int, mask_all: bool, nt: int, qk_scale: float, interpret: bool,
            consumers: int):  # fmt: skip
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (q_smem2, lim_smem2, k_smem, v_smem), (k_full, v_full, q_bar), (k_used, v_used) = scoped
    _, rows, e = q_smem2.shape
    dtype = q_smem2.dtype
    bk, ps = block_kv, partition_size
    ppb = bk // page  # pages per block
    nb = ps // bk  # blocks per partition
    kvh = lax.axis_index("kvh")
    tile = (nt - 1) - lax.axis_index("tile")  # a sequence's later tiles (longer) first
    wg = lax.axis_index("wg")

    def blocks(hi):
        return lax.div(jnp.maximum(hi, 0) + (bk - 1), jnp.int32(bk))

    # the producer streams the blocks of the tile's longest part
    n_blocks = blocks(functools.reduce(jnp.maximum, [bounds_ref[tile, w, 0]
                                                     for w in range(consumers)]))  # fmt: skip

    @pl.when(wg < consumers)
    def _consumer():
        plgpu.set_max_registers(compute_registers(consumers), action="increase")
        q_smem, lim_smem = q_smem2.at[wg], lim_smem2.at[wg]
        my_blocks = blocks(bounds_ref[tile, wg, 0])  # this part's own (module docstring)
        n_parts = lax.div(my_blocks + (nb - 1), jnp.int32(nb))
        lo = bounds_ref[tile, wg, 1]
        part_rows = pl.ds(wg * rows, rows)
        plgpu.copy_gmem_to_smem(q_ref.at[tile, kvh, part_rows], q_smem, q_bar.at[wg])
        plgpu.copy_gmem_to_smem(lim_ref.at[tile, part_rows], lim_smem, q_bar.at[wg])
        plgpu.barrier_wait(q_bar.at[wg])
        if interpret:  # the interpreter has no `plgpu.load` (layouts mean nothing there)
            lim = lim_smem[...]
        else:
            lim = _load(plgpu, lim_smem, plgpu.Layout.WGMMA.reduce(1))

        def lay(x, layout):  # the interpreter has no layouts
            return x if interpret else plgpu.layout_cast(x, layout)

        def sentinel():
            acc = lay(jnp.zeros((rows, e), jnp.float32), plgpu.Layout.WGMMA)
            vec = plgpu.Layout.WGMMA.reduce(1)
            return lay(jnp.full((rows,), -jnp.inf), vec), lay(jnp.zeros((rows,)), vec), acc

        def block(i, carry, masked: bool):
            m, lsum, acc = carry
            slot = lax.rem(i, jnp.int32(steps))
            plgpu.barrier_wait(k_full.at[slot])

            def qk(ref):
                plgpu.wgmma(ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                return ref[...]

            if interpret:  # the interpreter's wgmma takes no transposed ref: a plain dot
                s = _dot(q_smem[...], k_smem.at[slot][...], 1)
            else:
                s = pl.run_scoped(qk, plgpu.ACC((rows, bk), jnp.float32))
            plgpu.barrier_arrive(k_used.at[slot])
            if masked:
                if interpret:
                    cols = lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
                else:
                    cols = plgpu.broadcasted_iota(jnp.int32, (rows, bk), 1,
                                                  layout=plgpu.Layout.WGMMA)  # fmt: skip
                # kv position i*bk + col < lim, as col < lim - i*bk: one vector subtraction
                lim_b = lax.broadcast_in_dim(lim - i * bk, (rows, bk), [0])
                s = jnp.where(cols < lim_b, s, -jnp.inf)
            m_new = jnp.maximum(m, s.max(axis=1) * qk_scale)
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp2(m - m_safe)
            p = jnp.exp2(s * qk_scale - lax.broadcast_in_dim(m_safe, s.shape, [0]))
            lsum = lsum * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            p16 = p.astype(dtype)
            plgpu.barrier_wait(v_full.at[slot])

            def pv(ref):
                plgpu.wgmma(ref, p16, v_smem.at[slot])

            if interpret:  # no run_state there: P.V as a plain dot, added (other rounding)
                acc = acc + _dot(p16, v_smem.at[slot][...], 0)
            else:
                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            plgpu.barrier_arrive(v_used.at[slot])
            return m_new, lsum, acc

        def partition(j, state):
            first = j * nb
            n_blk = jnp.minimum(my_blocks - first, nb)
            # blocks wholly below every valid row's limit need no mask (an identity there)
            n_full = 0 if mask_all else jnp.clip(lax.div(lo, jnp.int32(bk)) - first, 0, n_blk)
            part = sentinel()
            part = lax.fori_loop(first, first + n_full,
                                 functools.partial(block, masked=False), part)  # fmt: skip
            part = lax.fori_loop(first + n_full, first + n_blk,
                                 functools.partial(block, masked=True), part)  # fmt: skip
            return _merge(state, part)

        mm, ll, aa = lax.fori_loop(0, n_parts, partition, sentinel())

        @pl.loop(my_blocks, n_blocks)
        def _(i):  # release the slots of blocks only the other part needs, in order
            slot = lax.rem(i, jnp.int32(steps))
            plgpu.barrier_wait(k_full.at[slot])
            plgpu.barrier_arrive(k_used.at[slot])
            plgpu.barrier_wait(v_full.at[slot])
            plgpu.barrier_arrive(v_used.at[slot])
        safe = jnp.where(ll > 0.0, ll, 1.0)
        out = aa / lax.broadcast_in_dim(safe, aa.shape, [0])
        q_smem[...] = out.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_ref.at[tile, kvh, part_rows])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == consumers)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")
        base = (layer_ref[0] * kv_heads + kvh) * num_pages

        def load(i, slot):
            for p in range(ppb):
                pg = base + pt_ref[tile, i * ppb + p]
                dst = pl.ds(p * page, page)
                plgpu.copy_gmem_to_smem(k_ref.at[pg], k_smem.at[slot, dst], k_full.at[slot])
                plgpu.copy_gmem_to_smem(v_ref.at[pg], v_smem.at[slot, dst], v_full.at[slot])

        for i in range(steps):

            @pl.when(i < n_blocks)
            def _(i=i):
                load(jnp.int32(i), i)

        @pl.loop(jnp.int32(steps), jnp.maximum(n_blocks, steps))
        def _(i):
            slot = lax.rem(i, jnp.int32(steps))
            plgpu.barrier_wait(k_used.at[slot])
            plgpu.barrier_wait(v_used.at[slot])
            load(i, slot)

        @pl.loop(jnp.maximum(n_blocks - steps, 0), n_blocks)
        def _(i):  # observe the last blocks' releases too: every phase of a barrier is waited
            slot = lax.rem(i, jnp.int32(steps))
            plgpu.barrier_wait(k_used.at[slot])
            plgpu.barrier_wait(v_used.at[slot])


def _load(plgpu, ref, layout):
    """`plgpu.load` of a whole ref: JAX 0.10 wants the index, later JAXes deprecate (and then
    drop) it."""
    idx = inspect.signature(plgpu.load).parameters.get("idx")
    if idx is not None and idx.default is inspect.Parameter.empty:
        return plgpu.load(ref, (), layout=layout)
    return plgpu.load(ref, layout=layout)


def _dot(a, b, b_contract: int):
    """a[M, E] . b contracting b's axis `b_contract`, f32 (the interpreter's stand-in for
    wgmma, whose interpreted version takes no transposed operand)."""
    dims = (((1,), (b_contract,)), ((), ()))
    return lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _merge(state, part):
    """`paged_attention_kernels._merge` on the consumer's layouts: the one merge rule."""
    mm, ll, aa = state
    mj, lj, aj = part
    m_new = jnp.maximum(mm, mj)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    a = jnp.exp2(mm - m_safe)
    b = jnp.exp2(mj - m_safe)
    ll = ll * a + lj * b
    aa = aa * lax.broadcast_in_dim(a, aa.shape, [0]) + aj * lax.broadcast_in_dim(b, aj.shape, [0])
    return m_new, ll, aa


def _interpret_params():
    """Mosaic GPU's interpreter (a JAX that has it: 0.10 does), for the CPU tests."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams

    return InterpretGPUParams()


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
        kern = functools.partial(
            _kernel, num_pages=num_pages, kv_heads=kv_heads, page=page, block_kv=block_kv,
            partition_size=partition_size, steps=steps, mask_all=mask_all, nt=nt,
            qk_scale=float(scale) * _LOG2E, interpret=interpret is not None,
            consumers=consumers)  # fmt: skip
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


@functools.partial(
    jax.jit,
    static_argnames=("scale", "partition_size", "block_kv", "steps", "mask_all", "consumers",
                     "interpret"),
)
def paged_attention_mosaic(q, k_cache, v_cache, page_table, context_lens, query_start, positions,
                           *, scale: float, partition_size: int = 512, layer=None,
                           block_kv: int = 64, steps: int = 2, mask_all: bool = False,
                           consumers: int = 1, meta: dict | None = None,
                           interpret=None) -> jax.Array:  # fmt: skip
    """Causal attention of q[T, H, E] over the paged cache (`paged_attention`'s arguments;
    k/v caches [K, P, B, E], or [L, K, P, B, E] with `layer`). Returns [T, H, E]; rows of
    padding tokens are zeros. `interpret`: Mosaic GPU's interpreter (CPU tests), passed to
    `plgpu.kernel` where this JAX has it."""
    from pallas_kernels.paged_attention_pallas import attention_meta

    t, h, e = q.shape
    if layer is None:
        k_cache, v_cache = k_cache[None], v_cache[None]
        layer = jnp.int32(0)
    _, kh, num_pages, page, _ = k_cache.shape
    g = h // kh
    gp = _next_pow2(g)
    if meta is None:
        meta = attention_meta(page_table, context_lens, query_start, positions, t=t, g=g,
                              num_pages=num_pages, page_size=page,
                              partition_size=partition_size,
                              block_rows=ROWS * consumers)  # fmt: skip
    tok_c, lim, pt = meta["tok_c"], meta["lim"], meta["pt"]
    nt, block_q = tok_c.shape
    qg = q.reshape(t, kh, g, e)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    q_tiles = qg[tok_c].transpose(0, 2, 1, 3, 4).reshape(nt, kh, ROWS * consumers, e)
    out = looped_tiles(
        q_tiles, k_cache.reshape(-1, page, e), v_cache.reshape(-1, page, e), pt, lim,
        tile_bounds(lim, consumers), jnp.asarray(layer, jnp.int32).reshape(1), scale=scale,
        num_pages=num_pages, kv_heads=kh, block_kv=block_kv, partition_size=partition_size,
        steps=steps, mask_all=mask_all, consumers=consumers, interpret=interpret)  # fmt: skip
    tok_ok, tok_tile, tok_row = meta["tok_ok"], meta["tok_tile"], meta["tok_row"]
    out = out.reshape(nt, kh, block_q, gp, e)[tok_tile, :, tok_row][:, :, :g]
    out = jnp.where(tok_ok[:, None, None, None], out, jnp.zeros((), q.dtype))
    return out.reshape(t, h, e)
