"""Batch-invariant RMSNorm: y = w * (x * rsqrt(mean(x^2) + eps)), one row per program.

Reduction plan: each program owns one row. It walks the hidden dim in fixed blocks of block_d
lanes (block_d a function of D only: D rounded up to a power of two, at most MAX_BLOCK_D),
accumulating x^2 lane-wise in f32, then sums the block_d lanes with one fixed-shape reduction
over `warps_for(block_d)` warps (a function of D only too). A row of at most MAX_BLOCK_D lanes is
one block, held in registers between the sum and the output. Nothing depends on the number of
rows T, so row i is bitwise the same for any T. Rounding follows Hugging Face (Llama/Qwen): the
normalised row is rounded to x.dtype before the multiply by the weight, which is done in x.dtype.

One kernel for every GPU: Triton (RMSNorm is memory-bound; a row per program already streams at
copy speed, so Hopper needs no Mosaic version). On a CPU `xla_fixed.rms_norm` (a halving tree
over D), or this kernel in interpret mode with JDET_PALLAS_INTERPRET=1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform, xla_fixed
from pallas_kernels.combine import combine_tree


def _load(ref, mask, other):
    """Masked load where the block is ragged; a plain load (Triton rejects `other` without a
    mask) where it is not."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    if mask is None:
        return pltriton.load(ref)
    return pltriton.load(ref, mask=mask, other=other)


# The widest block of lanes a program loads at once. Rows up to this wide are one block: loaded
# once, squared and summed by one fixed-shape reduction, normalised from registers. Why 8192 and
# not the former 1024: a 4096-wide row (8B models) took 4 dependent load steps per pass and two
# passes (the second re-reading x and, in add_rms_norm, every f32 part), a chain of ~8 memory
# latencies in a one-row program (add_rms_norm runs twice a layer; its time a call: BENCHMARKS.md,
# where the 8B step goes). A plan choice: 1024 restores the former bits for D > 1024 (D <= 1024
# is unchanged).
MAX_BLOCK_D = 8192


def block_d_for(d: int) -> int:
    """Lanes per step over the hidden dim: a function of D only."""
    return min(1 << max(0, (d - 1).bit_length()), MAX_BLOCK_D)


def warps_for(block_d: int) -> int:
    """Triton warps of a norm program (a function of D only, through block_d: the lanes' sum is
    reduced across them, so the warp count is part of the reduction plan): 4 up to 1024 lanes
    (the former plan), 8 above (a 4096-lane row and G f32 parts held in registers)."""
    return 4 if block_d <= 1024 else 8


def _compiler_params(block_d: int, interpret: bool):
    """The Triton launch of every norm kernel here (None in interpret mode): `warps_for(block_d)`
    warps, one stage; one place, since the warp count is part of the reduction plan."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    if interpret:
        return None
    return pltriton.CompilerParams(num_warps=warps_for(block_d), num_stages=1)


def _rms_kernel(*refs, eps: float, block_d: int, stacked: bool, heads: tuple[int, int] = (0, 0)):
    """One row. With `stacked`, w_ref is the flat [L*D] stack of every layer's weight and the
    first operand holds the layer: reading the layer's slice here saves the scan a copy (a
    launch) per norm per layer. With `heads` = (H, K) (`head_rms_norm`), there are two weight
    stacks, q's and k's, and row i takes q's where i % (H + K) < H: the same arithmetic."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    q_heads, kv_heads = heads
    if q_heads:
        layer_ref, x_ref, w_ref, wk_ref, o_ref = refs
    elif stacked:
        layer_ref, x_ref, w_ref, o_ref = refs
    else:
        x_ref, w_ref, o_ref = refs
    d = x_ref.shape[0]
    w_off = layer_ref[0] * d if stacked else 0
    is_q = pl.program_id(0) % (q_heads + kv_heads) < q_heads if q_heads else None
    steps = pl.cdiv(d, block_d)
    ragged = d % block_d != 0

    def lanes(i):
        idx = i * block_d + jnp.arange(block_d)
        return idx, (idx < d) if ragged else None

    def sq_body(i, acc):
        idx, mask = lanes(i)
        x = _load(x_ref.at[idx], mask, 0.0).astype(jnp.float32)
        return acc + x * x

    def out_block(i, x, inv):
        idx, mask = lanes(i)
        w = _load(w_ref.at[idx + w_off], mask, 0.0).astype(o_ref.dtype)
        if q_heads:
            wk = _load(wk_ref.at[idx + w_off], mask, 0.0).astype(o_ref.dtype)
            w = jnp.where(is_q, w, wk)
        normed = (x * inv).astype(o_ref.dtype)
        # The product of two 16-bit floats is exact in f32, so rounding it once to x.dtype is
        # bitwise a native x.dtype multiply (HF's `weight * hidden.to(dtype)`), on every backend.
        y = (w.astype(jnp.float32) * normed.astype(jnp.float32)).astype(o_ref.dtype)
        pltriton.store(o_ref.at[idx], y, mask=mask)

    if steps == 1:  # one block: the row stays in registers (0 + x*x == x*x: the loop's bits)
        idx, mask = lanes(0)
        x = _load(x_ref.at[idx], mask, 0.0).astype(jnp.float32)
        out_block(0, x, 1.0 / jnp.sqrt(jnp.sum(x * x) / d + eps))
        return
    ss = lax.fori_loop(0, steps, sq_body, jnp.zeros((block_d,), jnp.float32))
    inv = 1.0 / jnp.sqrt(jnp.sum(ss) / d + eps)

    def out_body(i, carry):
        idx, mask = lanes(i)
        out_block(i, _load(x_ref.at[idx], mask, 0.0).astype(jnp.float32), inv)
        return carry

    lax.fori_loop(0, steps, out_body, 0)


