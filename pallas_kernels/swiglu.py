"""The MLP's gate|up projection with SwiGLU in the matmul's epilogue (Hopper, Mosaic GPU).

Why: a decode layer ran the fused gate|up product (writing [rows, 2F] bf16) and then one XLA
fusion for silu(gate) * up (reading it back, writing [rows, F]): one more launch a layer,
launch-bound at batch 1, and the 2F-wide intermediate. Here each work item of the BIO kernel
(matmul_mosaic.py `_kernel`, `swiglu=True`) accumulates its n tile of gate and the same n tile
of up side by side and writes silu(gate) * up.

Reduction plan: that of `matmul` (BIO) for each gate and up column: the same wgmma K steps in
increasing K into an f32 accumulator, whichever CTA shape (a function of M <= 64 or not) holds
it. Then per element, no reduction: g, u rounded to the output dtype (as the unfused product
is), silu(g) * u in f32 with sigmoid = 1 / (1 + exp(-g)), rounded once (`swiglu_epilogue`).
The exp is the Mosaic lowering's, not XLA's, so the bits differ from the unfused path's in
the last place; they are a function of the element's inputs only, so row i is the same for any
M (tests/pallas_kernels/test_swiglu.py, GPU). Used for every M or for none: whether it runs
depends on the weight's shape, the backend and `SWIGLU_EPILOGUE`, never on the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.decode_tiles import DEFAULT_TILES, DecodeTiles
from pallas_kernels.matmul import resolve_backend

# 1: the gate|up projection ends in SwiGLU on Hopper (a plan choice: 0 gives other bits).
SWIGLU_EPILOGUE = 1


def supported(k: int, two_f: int, dtype) -> bool:
    """Whether `matmul_swiglu` runs for a [K, 2F] gate|up weight of `dtype` (shapes only)."""
    if not SWIGLU_EPILOGUE or resolve_backend(None) != "mosaic":
        return False
    return jnp.dtype(dtype).itemsize == 2 and k % 64 == 0 and two_f % 256 == 0


def swiglu_config(m: int, out_dtype, tiles: DecodeTiles = DEFAULT_TILES):
    """CTA plan: the decode CTA (64 rows, one warpgroup, 64 output columns) at M <= 64; else
    128 rows, two warpgroups of 64 output columns side by side. Stages fill SMEM with one A
    and two B (gate, up) tiles each."""
    from pallas_kernels import matmul_mosaic as mm  # slow Mosaic GPU import: Hopper only

    if mm.decode_rows(m, tiles):
        cfg = mm.decode_config(out_dtype, cta_n=64, tiles=tiles)
    else:
        cfg = mm.MosaicConfig(tile_m=mm.BLOCK_M, tile_n=64, tile_k=mm.BLOCK_K,
                              max_concurrent_steps=0)  # fmt: skip
    stages = mm._stages(cfg.cta_m, 2 * cfg.cta_n, cfg.tile_m, cfg.tile_n, out_dtype,
                        cfg.num_wgs, cfg.tile_k)  # fmt: skip
    return dataclasses.replace(cfg, max_concurrent_steps=stages)


def matmul_swiglu(h: jax.Array, w: jax.Array, out_dtype=None,
                  tiles: DecodeTiles = DEFAULT_TILES) -> jax.Array:  # fmt: skip
    """silu(h @ w[:, :F]) * (h @ w[:, F:]) for w = [gate | up] [K, 2F]: [M, F] in out_dtype
    (default h's). Call only where `supported(K, 2F, dtype)`."""
    from pallas_kernels import matmul_mosaic as mm  # slow Mosaic GPU import: Hopper only

    m, k = h.shape
    if w.ndim != 2 or w.shape[0] != k or not supported(k, w.shape[1], w.dtype):
        raise ValueError(f"matmul_swiglu: unsupported h{h.shape} @ w{w.shape} ({w.dtype}) here")
    out_dtype = jnp.dtype(out_dtype or h.dtype)
    cfg = swiglu_config(m, out_dtype, tiles)
    return mm._leaf_products(h.astype(w.dtype), w, out_dtype, 1, cfg, swiglu=True)[0, :m]


def swiglu_reference(h: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
    """XLA: the f32-accumulated product rounded to out_dtype, then jdet/model.py's SwiGLU."""
    out_dtype = jnp.dtype(out_dtype or h.dtype)
    gu = jnp.dot(h, w, preferred_element_type=jnp.float32).astype(out_dtype)
    gate, up = jnp.split(gu, 2, axis=-1)
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(out_dtype)
