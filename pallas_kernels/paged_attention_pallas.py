"""The `pallas_call` launch of the invariant paged attention: grids, block specs and the
split-or-looped choice around the kernels of `paged_attention_kernels.py`. The reduction plan is
in pallas_kernels/paged_attention.py's docstring; nothing here changes it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _platform
from pallas_kernels.paged_attention_kernels import (
    _LOG2E,
    DEFAULT_CONFIG,
    ROWS,
    AttentionConfig,
    _check,
    _looped_kernel,
    _merge_kernel,
    _merge_rows_kernel,
    _next_pow2,
    _Plan,
    _precision,
    _split_kernel,
    _tile_plan,
    default_block_kv,
)

STRUCTURES = ("auto", "split", "looped")
# The split layout's (m, l, acc) partials of one call, f32, at most (`auto_structure`). Why a cap:
# they span every partition of the page table's width, so a prefill chunk of a few thousand
# tokens beside long contexts held 12 GiB of them (T 2048, 256 sequences, 2,052 pages: an H200
# out of memory) where the looped layout needs none. serving/engine/memory.py counts the cap.
SPLIT_PARTIALS_MAX_BYTES = 4 << 30


def split_partials_bytes(nt: int, kh: int, num_parts: int, rows: int, e: int) -> int:
    """Bytes of the split layout's partials: f32 (m, l) and acc [rows, E] per (tile, kv head,
    partition)."""
    return nt * kh * num_parts * rows * (e + 2) * 4


def auto_structure(
    nt: int, kh: int, num_parts: int, rows: int, e: int, config: AttentionConfig
) -> str:
    """structure="auto": split-KV while fewer (query tile x kv head) programs than
    `config.split_below_programs` exist (a few long decodes still fill the GPU) and its partials
    stay within SPLIT_PARTIALS_MAX_BYTES; looped otherwise. Never a bit: both layouts run the
    same partition code and merge order."""
    few = nt * kh < config.split_below_programs
    small = split_partials_bytes(nt, kh, num_parts, rows, e) <= SPLIT_PARTIALS_MAX_BYTES
    return "split" if few and small else "looped"


def attention_meta(
    page_table: jax.Array,
    context_lens: jax.Array,
    query_start: jax.Array,
    positions: jax.Array,
    *,
    t: int,
    g: int,
    num_pages: int,
    page_size: int,
    partition_size: int,
    block_rows: int = ROWS,
) -> dict:
    """The batch-derived operands of the kernels: query tiles, per-row limits, tile page tables.

    Why apart: they depend on the step's batch and static shapes (T tokens, G query heads per kv
    head, the pool's P pages per head), never on the layer; computed inside the layer scan they
    cost ~4 small launches per layer on a GPU (XLA does not hoist them), so the model computes
    them once per step (jdet/model.py). No arithmetic of the attention itself happens here.
    """
    s, pmax = page_table.shape
    gp = _next_pow2(g)
    block_q = max(1, block_rows // gp)
    ppp = partition_size // page_size  # pages per partition
    num_parts = max(1, -(-(pmax * page_size) // partition_size))
    nt, tseq, tstart, tcount, tok_ok, tok_tile, tok_row = _tile_plan(query_start, t, s, block_q)
    r = jnp.arange(block_q, dtype=jnp.int32)
    tok = tstart[:, None] + r[None, :]  # [NT, bq]
    tok_valid = r[None, :] < tcount[:, None]
    tok_c = jnp.clip(tok, 0, t - 1)
    ctx = context_lens.astype(jnp.int32)[tseq]  # [NT]
    lim_tok = jnp.minimum(positions.astype(jnp.int32)[tok_c] + 1, ctx[:, None])
    lim_tok = jnp.where(tok_valid, jnp.maximum(lim_tok, 0), -1)  # [NT, bq]
    head_ok = jnp.arange(gp) < g
    lim = jnp.where(head_ok[None, None, :], lim_tok[:, :, None], -1).reshape(nt, block_q * gp)
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    pt = jnp.pad(pt, ((0, 0), (0, num_parts * ppp - pmax)))[tseq]  # [NT, J*ppp]
    return {"tok_c": tok_c, "lim": lim, "pt": pt, "tok_ok": tok_ok, "tok_tile": tok_tile,
            "tok_row": tok_row}  # fmt: skip


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "partition_size", "block_kv", "structure", "block_rows", "num_warps",
        "num_stages", "out_rows", "q_heads", "direct_out", "config",
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
    num_stages: int | None = None,
    meta: dict | None = None,
    out_rows: int | None = None,
    q_heads: int | None = None,
    direct_out: bool = False,
    config: AttentionConfig = DEFAULT_CONFIG,
) -> jax.Array:
    """Causal attention of q[T, H, E] over the paged cache, bitwise invariant (module docstring).

    `config`: how the kernels load and launch (`AttentionConfig`: never a value or an order).
    `direct_out`: in the split layout, the merge kernel writes the [out_rows or T, H, E] result
    itself, padding rows zeroed (`_merge_rows_kernel`), instead of a gather + select after it:
    the same values in the same places, one launch fewer. The looped layout ignores it.

    With `q_heads`, q is already in the kernel's query-tile layout [NT, K, rows, E] for `meta`
    (pallas_kernels/rope_kv.py writes it with RoPE applied) and holds q_heads heads: the gather +
    transpose + pad into it (one XLA fusion per layer) is skipped; `meta` is then required.

    Returns [out_rows or T, H, E]. `meta` is `attention_meta` of this step's batch (computed here
    when None): it depends on the batch alone, so the model computes it once per step instead of
    once per layer. Rows T..out_rows are zeros (the padding the next matmul wants).
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
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    q_tiles = None
    if q_heads is not None:  # the tile layout already (docstring); q[T, H, E] is its shape
        if meta is None:
            raise ValueError("paged_attention: a query in the tile layout (q_heads) needs `meta`")
        q_tiles = q
        q = jax.ShapeDtypeStruct((positions.shape[0], q_heads, q.shape[-1]), q.dtype)
    stacked = layer is not None
    if stacked:
        if k_cache.ndim != 5:
            raise ValueError(f"with `layer`, k/v caches are [L, K, P, B, E]; got {k_cache.shape}")
        n_layers = k_cache.shape[0]
        # One flat page pool per cache: above 2**32 bytes Pallas's Triton lowering computes the
        # element offsets in 64 bits (tests/jdet/test_rope_kv_model.py checks a pool > 2**31
        # elements on the GPU), so the pool's size is not capped here.
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
    plan = _Plan(partition_size, bk, page_size, float(scale) * _LOG2E, _precision(q.dtype),
                 config)  # fmt: skip

    if meta is None:
        meta = attention_meta(
            page_table, context_lens, query_start, positions, t=t, g=g, num_pages=num_pages,
            page_size=page_size, partition_size=partition_size, block_rows=block_rows,
        )  # fmt: skip
    nt = meta["lim"].shape[0]
    if meta["lim"].shape[1] != rows or meta["tok_c"].shape != (nt, block_q):
        raise ValueError("`meta` was prepared for another query/head layout (attention_meta)")
    tok_c, lim, pt = meta["tok_c"], meta["lim"], meta["pt"]

    # Per-tile query rows [NT, K, rows, E]: row r*gp + g is token tstart+r, head k*G+g.
    if q_tiles is None:
        qg = q.reshape(t, kh, g, e)
        if gp != g:
            qg = jnp.pad(qg, ((0, 0), (0, 0), (0, gp - g), (0, 0)))
        q_tiles = qg[tok_c].transpose(0, 2, 1, 3, 4).reshape(nt, kh, rows, e)
    elif q_tiles.shape != (nt, kh, rows, e):
        raise ValueError(
            f"paged_attention: query tiles {q_tiles.shape} do not match `meta`'s "
            f"{(nt, kh, rows, e)}"
        )

    interpret = _platform.interpret_default()
    compiler_params = merge_params = None
    if not interpret:
        # The merge holds (1 + config.merge_prefetch) x [G_pad, E] f32 per program: ~16 values per
        # thread per partial keeps it in registers.
        merge_warps = max(1, min(8, gp * e // 512))
        merge_params = pltriton.CompilerParams(num_warps=merge_warps, num_stages=1)
    if structure == "auto":
        structure = auto_structure(nt, kh, num_parts, rows, e, config)
    if not interpret:
        stages = num_stages or (config.split_stages if structure == "split" else 2)
        compiler_params = pltriton.CompilerParams(num_warps=num_warps, num_stages=stages)
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
        # the layer itself, not its page base: the base is computed in the kernel (on the host
        # graph it was a scalar fusion, one more launch per layer)
        hb = [jnp.asarray(layer, jnp.int32).reshape(1)]
        hb_specs = [pl.BlockSpec((1,), lambda *_: (0,))]
    if structure == "looped":
        out = pl.pallas_call(
            _layered(functools.partial(_looped_kernel, plan=plan), stacked, num_pages, kh),
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
            _layered(functools.partial(_split_kernel, plan=plan), stacked, num_pages, kh),
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
        rows_out = out_rows or t
        # both merge kernels: program (tile, kv head, token) reads its row's limits and partials
        lim_row = pl.BlockSpec((None, gp), lambda i, k, r: (i, r))
        part_specs = [
            pl.BlockSpec((None, None, num_parts, gp, e), lambda i, k, r: (i, k, 0, r, 0)),
            pl.BlockSpec((None, None, num_parts, gp), lambda i, k, r: (i, k, 0, r)),
            pl.BlockSpec((None, None, num_parts, gp), lambda i, k, r: (i, k, 0, r)),
        ]
        if direct_out and rows_out >= t:
            whole = [pl.BlockSpec(meta["tok_c"].shape, lambda i, k, r: (0, 0)),
                     pl.BlockSpec(meta["tok_ok"].shape, lambda i, k, r: (0,))]  # fmt: skip
            return pl.pallas_call(
                functools.partial(_merge_rows_kernel, plan=plan, g=g, block_q=block_q,
                                  num_tiles=nt),  # fmt: skip
                grid=(nt, kh, block_q),
                in_specs=[lim_row, *whole, *part_specs],
                out_specs=pl.BlockSpec((rows_out, h, e), lambda i, k, r: (0, 0, 0)),
                out_shape=jax.ShapeDtypeStruct((rows_out, h, e), q.dtype),
                interpret=interpret,
                compiler_params=merge_params,
                name=f"paged_attention_merge_rows_{tag}",
            )(lim, meta["tok_c"], meta["tok_ok"], acc, m, lsum)
        out = pl.pallas_call(
            functools.partial(_merge_kernel, plan=plan),
            grid=(nt, kh, block_q),
            in_specs=[lim_row, *part_specs],
            out_specs=pl.BlockSpec((None, None, gp, e), lambda i, k, r: (i, k, r, 0)),
            out_shape=o_shape,
            interpret=interpret,
            compiler_params=merge_params,
            name=f"paged_attention_merge_{tag}",
        )(lim, acc, m, lsum)

    # Each token's row of its own tile; padding tokens (and rows t..out_rows) read zeros.
    tok_ok, tok_tile, tok_row = meta["tok_ok"], meta["tok_tile"], meta["tok_row"]
    rows_out = out_rows or t
    if rows_out < t:
        raise ValueError(f"out_rows ({rows_out}) < the number of query tokens ({t})")
    if rows_out > t:  # the next matmul's zero row padding, fused into this gather
        extra = rows_out - t
        tok_ok = jnp.pad(tok_ok, (0, extra))
        tok_tile, tok_row = jnp.pad(tok_tile, (0, extra)), jnp.pad(tok_row, (0, extra))
    out = out.reshape(nt, kh, block_q, gp, e)[tok_tile, :, tok_row][:, :, :g]  # [T', K, G, E]
    out = jnp.where(tok_ok[:, None, None, None], out, jnp.zeros((), q.dtype))
    return out.reshape(rows_out, h, e)


class _PagePool:
    """A [pages, B, E] ref seen through a page offset: `pool[pages]` reads `ref[pages + off]`."""

    def __init__(self, ref, off):
        self.ref, self.off = ref, off

    def __getitem__(self, idx):
        return self.ref[self._shift(idx)]

    def at_rows(self, idx: tuple):
        """`ref.at[...]` of a (page, slot, column) index (kv_gather_2d's masked loads)."""
        return self.ref.at[self._shift(idx)]

    def _shift(self, idx):
        if isinstance(idx, tuple):
            return (idx[0] + self.off, *idx[1:])
        return idx + self.off

    @property
    def dtype(self):
        return self.ref.dtype


def _layered(kernel, stacked: bool, num_pages: int, kv_heads: int):
    """With a stacked cache, take the layer as the first operand and hand the kernel its head's
    pool (layer*K + k) * P ... + P - 1 of the flattened [L*K*P, B, E] cache."""
    if not stacked:
        return kernel

    def wrapped(layer_ref, pt_ref, lim_ref, q_ref, k_ref, v_ref, *outs):
        off = (layer_ref[0] * kv_heads + pl.program_id(1)) * num_pages
        return kernel(pt_ref, lim_ref, q_ref, _PagePool(k_ref, off), _PagePool(v_ref, off), *outs)

    return wrapped