def rms_norm(
    x: jax.Array,
    w: jax.Array,
    eps: float = 1e-6,
    *,
    layer: jax.Array | None = None,
    backend: str | None = None,
) -> jax.Array:
    """RMSNorm of x[T, D] with weight w[D]; f32 statistics, output in x.dtype, batch invariant.

    With `layer` (an int32 scalar), w is the stack [L, D] of every layer's weight and layer
    `layer`'s row is used: the kernel reads it in place (same bits as passing `w[layer]`).
    `backend`: 'auto' (this kernel; `xla_fixed.rms_norm` on a CPU unless JDET_PALLAS_INTERPRET=1),
    'pallas' or 'xla'."""
    stacked = layer is not None
    w_row = w.shape[1:] if stacked else w.shape
    if x.ndim != 2 or w_row != (x.shape[1],) or (stacked and w.ndim != 2):
        want = "w[L, D] with `layer`" if stacked else "w[D]"
        raise ValueError(f"rms_norm expects x[T, D] and {want}; got {x.shape} and {w.shape}")
    if _platform.resolve(backend, "rms_norm") == "xla":
        return xla_fixed.rms_norm(x, w[layer] if stacked else w, float(eps))
    if stacked:
        return _rms_norm_pallas(x, w.reshape(-1), float(eps), jnp.asarray(layer, jnp.int32))
    return _rms_norm_pallas(x, w, float(eps))


@functools.partial(jax.jit, static_argnames=("eps",))
def _rms_norm_pallas(
    x: jax.Array, w: jax.Array, eps: float, layer: jax.Array | None = None
) -> jax.Array:
    t, d = x.shape
    block_d = block_d_for(d)
    interpret = _platform.interpret_default()
    params = _compiler_params(block_d, interpret)
    stacked = layer is not None
    operands = [x, w]
    in_specs = [
        pl.BlockSpec((None, d), lambda i: (i, 0)),
        pl.BlockSpec(w.shape, lambda i: (0,)),
    ]
    if stacked:
        operands.insert(0, layer.reshape(1))
        in_specs.insert(0, pl.BlockSpec((1,), lambda i: (0,)))
    return pl.pallas_call(
        functools.partial(_rms_kernel, eps=float(eps), block_d=block_d, stacked=stacked),
        out_shape=jax.ShapeDtypeStruct((t, d), x.dtype),
        grid=(t,),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, d), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=params,
        name="bi_rms_norm",
    )(*operands)


