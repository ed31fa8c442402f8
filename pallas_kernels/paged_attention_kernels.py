"""The Pallas kernel bodies of the invariant paged attention (pallas_kernels/paged_attention.py
holds the reduction plan in its docstring, the public entry point and the references): the query
tile plan, one KV partition's online softmax, the split-KV pair (partials, then a fixed-order
merge) and the looped kernel. `paged_attention_pallas.py` launches them.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

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
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    return pltriton.load(ref, mask=mask, other=other)


def _masked_store(ref, val, mask):
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

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
class AttentionConfig:
    """How the Pallas paged attention loads its operands and launches (`paged_attention`'s
    `config`, jdet's `Ops.attn_config`). No field changes a value that is summed or the order of
    any sum, so every setting gives the bits of every other (CPU: interpret-mode tests; GPU:
    tests/pallas_kernels/test_attention_knobs_gpu.py checks what Triton makes of them);
    benchmarks build other settings to measure them. The defaults are the fastest measured
    (BENCHMARKS.md): the three load paths together with 3 split-kernel stages; none of the
    load paths gained alone.
    """

    # A KV block is one [block_kv, E] gather (token -> page, slot) that feeds the dot as it is,
    # instead of a [pages, page_size, E] load and a reshape (which may keep Triton's pipeliner
    # from staging it in shared memory).
    kv_gather_2d: bool = True
    # The partition's page indices are loaded once before the block loop, and each block picks
    # its own from registers, so no block waits on a page-table load before its K/V loads.
    pages_ahead: bool = True
    # The block loop runs all partition_size / block_kv blocks (a static trip count, which
    # Triton can software-pipeline); blocks past the tile's last needed position are exact
    # identities (module docstring of paged_attention.py) and, with kv_gather_2d, masked loads
    # that move no memory.
    static_blocks: bool = True
    # Partitions whose loads the merge kernel keeps in flight ahead of the one it folds.
    merge_prefetch: int = 4
    # The split kernel's Triton pipeline depth where a call passes no `num_stages`.
    split_stages: int = 3
    # structure="auto" runs the split-KV pair when fewer (query tile x kv head) programs exist.
    split_below_programs: int = 4096


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Static reduction plan of one call (every field a function of model shapes only), and the
    call's `AttentionConfig` (how it loads: never a value or an order)."""

    partition_size: int
    block_kv: int
    page_size: int
    qk_scale: float
    precision: lax.Precision
    config: AttentionConfig = AttentionConfig()


DEFAULT_CONFIG = AttentionConfig()  # frozen: the defaults every call gets unless it passes one


def _num_parts(lim, plan: _Plan):
    """Partitions holding any kv position < max(lim) (the rest are sentinels)."""
    tile_lim = jnp.max(lim)
    return jnp.maximum((tile_lim + plan.partition_size - 1) // plan.partition_size, 0)


def _block_page_index(plan: _Plan, per_token: bool):
    """[n, block_kv] token -> page-of-partition index (per_token) or [n, pages_per_block]."""
    nb = plan.partition_size // plan.block_kv
    width = plan.block_kv if per_token else plan.block_kv // plan.page_size
    b = lax.broadcasted_iota(jnp.int32, (nb, width), 0)
    c = lax.broadcasted_iota(jnp.int32, (nb, width), 1)
    if per_token:
        return (b * plan.block_kv + c) // plan.page_size
    return b * width + c


def _kv_block(ref, pages, blk_ok, e: int, plan: _Plan):
    """One KV block [block_kv, E]: `pages` are its pages [ppb] or (kv_gather_2d) each token's
    page [block_kv]; with blk_ok False (a static-loop block past the tile's end) a 2-D load is
    masked to zeros, the same values a masked block contributes (p = 0)."""
    bk = plan.block_kv
    if not plan.config.kv_gather_2d:
        return ref[pages].reshape(bk, e)
    cols = lax.broadcasted_iota(jnp.int32, (1, e), 1)
    idx = (pages[:, None], _token_slots(bk, plan.page_size), cols)
    if blk_ok is None:
        return ref[idx]
    target = ref.at[idx] if not hasattr(ref, "at_rows") else ref.at_rows(idx)
    return _masked_load(target, jnp.broadcast_to(blk_ok, (bk, e)),
                        jnp.full((bk, e), _PAST_END_FILL, ref.dtype))  # fmt: skip


# What a static loop's block past the tile's end reads instead of memory (the tests' control
# sets NaN to show those blocks run and would change the bits if they were not identities).
_PAST_END_FILL = 0.0


def _token_slots(bk: int, page_size: int):
    """[bk, 1] each token's slot in its page (`AttentionConfig.kv_gather_2d`)."""
    return lax.broadcasted_iota(jnp.int32, (bk, 1), 0) % page_size


def _partition(j, q, lim, pt_ref, k_ref, v_ref, plan: _Plan):
    """Online softmax of partition j for every row: (m, l, acc) from the (-inf, 0, 0) sentinel.

    KV blocks of plan.block_kv tokens in increasing order; the tile stops after the last block any
    of its rows needs, which is an exact identity for the rows that need fewer (module docstring).
    `plan.config` (`AttentionConfig`) changes how blocks are fetched and the loop's trip count,
    never a value: the blocks past the tile's end a static loop runs are those exact identities.
    """
    rows, e = q.shape
    bk, ps = plan.block_kv, plan.partition_size
    ppb = bk // plan.page_size
    ppp = ps // plan.page_size
    part_start = j * ps
    n_blk = jnp.clip((jnp.max(lim) - part_start + bk - 1) // bk, 0, ps // bk)
    cfg = plan.config
    per_token = bool(cfg.kv_gather_2d)
    ahead = None
    if cfg.pages_ahead:  # [nb, width] of this partition, then picked by block in registers
        ahead = pt_ref[j * ppp + _block_page_index(plan, per_token)]

    def pages_of(b):
        if ahead is not None:
            pick = lax.broadcasted_iota(jnp.int32, ahead.shape, 0) == b
            return jnp.sum(jnp.where(pick, ahead, 0), axis=0)
        if per_token:
            tok = lax.broadcasted_iota(jnp.int32, (bk,), 0)
            return pt_ref[j * ppp + b * ppb + tok // plan.page_size]
        return pt_ref[pl.ds(j * ppp + b * ppb, ppb)]

    def body(b, carry):
        m, lsum, acc = carry
        pages = pages_of(b)
        blk_ok = (b < n_blk) if cfg.static_blocks and per_token else None
        k = _kv_block(k_ref, pages, blk_ok, e, plan)
        v = _kv_block(v_ref, pages, blk_ok, e, plan)
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

    return lax.fori_loop(0, ps // bk if cfg.static_blocks else n_blk, body, _sentinel(rows, e))


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


def _merge_kernel(lim_ref, acc_ref, m_ref, l_ref, o_ref, *, plan: _Plan):
    """Grid (tile, kv head, token of the tile): fold the token's partitions in increasing order.

    The merge is elementwise across rows, so blocking it by token (not by the split kernel's
    MMA tile) changes no bits. Each loop step folds exactly one partition, as `_looped_kernel`
    does (XLA CPU was seen to round an unrolled chain of merges differently from a loop of
    single merges, so the loop shape is part of the plan); the loads of the next
    `AttentionConfig.merge_prefetch` partitions ride in the carry to hide memory latency.
    """
    lim = lim_ref[...]  # [G_pad]
    row_ok = lim >= 0
    _store_rows(o_ref, _merged(lim, acc_ref, m_ref, l_ref, plan, o_ref.dtype), row_ok)


def _merged(lim, acc_ref, m_ref, l_ref, plan: _Plan, dtype):
    """The merge kernels' fold of one token's partitions (`_merge_kernel` docstring): [G_pad, E]."""
    row_ok = lim >= 0
    gp, e = acc_ref.shape[-2:]
    n_parts = _num_parts(lim, plan)
    ahead = plan.config.merge_prefetch

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
        return state, parts[1:] + (load(j + ahead),)

    init = (_sentinel(gp, e), tuple(load(jnp.int32(d)) for d in range(ahead)))
    state, _ = lax.fori_loop(0, n_parts, body, init)
    return _finish(state, dtype)


def _merge_rows_kernel(lim_ref, tok_ref, ok_ref, acc_ref, m_ref, l_ref, o_ref, *, plan: _Plan,
                       g: int, block_q: int, num_tiles: int):  # fmt: skip
    """`_merge_kernel` writing the attention's final layout itself: o_ref is the whole output
    [rows_out, H, E]; program (tile i, kv head k, row r) stores its token's heads k*G.. (the
    same values, so the same bits), and zeros head k's columns of the output rows no token owns
    (padding tokens, rows T..rows_out: the next matmul's padding), rows i*block_q + r +
    n*num_tiles*block_q. Saves the gather + select fusion after the merge."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    i, kh, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    lim = lim_ref[...]  # [G_pad]: row r of tile i, its G_pad heads; < 0: not attended
    rows_out, h, e = o_ref.shape
    gp = lim.shape[0]
    t = ok_ref.shape[0]
    out = _merged(lim, acc_ref, m_ref, l_ref, plan, o_ref.dtype)
    gi = lax.broadcasted_iota(jnp.int32, (gp, 1), 0)
    cols = lax.broadcasted_iota(jnp.int32, (1, e), 1)
    # heads past G (G_pad padding) point past H: masked, and never another row's element
    heads = jnp.where(gi < g, kh * g + gi, h + gi)
    mask = jnp.broadcast_to((lim >= 0)[:, None], (gp, e))
    pltriton.store(o_ref.at[tok_ref[i, r], heads, cols], out, mask=mask)
    head_ok = jnp.broadcast_to(gi < g, (gp, e))
    zero = jnp.zeros((gp, e), o_ref.dtype)
    for n in range(-(-rows_out // (num_tiles * block_q))):
        j = (i * block_q + r) + n * num_tiles * block_q
        jc = jnp.minimum(j, rows_out - 1)
        owned = (j < t) & ok_ref[jnp.minimum(j, t - 1)]
        free = (j < rows_out) & jnp.logical_not(owned)
        pltriton.store(o_ref.at[jc, heads, cols], zero, mask=head_ok & free)


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
