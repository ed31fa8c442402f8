"""Paged attention for a flat ragged batch of prefill chunks and decodes, bitwise invariant.

One kernel serves one-shot prefill, chunked prefill and decode. A query token at position p of
sequence s attends to KV positions 0..p of s, read from the paged cache (which already holds this
step's K/V). Its output bits depend only on (its query vector, p, s's KV values): not on the other
rows of the batch, the chunk it came in, the number of tokens, or which physical pages hold the KV.

Reduction plan (DESIGN §4; the split-KV scheme of seed 003):
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

Nothing depends on T, S or the batch composition except how many programs run.

Requirement: every cache slot holds finite values (`init_kv_cache` zero-fills). A masked column
contributes p = 0, and 0 * v is 0 only for finite v; slots past a context inside its last page
(and page 0, which padded page-table entries point at) are loaded and masked, never trusted.

Backends: `pl.pallas_call` — compiled with the Triton lowering on a GPU. On a CPU
`xla_fixed.paged_attention` runs instead (the same KV blocks aligned to position 0, in plain XLA;
its plan is in that module), or this kernel in interpret mode with JDET_PALLAS_INTERPRET=1.
Invariance holds within a backend; bits differ across backends.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform
from pallas_kernels._platform import as_float, kv_compute_dtype

# Rows (query tokens x query heads of one KV group) per program: the MMA's M. Fixed for every call,
# so a row's arithmetic never depends on how many tokens the step holds.
ROWS = 64
_LOG2E = math.log2(math.e)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _precision(dtype) -> lax.Precision:
    # f32 must not silently drop to tf32: ask for the full-precision product.
    return lax.Precision.DEFAULT if jnp.dtype(dtype).itemsize == 2 else lax.Precision.HIGHEST


def default_block_kv(partition_size: int, page_size: int) -> int:
    """KV tokens per inner step: 64 when it tiles the partition into whole pages, else smaller.

    A function of (partition_size, page_size) only, as the reduction plan requires.
    """
    for bk in (64, 32, 16):
        if bk <= partition_size and partition_size % bk == 0 and bk % page_size == 0:
            return bk
    return page_size


def _check(q, k_cache, v_cache, page_table, context_lens, query_start, positions, ps):
    if q.ndim != 3 or k_cache.ndim != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"paged_attention expects q[T, H, E] and k/v caches [K, P, B, E] of one shape; got "
            f"q{tuple(q.shape)}, k{tuple(k_cache.shape)}, v{tuple(v_cache.shape)}"
        )
    t, h, e = q.shape
    kh, _, b, e2 = k_cache.shape
    if e != e2 or h % kh:
        raise ValueError(
            f"head dims must match and H ({h}) must be a multiple of the KV heads ({kh}); got "
            f"q{tuple(q.shape)}, k_cache{tuple(k_cache.shape)}"
        )
    s = page_table.shape[0]
    if context_lens.shape != (s,) or query_start.shape != (s + 1,) or positions.shape != (t,):
        raise ValueError(
            "expected page_table[S, Pmax], context_lens[S], query_start[S+1], positions[T]; got "
            f"{page_table.shape}, {context_lens.shape}, {query_start.shape}, {positions.shape}"
        )
    if ps % b:
        raise ValueError(f"partition_size ({ps}) must be a multiple of the page size ({b})")


def _tile_plan(query_start, t: int, s: int, block_q: int):
    """Which (sequence, first token, token count) each query tile covers, and the inverse map.

    Tiles never straddle sequences: sequence s gets cdiv(len_s, block_q) tiles starting at its own
    first token. The static tile count cdiv(T, block_q) + S bounds any batch; spare tiles are empty.
    """
    qs = query_start.astype(jnp.int32)
    qlen = jnp.maximum(qs[1:] - qs[:-1], 0)
    ntile = (qlen + block_q - 1) // block_q
    cum = jnp.cumsum(ntile)
    first = cum - ntile
    nt = -(-t // block_q) + s
    tid = jnp.arange(nt, dtype=jnp.int32)
    seq = jnp.searchsorted(cum, tid, side="right", method="compare_all").astype(jnp.int32)
    tile_ok = seq < s
    seq_c = jnp.minimum(seq, s - 1)
    tstart = qs[seq_c] + (tid - first[seq_c]) * block_q
    tcount = jnp.where(tile_ok, jnp.clip(qs[seq_c + 1] - tstart, 0, block_q), 0)
    # Inverse: token -> (tile, row in tile); padding tokens (in no sequence) are flagged.
    tok = jnp.arange(t, dtype=jnp.int32)
    tseq = (jnp.searchsorted(qs, tok, side="right", method="compare_all") - 1).astype(jnp.int32)
    tseq_c = jnp.clip(tseq, 0, s - 1)
    tok_ok = (tseq >= 0) & (tseq < s) & (tok < qs[tseq_c + 1]) & (tok >= qs[tseq_c])
    local = tok - qs[tseq_c]
    tok_tile = jnp.where(tok_ok, first[tseq_c] + local // block_q, 0)
    tok_row = jnp.where(tok_ok, local % block_q, 0)
    return nt, seq_c, tstart, tcount, tok_ok, tok_tile, tok_row


def _dot(a, b, b_contract: int, precision):
    """a[M, E] . b (contracting b's axis `b_contract`), f32 accumulate: the fixed MMA."""
    dims = (((1,), (b_contract,)), ((), ()))
    return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=jnp.float32)