def head_rms_norm(
    qkv: jax.Array, q_w: jax.Array, k_w: jax.Array, eps: float, *, layer: jax.Array, tokens: int,
    q_heads: int, kv_heads: int,
) -> jax.Array:  # fmt: skip
    """RMSNorm of every q and k head of the first `tokens` rows of the fused projection
    qkv[R >= T, (H + 2K) * E], read where they are: out[T * (H + K), E], token t's head j (q
    heads, then k heads) in row t * (H + K) + j, normalised with q_w[layer] (j < H) or
    k_w[layer] (the stacks [L, E]).

    Why: Qwen3's q/k head norms ran as three slices of the projection's rows (q, k, v: XLA
    copies) and two norm launches per layer, launch-bound at batch 1; this is
    one launch, and `rope_kv` then reads v from the projection's rows directly. Bits: each row
    is `rms_norm`'s program (same block_d, same warps, same rounding points) on the same values
    with the same weight row, so the result equals `rms_norm(q.reshape(-1, E), q_w, layer=...)`
    and k's bitwise (tests/pallas_kernels/test_rms_norm.py). GPU and interpret mode only."""
    nh = q_heads + 2 * kv_heads
    e = q_w.shape[-1]
    if (qkv.ndim != 2 or qkv.shape[0] < tokens or qkv.shape[1] != nh * e or q_w.ndim != 2
            or k_w.shape != q_w.shape):  # fmt: skip
        raise ValueError(
            f"head_rms_norm expects qkv[R >= {tokens}, (H + 2K) * E = {nh * e}] and q/k weight "
            f"stacks [L, E]; got {qkv.shape}, {q_w.shape}, {k_w.shape}"
        )
    flat = qkv.reshape(-1, e)
    return _head_rms_norm_pallas(
        flat, q_w.reshape(-1), k_w.reshape(-1), float(eps), jnp.asarray(layer, jnp.int32),
        tokens=tokens, q_heads=q_heads, kv_heads=kv_heads,
    )  # fmt: skip


