"""RoPE + the K/V cache write + the query in the paged attention's tile layout: one kernel.

Why: around attention a decode layer ran five small XLA fusions (v select, v
dynamic-update-slice into the cache, k slice, k RoPE + update-slice, q RoPE + transpose/pad into
the attention kernel's query tiles), launch-bound at batch 1 (BENCHMARKS.md, where the 8B step
goes). This
kernel does all of it in one launch, reading the q|k|v projection's rows where they are.

Arithmetic (no reduction): x*cos + rotate_half(x)*sin in f32, rounded to x's dtype, exactly the
expression of jdet/ops.py `apply_rope` written per half (first half x1*c1 + (-x2)*s1, second
half x2*c2 + x1*s2: the same products and sums, element by element); v is copied. Whether the
compiler contracts a product and a sum into one FMA is the backend's choice, as it is in XLA's
fusion, so the bits on a GPU are checked against the XLA path by a `gpu` test
(tests/pallas_kernels/test_rope_kv.py). In interpret mode (the CPU) they equal the jitted XLA
path's, f32 and bf16 (XLA CPU contracts x1*c1 + round((-x2)*s1) into an FMA in both; eager,
op-by-op jnp does not, so an f32 comparison must be against jitted code).

Layout:
- sources: the fused projection's rows qkv[R >= T, (H + 2K) * E] (q heads, then k, then v), or
  q[T, H, E], k[T, K, E], v[T, K, E], or (Qwen3's head-normed q|k rows, the fused rows for v);
- caches [L, K, P, B, E], updated in place (input_output_aliases): token t's K/V go to layer
  `layer`, slot s = page * B + offset, i.e. flat row ((layer * K + k) * P * B + s); slot -1
  (padding) is not written, as jdet/kv_cache.py `write_kv` drops it;
- the query comes back as `QueryTiles`: [NT, K, rows, E], tile i's row r*G_pad + g holding
  token tok_c[i, r] and head k*G + g (zeros for the padding heads g >= G), which is what
  paged_attention_pallas.py builds from q[T, H, E] with a gather + transpose + pad.

Grid (NT, K): program (i, k) writes query tile i of kv head k, and the K/V rows of kv head k for
tokens i*block_q ... i*block_q + block_q - 1 (NT = cdiv(T, block_q) + S tiles cover every token).
Nothing depends on the batch but which rows each program touches.

Backends: the Triton lowering on a GPU, interpret mode on a CPU (the kernel tests, and the model
under JDET_PALLAS_INTERPRET=1, where a uint16-stored cache is bitcast to its float type around
the call). The model uses it only under `Ops.rope_kv` where the Pallas attention runs.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform
from pallas_kernels._platform import as_float


@dataclasses.dataclass(frozen=True)
class QueryTiles:
    """RoPE(q) already in the paged attention kernel's tile layout [NT, K, rows, E] (module
    docstring); `heads` (H) and `tokens` (T) are the [T, H, E] query it stands for."""

    tiles: jax.Array
    heads: int
    tokens: int


def _store_cols(ref, rows, col0: int, width: int, val, ok) -> None:
    """ref[rows[r], col0 : col0 + width] = val[r] where ok[r]: a scatter of whole row pieces.

    Array indices on both axes (not an array + a slice): the form both the Triton lowering and
    interpret mode's masked store take."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    cols = col0 + lax.broadcasted_iota(jnp.int32, (1, width), 1)
    mask = jnp.broadcast_to(ok[:, None], (rows.shape[0], width))
    pltriton.store(ref.at[rows[:, None], cols], val, mask=mask)