def _masked_load(ref, mask, other):
    from jax.experimental.pallas import triton as pltriton

    return pltriton.load(ref, mask=mask, other=other)


def _masked_store(ref, val, mask):
    from jax.experimental.pallas import triton as pltriton

    pltriton.store(ref, val, mask=mask)


def _load_rows(ref, row_ok, fill=0.0):
    """ref[rows, ...] with padding rows read as `fill` and not fetched from memory."""
    shape = ref.shape
    mask = jnp.broadcast_to(row_ok.reshape(row_ok.shape + (1,) * (len(shape) - 1)), shape)
    return _masked_load(ref, mask, jnp.full(shape, fill, ref.dtype))


def _store_rows(ref, val, row_ok):
    """ref[rows, ...] = val on real rows only: padding rows cost no memory traffic."""
    shape = ref.shape
    mask = jnp.broadcast_to(row_ok.reshape(row_ok.shape + (1,) * (len(shape) - 1)), shape)
    _masked_store(ref, val, mask)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static reduction plan of one call (every field a function of model shapes only)."""

    partition_size: int
    block_kv: int
    page_size: int
    qk_scale: float
    precision: lax.Precision


def _num_parts(lim, plan: _Plan):
    """Partitions holding any kv position < max(lim) (the rest are sentinels)."""
    tile_lim = jnp.max(lim)
    return jnp.maximum((tile_lim + plan.partition_size - 1) // plan.partition_size, 0)


def _partition(j, q, lim, pt_ref, k_ref, v_ref, plan: _Plan):
    """Online softmax of partition j for every row: (m, l, acc) from the (-inf, 0, 0) sentinel.

    KV blocks of plan.block_kv tokens in increasing order; the tile stops after the last block any
    of its rows needs, which is an exact identity for the rows that need fewer (module docstring).
    """
    rows, e = q.shape
    bk, ps = plan.block_kv, plan.partition_size
    ppb = bk // plan.page_size
    ppp = ps // plan.page_size
    part_start = j * ps
    n_blk = jnp.clip((jnp.max(lim) - part_start + bk - 1) // bk, 0, ps // bk)

    def body(b, carry):
        m, lsum, acc = carry
        pages = pt_ref[pl.ds(j * ppp + b * ppb, ppb)]
        k = k_ref[pages].reshape(bk, e)
        v = v_ref[pages].reshape(bk, e)
        s = _dot(q, k, 1, plan.precision) * plan.qk_scale
        kpos = part_start + b * bk + lax.broadcasted_iota(jnp.int32, (rows, bk), 1)
        s = jnp.where(kpos < lim[:, None], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        p = jnp.exp2(s - m_safe[:, None])
        alpha = jnp.exp2(m - m_safe)
        lsum = lsum * alpha + jnp.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, 0, plan.precision)
        return m_new, lsum, acc

    return lax.fori_loop(0, n_blk, body, _sentinel(rows, e))


def _sentinel(rows: int, e: int):
    return (
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
        jnp.zeros((rows, e), jnp.float32),
    )


def _merge(state, part):
    """The one merge rule: fold partition `part` into the running `state` (empty parts vanish)."""
    mm, ll, aa = state
    mj, lj, aj = part
    m_new = jnp.maximum(mm, mj)
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    a = jnp.exp2(mm - m_safe)
    b = jnp.exp2(mj - m_safe)
    return m_new, ll * a + lj * b, aa * a[:, None] + aj * b[:, None]


def _finish(state, dtype):
    _, ll, aa = state
    safe = jnp.where(ll > 0, ll, 1.0)
    return jnp.where((ll > 0)[:, None], aa / safe[:, None], 0.0).astype(dtype)


def _split_kernel(pt_ref, lim_ref, q_ref, k_ref, v_ref, acc_ref, m_ref, l_ref, *, plan: _Plan):
    """Grid (tile, kv head, partition): partition j's unnormalised (m, l, acc) per row."""
    j = pl.program_id(2)
    lim = lim_ref[...]  # [R] int32: row attends to kv positions < lim; -1 marks a padding row
    row_ok = lim >= 0

    @pl.when(j < _num_parts(lim, plan))  # the merge never reads partitions past the tile's end
    def _():
        q = _load_rows(q_ref, row_ok)
        m, lsum, acc = _partition(j, q, lim, pt_ref, k_ref, v_ref, plan)
        _store_rows(acc_ref, acc, row_ok)
        _store_rows(m_ref, m, row_ok)
        _store_rows(l_ref, lsum, row_ok)


