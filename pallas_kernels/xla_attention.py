"""The invariant paged attention as plain XLA for CPU backends (`xla_fixed`'s attention).

Why: on a CPU the Pallas kernel can only run in interpret mode (pallas_kernels/xla_fixed.py says
why that is too slow); this is an ordinary jnp/lax program with the Pallas plan's KV blocks and
merge order (pallas_kernels/paged_attention.py), whose every dot has a shape fixed by the model.
Backend "xla" of `paged_attention.paged_attention`; CPU bits differ from GPU bits.

Reduction plan: KV positions cut into blocks of block_kv tokens aligned to position 0
(`default_block_kv(partition_size, page_size)`, as the Pallas plan), folded in increasing order
with the online-softmax rule from the sentinel (m, l, acc) = (-inf, 0, 0). Per query token (the
tokens run in lax.map groups of TB, each group a loop over the blocks its tokens need; a step
of one group, T <= TB, runs its real tokens one at a time instead, below):
    s = (q . k) * scale   one fixed-shape dot [1, E] x [E, block_kv] per (token, query head)
    s = -inf where kv_pos > p;  m' = max(m, max s);  m* = (m' == -inf ? 0 : m')
    p = exp(s - m*);  alpha = exp(m - m*);  l = l*alpha + halving_tree(p)
    acc = acc*alpha + p.astype(v) @ v   (one fixed-shape dot [1, block_kv] x [block_kv, E])
out = acc / l. A block wholly past a token's position is an exact identity on its state
(alpha = 1, p = 0), so neither the loop's trip count (the longest context in the token's group)
nor the batch's page-table width shows in its bits: one-shot prefill, chunked prefill and decode
give the same bits. The loop body has one shape whatever the batch (every value is [TB, ...]),
so XLA compiles the same arithmetic for every step; tokens per iteration (TB, or 1 for a step
of one group: a batch-1 decode pads to 8 rows, whose 7 padding rows the group would gather KV
for and compute like real ones) is only a batch dimension of every dot and element-wise op,
as the matmuls' n blocks are, so a token's bits are the same either way (tested: chunk 1 and 7
against the whole prompt; a batch-1 decode does an eighth of the group's work, and a step of 8
real tokens is no slower). Dots are per query head, not per kv head
([G, E] x [E, block_kv]): G differs between TP sizes when kv heads are replicated, and a dot of
another shape may round differently (TP=8 disagreed with TP=1 on the tiny test model).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._platform import as_float, kv_compute_dtype
from pallas_kernels.xla_fixed import _pad_axis, tree_sum

# Query tokens per iteration of the attention loop (how much KV is gathered at once).
TB = 8


def _token_seq(query_start: jax.Array, t: int):
    qs = query_start.astype(jnp.int32)
    s = qs.shape[0] - 1
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = (jnp.searchsorted(qs, tok, side="right", method="compare_all") - 1).astype(jnp.int32)
    seq_c = jnp.clip(seq, 0, s - 1)
    ok = (seq >= 0) & (seq < s) & (tok >= qs[seq_c]) & (tok < qs[seq_c + 1])
    return seq_c, ok


def _merge_block(state, s, v, precision):
    """Fold one KV block (scores s [TB, K, G, bk], values v [TB, K, bk, E]) into the running
    (m, l, acc) with the online-softmax rule; a fully masked block is an exact identity."""
    m, lsum, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # exact
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = lax.optimization_barrier(jnp.exp(s - m_safe[..., None]))
    alpha = lax.optimization_barrier(jnp.exp(m - m_safe))
    lsum = lsum * alpha + tree_sum(p)
    pv = lax.dot_general(
        p.astype(v.dtype)[..., None, :], v, (((4,), (3,)), ((0, 1, 2), (0, 1, 2))),
        precision=precision, preferred_element_type=jnp.float32,
    )[..., 0, :]  # fmt: skip  [TB, K, G, E]: one [1, bk] x [bk, E] dot per (token, query head)
    return m_new, lsum, acc * alpha[..., None] + pv


@functools.partial(jax.jit, static_argnames=("scale", "block_kv"))
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
    block_kv: int,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Causal paged attention of q[T, H, E] (plan in the module docstring); padding rows -> 0.

    k_cache/v_cache [K, P, B, E], or the stacked [L, K, P, B, E] cache with `layer`; a uint16
    cache holds bf16/f16 bits of q's dtype (jdet/kv_cache.py: the CPU storage). The caller
    (`paged_attention.paged_attention`) has validated shapes and chosen block_kv."""
    # The stacked cache is gathered from in place (`layer` is part of each gather's index):
    # slicing the layer out first copied the layer's whole page pool in every layer of every
    # step (most of a decode step with a large pool).
    stacked = layer is not None
    if not stacked:
        k_cache, v_cache = k_cache[None], v_cache[None]
        layer = jnp.int32(0)
    t, h, e = q.shape
    _, kh, num_pages, page, _ = k_cache.shape
    g = h // kh
    s, pmax = page_table.shape
    ppb = block_kv // page  # pages per block
    nblk = max(1, -(-(pmax * page) // block_kv))
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    pt = _pad_axis(pt, 1, nblk * ppb)  # page 0 is finite (zero-filled) and masked
    seq, ok = _token_seq(query_start, t)
    lim = jnp.minimum(positions.astype(jnp.int32) + 1, context_lens.astype(jnp.int32)[seq])
    lim = jnp.where(ok, jnp.maximum(lim, 0), 0)
    tp = -(-t // TB) * TB
    qg = _pad_axis(q.reshape(t, kh, g, e), 0, tp).reshape(tp // TB, TB, kh, g, e)
    seq_b = _pad_axis(seq, 0, tp).reshape(tp // TB, TB)
    lim_b = _pad_axis(lim, 0, tp).reshape(tp // TB, TB)
    precision = lax.Precision.HIGHEST if jnp.dtype(q.dtype).itemsize > 2 else None
    col = jnp.arange(block_kv, dtype=jnp.int32)

    kv_dtype = kv_compute_dtype(k_cache.dtype, q.dtype)

    def _gather_pages(cache: jax.Array, blk: jax.Array) -> jax.Array:
        """cache[:, blk] as kv_dtype. A uint16-stored cache (jdet/kv_cache.py) is gathered as
        such and only the gathered pages are bitcast. A bf16/f16 cache is gathered as uint16
        too (XLA CPU has no bf16 gather and otherwise upcasts the whole layer to f32), at the
        cost of bitcasting the pool. Bitcasts move the same bits: the result is unchanged."""
        def take(c: jax.Array) -> jax.Array:  # c[layer, :, blk] -> [K, TB, ppb, B, E]
            return jnp.moveaxis(c[layer, :, blk], 2, 0)

        if cache.dtype == jnp.uint16:
            return as_float(take(cache), kv_dtype)
        if cache.dtype not in (jnp.bfloat16, jnp.float16):
            return take(cache)
        return lax.bitcast_convert_type(take(lax.bitcast_convert_type(cache, jnp.uint16)),
                                        cache.dtype)  # fmt: skip

    def attend(qq: jax.Array, ss: jax.Array, ll: jax.Array) -> jax.Array:
        """Tokens qq [tb, K, G, E] of sequences ss [tb] attending to their first ll [tb] KV
        positions -> [tb, K, G, E] f32 (0 where ll = 0). tb tokens per loop iteration: TB for a
        group, 1 for a token alone (`single`); each token's dots and element-wise ops are the
        same whichever (tb is a batch dimension of every dot: module docstring)."""
        tb = qq.shape[0]
        qq = qq.astype(kv_dtype)
        pages = pt[ss]  # [tb, nblk * ppb]

        def body(j, state):
            blk = lax.dynamic_slice_in_dim(pages, j * ppb, ppb, axis=1)  # [tb, ppb]
            # Per query head, so that a dot's shape never depends on G (heads per kv head on
            # this device): TP shards with replicated kv heads have other G than TP=1.
            k, v = _gather_pages(k_cache, blk), _gather_pages(v_cache, blk)
            k = k.reshape(kh, tb, 1, block_kv, e).transpose(1, 0, 2, 3, 4)
            v = v.reshape(kh, tb, 1, block_kv, e).transpose(1, 0, 2, 3, 4)
            k = jnp.broadcast_to(k, (tb, kh, g, block_kv, e))
            v = jnp.broadcast_to(v, (tb, kh, g, block_kv, e))
            sc = lax.dot_general(
                qq[..., None, :], k, (((4,), (4,)), ((0, 1, 2), (0, 1, 2))),
                precision=precision, preferred_element_type=jnp.float32,
            )[..., 0, :] * scale  # fmt: skip  [tb, K, G, bk]: one [1, E] x [E, bk] dot per head
            mask = (j * block_kv + col)[None, :] < ll[:, None]  # [tb, bk]
            sc = jnp.where(mask[:, None, None, :], sc, -jnp.inf)
            return _merge_block(state, sc, v, precision)

        init = (
            jnp.full((tb, kh, g), -jnp.inf, jnp.float32),
            jnp.zeros((tb, kh, g), jnp.float32),
            jnp.zeros((tb, kh, g, e), jnp.float32),
        )
        # Only the blocks some token of this group needs; for the others they would be exact
        # identities anyway, so the trip count (a function of the batch) never shows in the bits.
        n_blk = jnp.minimum((jnp.max(ll) + block_kv - 1) // block_kv, nblk)
        _, lsum, acc = lax.fori_loop(0, n_blk, body, init)
        safe = jnp.where(lsum > 0, lsum, 1.0)
        return jnp.where((lsum > 0)[..., None], acc / safe[..., None], 0.0)

    def single(qq: jax.Array, ss: jax.Array, ll: jax.Array) -> jax.Array:
        """The step's tokens one at a time, up to the last with KV to attend to (ll > 0): a step
        of one group (T <= TB: a decode of up to TB sequences) mostly holds padding rows, which
        the group's loop would gather KV for and compute like real ones (a batch-1 decode: 8x
        the attention's work)."""
        # up to the last token with KV (the batch's padding rows come last; a row with none
        # before it gets attend's zeros, as in a group)
        n = jnp.max(jnp.where(ll > 0, jnp.arange(1, ll.shape[0] + 1, dtype=jnp.int32), 0))

        def token(r, out):
            o = attend(lax.dynamic_slice_in_dim(qq, r, 1), lax.dynamic_slice_in_dim(ss, r, 1),
                       lax.dynamic_slice_in_dim(ll, r, 1))  # fmt: skip
            return lax.dynamic_update_slice_in_dim(out, o, r, axis=0)

        return lax.fori_loop(0, n, token, jnp.zeros(qq.shape, jnp.float32))

    if tp == TB:  # one group (the smallest token bucket): its real tokens alone
        out = single(qg[0], seq_b[0], lim_b[0])[None]
    else:
        out = lax.map(lambda a: attend(*a), (qg, seq_b, lim_b))  # [T/TB, TB, K, G, E]
    out = out.reshape(tp, h, e)[:t]
    return jnp.where(ok[:, None, None], out, 0.0).astype(q.dtype)