def _rope_rows(src_ref, src_rows, cos_ref, sin_ref, toks, half: int):
    """(first half, second half) of RoPE of src rows `src_rows`, tokens `toks`: f32, unrounded."""
    x1 = src_ref[src_rows, pl.ds(0, half)].astype(jnp.float32)
    x2 = src_ref[src_rows, pl.ds(half, half)].astype(jnp.float32)
    c1, c2 = cos_ref[toks, pl.ds(0, half)], cos_ref[toks, pl.ds(half, half)]
    s1, s2 = sin_ref[toks, pl.ds(0, half)], sin_ref[toks, pl.ds(half, half)]
    return x1 * c1 + (-x2) * s1, x2 * c2 + x1 * s2


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Static shapes of one call: heads, their rows in the sources, the tile geometry."""

    t: int  # tokens
    q_heads: int
    kv_heads: int
    e: int
    g_pad: int  # query heads per kv head, padded to a power of two
    block_q: int  # tokens per query tile
    slots: int  # P * B: cache rows of one (layer, kv head)
    rows_total: int  # L * K * P * B: rows of the whole cache
    # (heads per token, first head) of q, k, v in their source's [tokens * heads, E] rows
    q_src: tuple[int, int]
    k_src: tuple[int, int]
    v_src: tuple[int, int]


def _kernel(layer_ref, slot_ref, tok_ref, q_ref, k_ref, v_ref, cos_ref, sin_ref, _k_in, _v_in,
            qo_ref, kc_ref, vc_ref, *, lay: _Layout):  # fmt: skip
    i, kh = pl.program_id(0), pl.program_id(1)
    half = lay.e // 2
    g = lay.q_heads // lay.kv_heads
    # -- query tile i of kv head kh: row r*G_pad + h is token tok_c[i, r], head kh*G + h
    rows = lay.block_q * lay.g_pad
    r = lax.broadcasted_iota(jnp.int32, (rows,), 0)
    toks = tok_ref[r // lay.g_pad]
    head = r % lay.g_pad
    head_ok = head < g
    src = toks * lay.q_src[0] + lay.q_src[1] + kh * g + jnp.minimum(head, g - 1)
    o1, o2 = _rope_rows(q_ref, src, cos_ref, sin_ref, toks, half)
    zero = jnp.zeros((), jnp.float32)
    qo_ref[:, pl.ds(0, half)] = jnp.where(head_ok[:, None], o1, zero).astype(qo_ref.dtype)
    qo_ref[:, pl.ds(half, half)] = jnp.where(head_ok[:, None], o2, zero).astype(qo_ref.dtype)
    # -- K/V of kv head kh for tokens i*block_q ...: slot -1 and tokens past T are not written
    t = i * lay.block_q + lax.broadcasted_iota(jnp.int32, (lay.block_q,), 0)
    tc = jnp.minimum(t, lay.t - 1)
    slot = slot_ref[tc]
    ok = (t < lay.t) & (slot >= 0)
    # a row not written points one past the cache: never at another row's slot (interpret
    # mode's masked store writes the old value back, and a duplicate row could win the scatter)
    dst = jnp.where(ok, (layer_ref[0] * lay.kv_heads + kh) * lay.slots + slot, lay.rows_total)
    k1, k2 = _rope_rows(k_ref, tc * lay.k_src[0] + lay.k_src[1] + kh, cos_ref, sin_ref, tc, half)
    # rounded to the source's dtype first, as apply_rope's output is before write_kv casts it
    _store_cols(kc_ref, dst, 0, half, k1.astype(k_ref.dtype).astype(kc_ref.dtype), ok)
    _store_cols(kc_ref, dst, half, half, k2.astype(k_ref.dtype).astype(kc_ref.dtype), ok)
    v = v_ref[tc * lay.v_src[0] + lay.v_src[1] + kh, pl.ds(0, lay.e)]
    _store_cols(vc_ref, dst, 0, lay.e, v.astype(vc_ref.dtype), ok)


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def rope_kv(
    qkv: jax.Array | tuple[jax.Array, jax.Array, jax.Array],
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tok_c: jax.Array,
    *,
    layer: jax.Array,
    q_heads: int,
    rows: int,
    num_warps: int = 4,
) -> tuple[QueryTiles, jax.Array, jax.Array]:
    """RoPE(q) as `QueryTiles`, and the caches with RoPE(k) and v written (module docstring).

    `qkv`: the fused rows [R >= T, (H + 2K) * E], or (q[T, H, E], k[T, K, E], v[T, K, E]), or
    (q|k rows [T * (H + K), E] as `rms_norm.head_rms_norm` returns them, the fused rows: v is
    read from these);
    cos, sin [T, E] f32 (jdet/model.py `rope_tables`); slot_mapping [T]; caches [L, K, P, B, E]
    (a uint16-stored one, the CPU's, is bitcast to q's dtype around the call); `tok_c` [NT,
    block_q] and `rows` (block_q * G_pad): the attention's tile plan (`attention_meta`'s
    "tok_c" and the width of its "lim"); `layer`: int32 scalar. `num_warps`: Triton launch.
    """
    tiles, k_cache, v_cache = _rope_kv(
        qkv, cos, sin, slot_mapping, k_cache, v_cache, tok_c, layer, q_heads=q_heads, rows=rows,
        num_warps=num_warps,
    )  # fmt: skip
    return QueryTiles(tiles, q_heads, slot_mapping.shape[0]), k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("q_heads", "rows", "num_warps"))
def _rope_kv(qkv, cos, sin, slot_mapping, k_cache, v_cache, tok_c, layer, *, q_heads: int,
             rows: int, num_warps: int):  # fmt: skip
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    if k_cache.ndim != 5 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"rope_kv: k/v caches are [L, K, P, B, E] of one shape; got {k_cache.shape}, "
            f"{v_cache.shape}"
        )
    n_layers, kh, num_pages, page_size, e = k_cache.shape
    t = slot_mapping.shape[0]
    if q_heads % kh:
        raise ValueError(f"rope_kv: query heads ({q_heads}) must be a multiple of kv heads ({kh})")
    if not (_pow2(e) and e >= 2):
        raise ValueError(f"rope_kv: head dim {e} is not a power of two (Triton blocks must be)")
    if cos.shape != (t, e) or sin.shape != (t, e):
        raise ValueError(f"rope_kv: cos/sin must be [T, E] = {(t, e)}; got {cos.shape}/{sin.shape}")
    nt, block_q = tok_c.shape
    g_pad = rows // block_q
    if block_q * g_pad != rows or not _pow2(g_pad) or g_pad < q_heads // kh:
        raise ValueError(f"rope_kv: tile plan tok_c{tok_c.shape} does not fit rows={rows}")
    if isinstance(qkv, tuple) and len(qkv) == 2:  # (head-normed q|k rows, the fused rows)
        qk, rows_all = qkv
        nh = q_heads + 2 * kh
        if qk.shape != (t * (q_heads + kh), e) or rows_all.ndim != 2 or rows_all.shape[0] < t \
                or rows_all.shape[1] != nh * e:  # fmt: skip
            raise ValueError(
                f"rope_kv: expected normed q|k rows [{t * (q_heads + kh)}, {e}] and fused rows "
                f"[R >= {t}, {nh * e}]; got {qk.shape}, {rows_all.shape}"
            )
        srcs = (qk, qk, rows_all.reshape(-1, e))
        offs = ((q_heads + kh, 0), (q_heads + kh, q_heads), (nh, q_heads + kh))
    elif isinstance(qkv, tuple):
        q, k, v = qkv
        if q.shape != (t, q_heads, e) or k.shape != (t, kh, e) or v.shape != k.shape:
            raise ValueError(
                f"rope_kv: expected q[{t}, {q_heads}, {e}], k/v[{t}, {kh}, {e}]; got "
                f"q{q.shape}, k{k.shape}, v{v.shape}"
            )
        srcs = (q.reshape(-1, e), k.reshape(-1, e), v.reshape(-1, e))
        offs = ((q_heads, 0), (kh, 0), (kh, 0))
    else:
        nh = q_heads + 2 * kh
        if qkv.ndim != 2 or qkv.shape[0] < t or qkv.shape[1] != nh * e:
            raise ValueError(
                f"rope_kv: fused rows must be [R >= {t}, (H + 2K) * E = {nh * e}]; got {qkv.shape}"
            )
        flat = qkv.reshape(-1, e)  # [R * (H + 2K), E]: token t's head j is row t * nh + j
        srcs = (flat, flat, flat)
        offs = ((nh, 0), (nh, q_heads), (nh, q_heads + kh))
    dtype = srcs[0].dtype
    stored = k_cache.dtype
    if stored == jnp.uint16:  # the CPU's storage of a 16-bit cache (jdet/kv_cache.py)
        k_cache, v_cache = as_float(k_cache, dtype), as_float(v_cache, dtype)
    slots = num_pages * page_size
    lay = _Layout(t, q_heads, kh, e, g_pad, block_q, slots, n_layers * kh * slots, *offs)
    kc = k_cache.reshape(-1, e)  # flat rows [L * K * P * B, E]: a view, no copy
    vc = v_cache.reshape(-1, e)

    def whole(x):
        return pl.BlockSpec(x.shape, lambda i, k: (0,) * x.ndim)

    interpret = _platform.interpret_default()
    params = None
    if not interpret:
        params = pltriton.CompilerParams(num_warps=num_warps, num_stages=1)
    lay_arg = jnp.asarray(layer, jnp.int32).reshape(1)
    slots = slot_mapping.astype(jnp.int32)
    operands = (lay_arg, slots, tok_c.astype(jnp.int32), *srcs, cos, sin, kc, vc)
    tok_spec = pl.BlockSpec((None, block_q), lambda i, k: (i, 0))
    in_specs = [whole(lay_arg), whole(slots), tok_spec, *(whole(s) for s in srcs), whole(cos),
                whole(sin), whole(kc), whole(vc)]  # fmt: skip
    q_tiles, kc, vc = pl.pallas_call(
        functools.partial(_kernel, lay=lay),
        grid=(nt, kh),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, None, rows, e), lambda i, k: (i, k, 0, 0)),
            whole(kc),
            whole(vc),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((nt, kh, rows, e), dtype),
            jax.ShapeDtypeStruct(kc.shape, kc.dtype),
            jax.ShapeDtypeStruct(vc.shape, vc.dtype),
        ],
        input_output_aliases={len(operands) - 2: 1, len(operands) - 1: 2},
        interpret=interpret,
        compiler_params=params,
        name=f"rope_kv_r{rows}_e{e}",
    )(*operands)
    kc, vc = kc.reshape(k_cache.shape), vc.reshape(v_cache.shape)
    if stored == jnp.uint16:
        kc, vc = lax.bitcast_convert_type(kc, stored), lax.bitcast_convert_type(vc, stored)
    return q_tiles, kc, vc


def rope_kv_reference(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    tok_c: jax.Array,
    *,
    layer: jax.Array,
    rows: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure jnp: (query tiles [NT, K, rows, E], k_cache, v_cache) from q[T, H, E], k, v[T, K, E]
    as XLA computes them (apply_rope's expression, write_kv's scatter, the attention's gather +
    transpose + pad). Float caches only."""
    t, h, e = q.shape
    n_layers, kh, num_pages, page_size, _ = k_cache.shape
    half = e // 2

    def rope(x):
        xf = x.astype(jnp.float32)
        rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
        return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)

    qr, kr = rope(q), rope(k)
    valid = slot_mapping >= 0
    page = jnp.where(valid, slot_mapping // page_size, num_pages)
    off = jnp.where(valid, slot_mapping % page_size, 0)
    k_cache = k_cache.at[layer, :, page, off, :].set(kr.astype(k_cache.dtype), mode="drop")
    v_cache = v_cache.at[layer, :, page, off, :].set(v.astype(v_cache.dtype), mode="drop")
    nt, block_q = tok_c.shape
    g, gp = h // kh, rows // block_q
    qg = jnp.pad(qr.reshape(t, kh, g, e), ((0, 0), (0, 0), (0, gp - g), (0, 0)))
    tiles = qg[tok_c].transpose(0, 2, 1, 3, 4).reshape(nt, kh, rows, e)
    return tiles, k_cache, v_cache
