"""Paged attention for a flat ragged batch of prefill chunks and decodes, bitwise invariant.

One kernel serves one-shot prefill, chunked prefill and decode. A query token at position p of
sequence s attends to KV positions 0..p of s, read from the paged cache (which already holds this
step's K/V). Its output bits depend only on (its query vector, p, s's KV values): not on the other
rows of the batch, the chunk it came in, the number of tokens, or which physical pages hold the KV.

Reduction plan (docs/ARCHITECTURE.md; split-KV, as flash-decoding):
- KV positions are cut into fixed partitions of `partition_size` tokens aligned to position 0
  (partition j covers [j*PS, (j+1)*PS)). PS is a multiple of the page size.
- Inside a partition, one query row runs the online softmax over fixed KV blocks of `block_kv`
  tokens in increasing order, starting from the sentinel (m, l, acc) = (-inf, 0, 0):
      s = (q . k) * scale*log2(e)   (f32, one MMA of fixed shape [rows, E] x [E, block_kv])
      s = -inf where kv_pos > p;  m' = max(m, rowmax s);  m* = (m' == -inf ? 0 : m')
      p = exp2(s - m*);  alpha = exp2(m - m*);  l = l*alpha + rowsum p
      acc = acc*alpha + p.astype(v) @ v;  m = m'
  A block that is fully masked for a row is an exact identity on that row's state (alpha = 1,
  p = 0), and a row that has seen nothing stays at the sentinel (alpha = exp2(-inf) = 0). So the
  blocks a *tile* visits beyond a row's own position never change that row's bits.
- Partitions merge in increasing j with the same rule, for every query (prefill and decode):
      m' = max(M, m_j); m* = (m' == -inf ? 0 : m'); a = exp2(M - m*); b = exp2(m_j - m*)
      L = L*a + l_j*b;  A = A*a + acc_j*b;  M = m'
  Empty or padded partitions carry (-inf, 0, 0) and vanish (a = 1, b = 0). out = A / L.
- Query tiling: a program handles `block_q` consecutive tokens of ONE sequence times the G query
  heads of one KV head: rows = block_q * G_pad, a fixed number (ROWS) chosen from G only. Every
  row of every call therefore goes through the same MMA shape, the same KV blocks (up to exact
  identities) and the same merge order; other rows of the tile (other tokens, padding) cannot
  touch its bits because MMA rows and the row-wise max/sum are independent.
- Parallelism, two program layouts with the same arithmetic (same `_partition`, `_merge`,
  `_finish` code, one partition folded per loop step in both):
  'split'  (decode-heavy steps): grid (query tile, kv head, partition) writes each partition's
           (m, l, acc) for the real rows, then a merge kernel, grid (tile, kv head, token), folds
           them in increasing order (flash-decoding: a few long decodes still fill the GPU);
  'looped' (prefill-heavy steps): grid (query tile, kv head), partitions computed and folded in
           registers, no partials round trip.
  'auto' picks from the static shapes (T, S, K) only; the tests check both layouts give the
  same bits (interpret mode and compiled on an H100). Caveat found on the way: XLA CPU rounds
  an unrolled chain of merges differently from a loop of single merges (FMA contraction,
  presumably), so
  the loop shape is part of the plan, and the layouts keep it identical.
- Fixed per model: ROWS (MMA M), block_kv, partition_size, num_warps — bits change if any does.
  How K/V and the page indices are loaded and the split kernel's pipeline depth
  (`AttentionConfig`: by default 2-D gathers, indices ahead of the loop, a static block loop
  whose extra blocks are the exact identities above) are not part of the plan: no summed value
  or order changes (every setting gives the same bits,
  tests/pallas_kernels/test_attention_knobs_gpu.py).

Nothing depends on T, S or the batch composition except how many programs run.

Requirement: every cache slot holds finite values (`init_kv_cache` zero-fills). A masked column
contributes p = 0, and 0 * v is 0 only for finite v; slots past a context inside its last page
(and page 0, which padded page-table entries point at) are loaded and masked, never trusted.

Backends: `pl.pallas_call` — compiled with the Triton lowering on a GPU. On a CPU
`xla_attention.paged_attention` runs instead (the same KV blocks aligned to position 0, in plain
XLA; its plan is in that module), or this kernel in interpret mode with JDET_PALLAS_INTERPRET=1.
Invariance holds within a backend; bits differ across backends.

Files: this one holds the plan (above), the public entry point and the references;
`paged_attention_kernels.py` the kernel bodies; `paged_attention_pallas.py` their `pallas_call`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _platform, xla_attention
from pallas_kernels._platform import as_float, kv_compute_dtype
from pallas_kernels.paged_attention_kernels import (
    DEFAULT_CONFIG,
    ROWS,
    AttentionConfig,
    _check,
    default_block_kv,
)
from pallas_kernels.paged_attention_mosaic import BLOCK_KV as MOSAIC_BLOCK_KV
from pallas_kernels.paged_attention_mosaic import CONSUMERS as MOSAIC_CONSUMERS
from pallas_kernels.paged_attention_mosaic import launch_plan, paged_attention_mosaic
from pallas_kernels.paged_attention_pallas import _paged_attention_pallas, attention_meta


def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    context_lens: jax.Array,
    query_start: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    partition_size: int = 512,
    layer: jax.Array | None = None,
    block_kv: int | None = None,
    structure: str = "auto",
    block_rows: int = ROWS,
    num_warps: int = 4,
    num_stages: int | None = None,
    backend: str | None = None,
    meta: dict | None = None,
    out_rows: int | None = None,
    q_heads: int | None = None,
    direct_out: bool = False,
    config: AttentionConfig = DEFAULT_CONFIG,
    kernel: str = "triton",
) -> jax.Array:
    """Causal attention of q[T, H, E] over the paged cache, bitwise invariant (module docstring).

    `backend`: 'auto' (this kernel; on a CPU `xla_attention.paged_attention`, the same KV blocks
    aligned to position 0, unless JDET_PALLAS_INTERPRET=1), 'pallas' or 'xla'. The other
    arguments are `_paged_attention_pallas`'s; `structure`, `block_rows` and the launch
    parameters only concern the Pallas kernel. `meta` (the Pallas kernel's batch-derived
    operands, `attention_meta`) and `out_rows` (return that many rows, zeros past T) let a
    caller hoist per-step work out of its layer loop and skip the next matmul's row padding.
    `q_heads`: q is already the Pallas kernel's query tiles (pallas_kernels/rope_kv.py); the
    XLA version takes q[T, H, E] only and refuses it. `direct_out`: the Pallas merge kernel
    writes the final rows itself (`_paged_attention_pallas`); the XLA version ignores it, and
    `config` (`AttentionConfig`: how the Pallas kernels load and launch, never their bits).
    `kernel`: the Pallas kernel family, "triton" (this module's plan) or "mosaic" (Hopper:
    pallas_kernels/paged_attention_mosaic.py, version 2 of the plan, other bits; its `meta` is
    cut for its `launch_plan`, and `block_rows`, `direct_out` and `config` do not apply).
    """
    if kernel not in ("triton", "mosaic"):
        raise ValueError(f"paged_attention: kernel must be 'triton' or 'mosaic', got {kernel!r}")
    if _platform.resolve(backend, "paged_attention") == "pallas":
        if k_cache.dtype == jnp.uint16:  # CPU storage of a 16-bit cache (jdet/kv_cache.py)
            k_cache, v_cache = as_float(k_cache, q.dtype), as_float(v_cache, q.dtype)
        if kernel == "mosaic":
            return paged_attention_mosaic(
                q, k_cache, v_cache, page_table, context_lens, query_start, positions,
                scale=float(scale), partition_size=partition_size, layer=layer,
                block_kv=block_kv or MOSAIC_BLOCK_KV, structure=structure,
                consumers=MOSAIC_CONSUMERS, meta=meta, q_heads=q_heads, out_rows=out_rows,
            )  # fmt: skip
        return _paged_attention_pallas(
            q, k_cache, v_cache, page_table, context_lens, query_start, positions,
            scale=scale, partition_size=partition_size, layer=layer, block_kv=block_kv,
            structure=structure, block_rows=block_rows, num_warps=num_warps,
            num_stages=num_stages, meta=meta, out_rows=out_rows, q_heads=q_heads,
            direct_out=direct_out, config=config,
        )  # fmt: skip
    if q_heads is not None:
        raise ValueError("paged_attention: q_heads (query tiles) needs the Pallas backend")
    one = k_cache
    if layer is not None:
        if k_cache.ndim != 5:
            raise ValueError(f"with `layer`, k/v caches are [L, K, P, B, E]; got {k_cache.shape}")
        one = jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype)
    _check(q, one, one if layer is not None else v_cache, page_table, context_lens, query_start,
           positions, partition_size)  # fmt: skip
    page_size = one.shape[2]
    bk = block_kv or default_block_kv(partition_size, page_size)
    if partition_size % bk or bk % page_size:
        raise ValueError(
            f"block_kv ({bk}) must divide partition_size ({partition_size}) and be a multiple of "
            f"the page size ({page_size})"
        )
    out = xla_attention.paged_attention(
        q, k_cache, v_cache, page_table, context_lens, query_start, positions,
        scale=float(scale), block_kv=bk, layer=layer,
    )  # fmt: skip
    return _pad_rows(out, out_rows)


def none_partition(t: int, page_table_shape: tuple, cache_shape: tuple, target: int = 256) -> int:
    """KV partition of the "none" mode's paged attention: the split a fast non-invariant engine
    would pick from the step's (static) shapes — about `target` programs (query tiles x kv heads
    x partitions), partitions of 64..512 tokens. Batch-1 decode at 1k context gets 64-token
    partitions (16x the programs of the invariant plan's fixed 512); large batches get 512."""
    s, pmax = page_table_shape
    kv_heads, page = cache_shape[-4], cache_shape[-2]
    tiles = max(s, t // 16)
    want = tiles * kv_heads * pmax * page // target
    ps = max(64, page)
    while ps < min(want, 512):
        ps *= 2
    return ps


def step_attention_meta(page_table, context_lens, query_start, positions, *, t: int,
                        q_heads: int, cache_shape: tuple, partition_size: int,
                        kernel: str = "triton") -> dict:  # fmt: skip
    """`attention_meta` cut for the tiles the family `kernel` runs: ROWS rows for the Triton
    kernels, 64 per consumer warpgroup of the Mosaic launch (its `launch_plan`, from static
    shapes). `cache_shape`: the stacked cache's [L, K, P, page, E]."""
    _, kh, num_pages, page, e = cache_shape
    rows = ROWS
    if kernel == "mosaic":
        rows *= launch_plan(t, page_table.shape, kh, q_heads // kh, e, page, partition_size)[1]
    return attention_meta(page_table, context_lens, query_start, positions, t=t,
                          g=q_heads // kh, num_pages=num_pages, page_size=page,
                          partition_size=partition_size, block_rows=rows)  # fmt: skip


def _pad_rows(x: jax.Array, rows: int | None) -> jax.Array:
    if rows is None or rows == x.shape[0]:
        return x
    if rows < x.shape[0]:
        raise ValueError(f"out_rows ({rows}) < the number of query tokens ({x.shape[0]})")
    return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def _gather_contiguous(k_cache, v_cache, page_table):
    """K/V of each sequence laid out contiguously: [S, K, Pmax*B, E] each."""
    kh, _, b, e = k_cache.shape
    s, pmax = page_table.shape
    k = k_cache[:, page_table].reshape(kh, s, pmax * b, e).transpose(1, 0, 2, 3)
    v = v_cache[:, page_table].reshape(kh, s, pmax * b, e).transpose(1, 0, 2, 3)
    return k, v


def _token_seq(query_start, t: int):
    qs = query_start.astype(jnp.int32)
    s = qs.shape[0] - 1
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = (jnp.searchsorted(qs, tok, side="right", method="compare_all") - 1).astype(jnp.int32)
    seq_c = jnp.clip(seq, 0, s - 1)
    ok = (seq >= 0) & (seq < s) & (tok >= qs[seq_c]) & (tok < qs[seq_c + 1])
    return seq_c, ok


def _dense_attention(q, k_cache, v_cache, page_table, context_lens, query_start, positions,
                     scale, compute_dtype):  # fmt: skip
    t, h, e = q.shape
    kh = k_cache.shape[0]
    g = h // kh
    seq, ok = _token_seq(query_start, t)
    k, v = _gather_contiguous(k_cache, v_cache, page_table)
    k, v = k[seq].astype(compute_dtype), v[seq].astype(compute_dtype)  # [T, K, L, E]
    qg = q.reshape(t, kh, g, e).astype(compute_dtype)
    prec = lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None
    sc = jnp.einsum("TKGE,TKLE->TKGL", qg, k, precision=prec,
                    preferred_element_type=jnp.float32) * scale  # fmt: skip
    kpos = jnp.arange(k.shape[2], dtype=jnp.int32)
    lim = jnp.minimum(positions.astype(jnp.int32) + 1, context_lens.astype(jnp.int32)[seq])
    mask = (kpos[None, :] < lim[:, None]) & ok[:, None]
    sc = jnp.where(mask[:, None, None, :], sc, -jnp.inf)
    mx = jnp.max(sc, axis=-1, keepdims=True)
    p = jnp.exp(sc - jnp.where(jnp.isfinite(mx), mx, 0.0))
    den = jnp.sum(p, axis=-1, keepdims=True)
    p = p / jnp.where(den > 0, den, 1.0)
    out = jnp.einsum("TKGL,TKLE->TKGE", p.astype(compute_dtype), v, precision=prec,
                     preferred_element_type=jnp.float32)  # fmt: skip
    out = jnp.where(ok[:, None, None, None], out, 0.0)
    return out.reshape(t, h, e).astype(q.dtype)


def paged_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    context_lens: jax.Array,
    query_start: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    partition_size: int = 512,
) -> jax.Array:
    """Pure-jnp f32 attention over each sequence's contiguous (gathered) KV; the accuracy oracle.

    `partition_size` is accepted for signature parity and ignored: one softmax over all of it.
    """
    del partition_size
    return _dense_attention(q, k_cache, v_cache, page_table, context_lens, query_start,
                            positions, scale, jnp.float32)  # fmt: skip


def paged_attention_xla(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    context_lens: jax.Array,
    query_start: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    partition_size: int = 512,
    layer: jax.Array | None = None,
    block: int = 32,
    remat: bool = False,
) -> jax.Array:
    """Plain XLA attention (one softmax over the whole context, bf16/f32 inputs with f32
    accumulation): the `invariance="none"` baseline and the negative control of the invariance
    tests. Not batch/chunk invariant: XLA chooses its own reduction order.

    XLA has no paged attention, so each token gathers its sequence's pages; tokens go in blocks of
    `block` rows (lax.map) to bound the gathered K/V's memory. With `layer`, the caches are the
    stacked [L, K, P, B, E] cache, gathered from in place.

    `remat` (for a gradient: jdet.train): each block's gathered K/V, scores and probabilities are
    recomputed in the backward pass instead of kept. Kept, they are [tokens, heads, context] per
    layer, quadratic in the sequence: 8 sequences of 943 tokens at Qwen3-30B-A3B's heads over 24
    layers kept 2 x 177 GiB of gathered K/V. Without a gradient it changes nothing.
    """
    del partition_size
    if layer is None:  # gathered from in place with `layer` (a slice would copy the layer)
        k_cache, v_cache, layer = k_cache[None], v_cache[None], jnp.int32(0)
    kv_dtype = kv_compute_dtype(k_cache.dtype, q.dtype)  # uint16: the CPU storage, as q
    t, h, e = q.shape
    _, kh, num_pages, b, _ = k_cache.shape
    g = h // kh
    s, pmax = page_table.shape
    c = pmax * b
    seq, ok = _token_seq(query_start, t)
    lim = jnp.minimum(positions.astype(jnp.int32) + 1, context_lens.astype(jnp.int32)[seq])
    lim = jnp.where(ok, lim, 0)
    tp = -(-t // block) * block

    def rows(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, tp - t)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(tp // block, block, *a.shape[1:])

    prec = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def one(args):
        qq, ss, ll = args  # [bl, K, G, E], [bl], [bl]
        pages = jnp.clip(page_table[ss], 0, num_pages - 1)  # [bl, Pmax]
        # c[layer, :, pages] is [bl, Pmax, K, B, E]: kv heads first again
        k = as_float(jnp.moveaxis(k_cache[layer, :, pages], 2, 0), kv_dtype)
        v = as_float(jnp.moveaxis(v_cache[layer, :, pages], 2, 0), kv_dtype)
        k, v = k.reshape(kh, block, c, e), v.reshape(kh, block, c, e)
        sc = jnp.einsum("bkge,kbce->bkgc", qq, k, precision=prec,
                        preferred_element_type=jnp.float32) * scale  # fmt: skip
        mask = jnp.arange(c)[None, :] < ll[:, None]
        sc = jnp.where(mask[:, None, None, :], sc, -jnp.inf)
        mx = jnp.max(sc, axis=-1, keepdims=True)
        p = jnp.exp(sc - jnp.where(jnp.isfinite(mx), mx, 0.0))
        den = jnp.sum(p, axis=-1, keepdims=True)
        p = p / jnp.where(den > 0, den, 1.0)
        return jnp.einsum("bkgc,kbce->bkge", p.astype(v.dtype), v, precision=prec,
                          preferred_element_type=jnp.float32)  # fmt: skip

    if remat:  # prevent_cse=False: inside lax.map's loop CSE cannot hoist the recomputation
        one = jax.checkpoint(one, prevent_cse=False)
    out = lax.map(one, (rows(q.reshape(t, kh, g, e)), rows(seq), rows(lim)))
    out = out.reshape(tp, h, e)[:t]
    return jnp.where(ok[:, None, None], out, 0.0).astype(q.dtype)