# Partitions whose loads the merge kernel keeps in flight ahead of the one it folds.
MERGE_PREFETCH = 4


def _merge_kernel(lim_ref, acc_ref, m_ref, l_ref, o_ref, *, plan: _Plan):
    """Grid (tile, kv head, token of the tile): fold the token's partitions in increasing order.

    The merge is elementwise across rows, so blocking it by token (not by the split kernel's
    MMA tile) changes no bits. Each loop step folds exactly one partition, as `_looped_kernel`
    does (XLA CPU was seen to round an unrolled chain of merges differently from a loop of
    single merges, so the loop shape is part of the plan); the loads of the next
    MERGE_PREFETCH partitions ride in the carry to hide memory latency.
    """
    lim = lim_ref[...]  # [G_pad]
    row_ok = lim >= 0
    gp, e = o_ref.shape
    n_parts = _num_parts(lim, plan)

    def load(j):
        ok = row_ok & (j < n_parts)
        return (
            _load_rows(m_ref.at[j], ok, -jnp.inf),
            _load_rows(l_ref.at[j], ok),
            _load_rows(acc_ref.at[j], ok),
        )

    def body(j, carry):
        state, parts = carry
        state = _merge(state, parts[0])
        return state, parts[1:] + (load(j + MERGE_PREFETCH),)

    init = (_sentinel(gp, e), tuple(load(jnp.int32(d)) for d in range(MERGE_PREFETCH)))
    state, _ = lax.fori_loop(0, n_parts, body, init)
    _store_rows(o_ref, _finish(state, o_ref.dtype), row_ok)


def _looped_kernel(pt_ref, lim_ref, q_ref, k_ref, v_ref, o_ref, *, plan: _Plan):
    """Grid (tile, kv head): partitions computed and merged in registers, in increasing order.

    Same `_partition`, `_merge` and `_finish` as split + merge, so the same arithmetic; it saves
    the partials' round trip through memory when the query axis alone fills the GPU (prefill).
    """
    lim = lim_ref[...]
    row_ok = lim >= 0
    rows, e = q_ref.shape
    q = _load_rows(q_ref, row_ok)

    def body(j, state):
        return _merge(state, _partition(j, q, lim, pt_ref, k_ref, v_ref, plan))

    state = lax.fori_loop(0, _num_parts(lim, plan), body, _sentinel(rows, e))
    _store_rows(o_ref, _finish(state, o_ref.dtype), row_ok)


