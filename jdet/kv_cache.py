"""The paged KV cache as pure arrays: k, v of shape [L, K, P, B, E] (layers, kv heads, pages,
page size, head dim). kv-head major so one (head, page) block is contiguous and tensor parallelism
shards axis 1. The cache is donated to the step function and updated in place by XLA.

On a CPU a 16-bit float cache is *stored* as uint16 (the same bits; `storage_dtype`): XLA CPU has
no bf16 scatter or gather and converts the whole stacked cache to f32 and back around each one;
bitcasting the bf16 cache to uint16 inside the step avoided that, but each bitcast of the pool is
itself a copy of the whole pool (4 per layer per step: most of a decode step, growing with the
pool). Stored as uint16, only the written rows and the gathered pages
are ever bitcast. Readers take the float type from the query (`kv_compute_dtype`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdet.config import ModelConfig
from jdet.plan import backend
from pallas_kernels._platform import as_float, kv_compute_dtype  # noqa: F401 (the readers' side)


def init_kv_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: Any = jnp.bfloat16,
    num_kv_heads: int | None = None,
) -> dict[str, jax.Array]:
    """Zero-filled k and v [L, K, P, B, E] of `dtype`, held as `storage_dtype(dtype)`."""
    K = num_kv_heads or cfg.num_kv_heads
    shape = (cfg.num_layers, K, num_pages, page_size, cfg.head_dim)
    dtype = storage_dtype(dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def storage_dtype(dtype: Any) -> Any:
    """How a cache of float `dtype` is held: uint16 for bf16/f16 on a CPU (module docstring)."""
    dtype = jnp.dtype(dtype)
    if backend().cpu and dtype in (jnp.bfloat16, jnp.float16):
        return jnp.dtype(jnp.uint16)
    return dtype


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def write_kv(cache: jax.Array, layer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new[T, K, E] into cache[layer, :, page, offset, :]; slot -1 rows are dropped.

    Writing is a scatter of whole rows: no arithmetic, so it cannot change any bits.
    A uint16-stored cache (CPU, module docstring) gets the rows' bits, `new` cast to its float
    type first. A bf16/f16 cache on a CPU (one not made by `init_kv_cache`) is scattered as
    uint16 too, at the cost of bitcasting the whole pool.
    """
    L, K, P, B, E = cache.shape
    valid = slots >= 0
    page = jnp.where(valid, slots // B, P)  # out of bounds -> dropped by mode="drop"
    off = jnp.where(valid, slots % B, 0)
    if cache.dtype == jnp.uint16:
        if not jnp.issubdtype(new.dtype, jnp.floating) or jnp.dtype(new.dtype).itemsize != 2:
            raise TypeError(f"a uint16-stored cache takes bf16/f16 rows, got {new.dtype}")
        new = jax.lax.bitcast_convert_type(new, jnp.uint16)
        return cache.at[layer, :, page, off, :].set(new, mode="drop")
    dtype = cache.dtype
    new = new.astype(dtype)
    as_bits = backend().cpu and dtype in (jnp.bfloat16, jnp.float16)
    if as_bits:
        cache = jax.lax.bitcast_convert_type(cache, jnp.uint16)
        new = jax.lax.bitcast_convert_type(new, jnp.uint16)
    # Mixed advanced indices around a slice put the token axis first: the update is [T, K, E].
    out = cache.at[layer, :, page, off, :].set(new, mode="drop")
    return jax.lax.bitcast_convert_type(out, dtype) if as_bits else out