@functools.partial(jax.jit, static_argnames=("eps", "tokens", "q_heads", "kv_heads"))
def _head_rms_norm_pallas(flat, q_w, k_w, eps: float, layer, *, tokens: int, q_heads: int,
                          kv_heads: int):  # fmt: skip
    e = flat.shape[1]
    nh = q_heads + 2 * kv_heads
    per = q_heads + kv_heads
    interpret = _platform.interpret_default()
    params = _compiler_params(block_d_for(e), interpret)
    kernel = functools.partial(
        _rms_kernel, eps=eps, block_d=block_d_for(e), stacked=True, heads=(q_heads, kv_heads)
    )
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((tokens * per, e), flat.dtype),
        grid=(tokens * per,),
        in_specs=[
            pl.BlockSpec((1,), lambda i: (0,)),
            pl.BlockSpec((None, e), lambda i: ((i // per) * nh + i % per, 0)),
            pl.BlockSpec(q_w.shape, lambda i: (0,)),
            pl.BlockSpec(k_w.shape, lambda i: (0,)),
        ],
        out_specs=pl.BlockSpec((None, e), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=params,
        name="bi_head_rms_norm",
    )(layer.reshape(1), flat, q_w, k_w)


def _add_rms_kernel(layer_ref, x_ref, p_ref, w_ref, r_ref, o_ref, *, eps: float, block_d: int,
                    groups: int, rows: int):  # fmt: skip
    """One row of add_rms_norm: r = x + combine_tree(parts) (cast to x.dtype first, as
    tree_matmul does), then `_rms_kernel`'s arithmetic on r. p_ref is the flat [G*T*D] parts
    array (indexed like the stacked weight: the proven way to address a slice in place)."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    d = x_ref.shape[0]
    row = pl.program_id(0)
    w_off = layer_ref[0] * d
    steps = pl.cdiv(d, block_d)
    ragged = d % block_d != 0

    def resid(i):
        idx = i * block_d + jnp.arange(block_d)
        mask = (idx < d) if ragged else None
        x = _load(x_ref.at[idx], mask, 0.0)
        parts = [_load(p_ref.at[(g * rows + row) * d + idx], mask, 0.0) for g in range(groups)]
        o = combine_tree(parts).astype(x.dtype)
        r = (x.astype(jnp.float32) + o.astype(jnp.float32)).astype(x.dtype)
        return idx, mask, r

    def out_block(idx, mask, r, inv):
        w = _load(w_ref.at[idx + w_off], mask, 0.0).astype(o_ref.dtype)
        normed = (r.astype(jnp.float32) * inv).astype(o_ref.dtype)
        y = (w.astype(jnp.float32) * normed.astype(jnp.float32)).astype(o_ref.dtype)
        pltriton.store(o_ref.at[idx], y, mask=mask)

    if steps == 1:  # one block: r stays in registers (0 + r*r == r*r: the loop's bits)
        idx, mask, r = resid(0)
        pltriton.store(r_ref.at[idx], r, mask=mask)
        rf = r.astype(jnp.float32)
        out_block(idx, mask, r, 1.0 / jnp.sqrt(jnp.sum(rf * rf) / d + eps))
        return

    def sq_body(i, acc):
        idx, mask, r = resid(i)
        pltriton.store(r_ref.at[idx], r, mask=mask)
        rf = r.astype(jnp.float32)
        return acc + rf * rf

    ss = lax.fori_loop(0, steps, sq_body, jnp.zeros((block_d,), jnp.float32))
    inv = 1.0 / jnp.sqrt(jnp.sum(ss) / d + eps)

    def out_body(i, carry):
        out_block(*resid(i), inv)  # recomputed (same bits), not re-read from r_ref
        return carry

    lax.fori_loop(0, steps, out_body, 0)


def add_rms_norm(
    x: jax.Array, parts: jax.Array, w: jax.Array, eps: float, *, layer: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(r, rms_norm(r, w[layer])) with r = x + combine_tree(list(parts)).astype(x.dtype): the
    row-parallel projection's combine, the residual add and the next RMSNorm in one launch.

    Why: after o_proj the decode step ran the tree combine + residual add as one XLA fusion and
    then the norm kernel, two launch-bound launches for a few KB; this is one. Bits: the combine is
    the same f32 additions in the same order (combine_tree), r is rounded to x.dtype as XLA's
    add is, and the norm is `rms_norm`'s reduction plan (same block_d, same warps), so r and the
    normed rows equal the three-step path's bitwise (tests/jdet/test_step_fusion.py: in
    interpret mode on a CPU, compiled on the GPU). x[T, D], parts f32[G, T, D], w the stack [L, D].
    GPU and interpret mode only (the CPU path keeps the unfused ops)."""
    t, d = x.shape
    if parts.ndim != 3 or parts.shape[1:] != (t, d) or w.ndim != 2 or w.shape[1] != d:
        raise ValueError(
            f"add_rms_norm expects x[T, D], parts[G, T, D], w[L, D]; got {x.shape}, "
            f"{parts.shape}, {w.shape}"
        )
    return _add_rms_norm_pallas(x, parts, w.reshape(-1), float(eps), jnp.asarray(layer, jnp.int32))


@functools.partial(jax.jit, static_argnames=("eps",))
def _add_rms_norm_pallas(x, parts, w, eps: float, layer):
    t, d = x.shape
    groups = parts.shape[0]
    interpret = _platform.interpret_default()
    params = _compiler_params(block_d_for(d), interpret)
    row = pl.BlockSpec((None, d), lambda i: (i, 0))
    flat = parts.reshape(-1)
    kernel = functools.partial(
        _add_rms_kernel, eps=eps, block_d=block_d_for(d), groups=groups, rows=t
    )
    return pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((t, d), x.dtype), jax.ShapeDtypeStruct((t, d), x.dtype)),
        grid=(t,),
        in_specs=[
            pl.BlockSpec((1,), lambda i: (0,)),
            row,
            pl.BlockSpec(flat.shape, lambda i: (0,)),
            pl.BlockSpec(w.shape, lambda i: (0,)),
        ],
        out_specs=(row, row),
        interpret=interpret,
        compiler_params=params,
        name="bi_add_rms_norm",
    )(layer.reshape(1), x, flat, w)


def rms_norm_reference(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """Plain jnp RMSNorm with the same rounding points (XLA's reduction order, not invariant)."""
    x32 = x.astype(jnp.float32)
    inv = 1.0 / jnp.sqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return w.astype(x.dtype) * (x32 * inv).astype(x.dtype)