STRUCTURES = ("auto", "split", "looped")
# "auto" runs the split-KV pair when fewer (query tile x kv head) programs than this exist.
SPLIT_BELOW_PROGRAMS = 4096


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
    num_stages: int = 2,
    backend: str | None = None,
) -> jax.Array:
    """Causal attention of q[T, H, E] over the paged cache, bitwise invariant (module docstring).

    `backend`: 'auto' (this kernel; on a CPU `xla_fixed.paged_attention`, the same KV blocks
    aligned to position 0, unless JDET_PALLAS_INTERPRET=1), 'pallas' or 'xla'. The other
    arguments are `_paged_attention_pallas`'s; `structure`, `block_rows` and the launch
    parameters only concern the Pallas kernel.
    """
    if _platform.resolve(backend, "paged_attention") == "pallas":
        if k_cache.dtype == jnp.uint16:  # CPU storage of a 16-bit cache (jdet/kv_cache.py)
            k_cache, v_cache = as_float(k_cache, q.dtype), as_float(v_cache, q.dtype)
        return _paged_attention_pallas(
            q, k_cache, v_cache, page_table, context_lens, query_start, positions,
            scale=scale, partition_size=partition_size, layer=layer, block_kv=block_kv,
            structure=structure, block_rows=block_rows, num_warps=num_warps,
            num_stages=num_stages,
        )  # fmt: skip
    from pallas_kernels import xla_fixed

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
    return xla_fixed.paged_attention(
        q, k_cache, v_cache, page_table, context_lens, query_start, positions,
        scale=float(scale), block_kv=bk, layer=layer,
    )  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "partition_size", "block_kv", "structure", "block_rows", "num_warps",
        "num_stages",
    ),
)  # fmt: skip
def _paged_attention_pallas(
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
    num_stages: int = 2,
) -> jax.Array:
    """Causal attention of q[T, H, E] over the paged cache, bitwise invariant (module docstring).

    k_cache/v_cache [K, P, B, E] already hold this step's K/V. With `layer` (an int32 scalar),
    they are the whole stacked cache [L, K, P, B, E] and the kernel reads layer `layer` in place:
    slicing the layer out first would copy the layer's whole page pool on every step.
    Rows of padding tokens (in no sequence) come back as zeros.
    `structure` picks the program layout — 'split': split-KV grid plus merge kernel, for
    decode-heavy steps; 'looped': partitions merged in registers, for prefill; 'auto' chooses
    from T and S — and both give the same bits. `block_kv`, `block_rows` and the Triton launch
    parameters exist for tests and benchmarks; the defaults are the plan, and every call that
    must agree bitwise has to use the same values.
    """
    stacked = layer is not None
    if stacked:
        if k_cache.ndim != 5:
            raise ValueError(f"with `layer`, k/v caches are [L, K, P, B, E]; got {k_cache.shape}")
        n_layers = k_cache.shape[0]
        if k_cache.size >= 2**31:
            raise ValueError(
                f"the stacked cache {k_cache.shape} has {k_cache.size} elements; its flat page "
                "pool is addressed with 32-bit offsets, so use fewer pages (< 2**31 elements)"
            )
        one = jax.ShapeDtypeStruct(k_cache.shape[1:], k_cache.dtype)
        _check(q, one, one, page_table, context_lens, query_start, positions, partition_size)
        k_cache = k_cache.reshape((-1, *k_cache.shape[2:]))
        v_cache = v_cache.reshape((-1, *v_cache.shape[2:]))
    else:
        _check(q, k_cache, v_cache, page_table, context_lens, query_start, positions,
               partition_size)  # fmt: skip
    if structure not in STRUCTURES:
        raise ValueError(f"structure must be one of {STRUCTURES}, got {structure!r}")
    t, h, e = q.shape
    kh, num_pages, page_size, _ = k_cache.shape
    if stacked:
        kh //= n_layers
    s, pmax = page_table.shape
    g = h // kh
    gp = _next_pow2(g)
    block_q = max(1, block_rows // gp)
    rows = block_q * gp
    bk = block_kv or default_block_kv(partition_size, page_size)
    if partition_size % bk or bk % page_size:
        raise ValueError(
            f"block_kv ({bk}) must divide partition_size ({partition_size}) and be a multiple of "
            f"the page size ({page_size})"
        )
    ppp = partition_size // page_size  # pages per partition
    num_parts = max(1, -(-(pmax * page_size) // partition_size))
    plan = _Plan(partition_size, bk, page_size, float(scale) * _LOG2E, _precision(q.dtype))

    nt, tseq, tstart, tcount, tok_ok, tok_tile, tok_row = _tile_plan(query_start, t, s, block_q)

    # Per-tile query rows [NT, K, rows, E]: row r*gp + g is token tstart+r, head k*G+g.
    r = jnp.arange(block_q, dtype=jnp.int32)
    tok = tstart[:, None] + r[None, :]  # [NT, bq]
    tok_valid = r[None, :] < tcount[:, None]
    tok_c = jnp.clip(tok, 0, t - 1)
    qg = q.reshape(t, kh, g, e)
    if gp != g:
        qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    q_tiles = qg[tok_c].transpose(0, 2, 1, 3, 4).reshape(nt, kh, rows, e)
    ctx = context_lens.astype(jnp.int32)[tseq]  # [NT]
    lim_tok = jnp.minimum(positions.astype(jnp.int32)[tok_c] + 1, ctx[:, None])
    lim_tok = jnp.where(tok_valid, jnp.maximum(lim_tok, 0), -1)  # [NT, bq]
    head_ok = jnp.arange(gp) < g
    lim = jnp.where(head_ok[None, None, :], lim_tok[:, :, None], -1).reshape(nt, rows)

    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    pt = jnp.pad(pt, ((0, 0), (0, num_parts * ppp - pmax)))[tseq]  # [NT, J*ppp]

    interpret = _platform.interpret_default()
    compiler_params = merge_params = None
    if not interpret:
        from jax.experimental.pallas import triton as pltriton

        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
        # The merge holds (1 + MERGE_PREFETCH) x [G_pad, E] f32 per program: ~16 values per
        # thread per partial keeps it in registers.
        merge_warps = max(1, min(8, gp * e // 512))
        merge_params = pltriton.CompilerParams(num_warps=merge_warps, num_stages=1)
    if structure == "auto":
        structure = "split" if nt * kh < SPLIT_BELOW_PROGRAMS else "looped"
    cache_spec = pl.BlockSpec((None, num_pages, page_size, e), lambda i, k, *_: (k, 0, 0, 0))
    if stacked:
        # The kernel gets the whole cache as one page pool [L*K*P, B, E] and offsets its page
        # indices by (layer*K + k) * P itself (one indexer: what the Triton lowering supports).
        k_cache = k_cache.reshape((-1, page_size, e))
        v_cache = v_cache.reshape((-1, page_size, e))
        cache_spec = pl.BlockSpec(k_cache.shape, lambda i, k, *_: (0, 0, 0))
    pt_spec = pl.BlockSpec((None, num_parts * ppp), lambda i, k, *_: (i, 0))
    lim_spec = pl.BlockSpec((None, rows), lambda i, k, *_: (i, 0))
    q_spec = pl.BlockSpec((None, None, rows, e), lambda i, k, *_: (i, k, 0, 0))
    o_shape = jax.ShapeDtypeStruct((nt, kh, rows, e), q.dtype)
    tag = f"r{rows}_bk{bk}_ps{partition_size}"
    hb, hb_specs = [], []
    if stacked:
        hb = [(jnp.asarray(layer, jnp.int32) * kh * num_pages).reshape(1)]
        hb_specs = [pl.BlockSpec((1,), lambda *_: (0,))]
    if structure == "looped":
        out = pl.pallas_call(
            _layered(functools.partial(_looped_kernel, plan=plan), stacked, num_pages),
            grid=(nt, kh),
            in_specs=[*hb_specs, pt_spec, lim_spec, q_spec, cache_spec, cache_spec],
            out_specs=q_spec,
            out_shape=o_shape,
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"paged_attention_looped_{tag}",
        )(*hb, pt, lim, q_tiles, k_cache, v_cache)
    else:
        acc, m, lsum = pl.pallas_call(
            _layered(functools.partial(_split_kernel, plan=plan), stacked, num_pages),
            grid=(nt, kh, num_parts),
            in_specs=[*hb_specs, pt_spec, lim_spec, q_spec, cache_spec, cache_spec],
            out_specs=[
                pl.BlockSpec((None, None, None, rows, e), lambda i, k, j: (i, k, j, 0, 0)),
                pl.BlockSpec((None, None, None, rows), lambda i, k, j: (i, k, j, 0)),
                pl.BlockSpec((None, None, None, rows), lambda i, k, j: (i, k, j, 0)),
            ],
            out_shape=[
                jax.ShapeDtypeStruct((nt, kh, num_parts, rows, e), jnp.float32),
                jax.ShapeDtypeStruct((nt, kh, num_parts, rows), jnp.float32),
                jax.ShapeDtypeStruct((nt, kh, num_parts, rows), jnp.float32),
            ],
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"paged_attention_split_{tag}",
        )(*hb, pt, lim, q_tiles, k_cache, v_cache)
        out = pl.pallas_call(
            functools.partial(_merge_kernel, plan=plan),
            grid=(nt, kh, block_q),
            in_specs=[
                pl.BlockSpec((None, gp), lambda i, k, r: (i, r)),
                pl.BlockSpec((None, None, num_parts, gp, e), lambda i, k, r: (i, k, 0, r, 0)),
                pl.BlockSpec((None, None, num_parts, gp), lambda i, k, r: (i, k, 0, r)),
                pl.BlockSpec((None, None, num_parts, gp), lambda i, k, r: (i, k, 0, r)),
            ],
            out_specs=pl.BlockSpec((None, None, gp, e), lambda i, k, r: (i, k, r, 0)),
            out_shape=o_shape,
            interpret=interpret,
            compiler_params=merge_params,
            name=f"paged_attention_merge_{tag}",
        )(lim, acc, m, lsum)

    # Each token's row of its own tile; padding tokens read zeros.
    out = out.reshape(nt, kh, block_q, gp, e)[tok_tile, :, tok_row][:, :, :g]  # [T, K, G, E]
    out = jnp.where(tok_ok[:, None, None, None], out, jnp.zeros((), q.dtype))
    return out.reshape(t, h, e)


class _PagePool:
    """A [pages, B, E] ref seen through a page offset: `pool[pages]` reads `ref[pages + off]`."""

    def __init__(self, ref, off):
        self.ref, self.off = ref, off

    def __getitem__(self, pages):
        return self.ref[pages + self.off]


def _layered(kernel, stacked: bool, num_pages: int):
    """With a stacked cache, prepend the layer's page base and hand the kernel its head's pool
    (layer*K + k) * P ... + P - 1 of the flattened [L*K*P, B, E] cache."""
    if not stacked:
        return kernel

    def wrapped(hb_ref, pt_ref, lim_ref, q_ref, k_ref, v_ref, *outs):
        off = hb_ref[0] + pl.program_id(1) * num_pages
        return kernel(pt_ref, lim_ref, q_ref, _PagePool(k_ref, off), _PagePool(v_ref, off), *outs)

    return wrapped


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
) -> jax.Array:
    """Plain XLA attention (one softmax over the whole context, bf16/f32 inputs with f32
    accumulation): the `invariance="none"` baseline and the negative control of the invariance
    tests. Not batch/chunk invariant: XLA chooses its own reduction order.

    XLA has no paged attention, so each token gathers its sequence's pages; tokens go in blocks of
    `block` rows (lax.map) to bound the gathered K/V's memory. With `layer`, the caches are the
    stacked [L, K, P, B, E] cache, gathered from in place.
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

    out = lax.map(one, (rows(q.reshape(t, kh, g, e)), rows(seq), rows(lim)))
    out = out.reshape(tp, h, e)[:t]
    return jnp.where(ok[:, None, None], out, 0.0).astype(q.dtype)
