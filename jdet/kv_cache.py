"""The paged KV cache as pure arrays: k, v of shape [L, K, P, B, E] (layers, kv heads, pages,
page size, head dim). kv-head major so one (head, page) block is contiguous and tensor parallelism
shards axis 1. The cache is donated to the step function and updated in place by XLA.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdet.config import ModelConfig


def init_kv_cache(
    cfg: ModelConfig,
    num_pages: int,
    page_size: int,
    dtype: Any = jnp.bfloat16,
    num_kv_heads: int | None = None,
) -> dict[str, jax.Array]:
    K = num_kv_heads or cfg.num_kv_heads
    shape = (cfg.num_layers, K, num_pages, page_size, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def kv_bytes_per_token(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def write_kv(cache: jax.Array, layer: jax.Array, new: jax.Array, slots: jax.Array) -> jax.Array:
    """Scatter new[T, K, E] into cache[layer, :, page, offset, :]; slot -1 rows are dropped.

    Writing is a scatter of whole rows: no arithmetic, so it cannot change any bits.
    On a CPU a 16-bit float cache is scattered as uint16 (bitcasts, the same bits): XLA CPU has no
    bf16 scatter and otherwise converts the *whole* stacked cache to f32 and back around the
    scatter, in every layer of every step — measured on the embedded model, a 4096-page pool made
    every step ~10x slower than a 128-page one.
    """
    L, K, P, B, E = cache.shape
    valid = slots >= 0
    page = jnp.where(valid, slots // B, P)  # out of bounds -> dropped by mode="drop"
    off = jnp.where(valid, slots % B, 0)
    dtype = cache.dtype
    new = new.astype(dtype)
    as_bits = jax.default_backend() == "cpu" and dtype in (jnp.bfloat16, jnp.float16)
    if as_bits:
        cache = jax.lax.bitcast_convert_type(cache, jnp.uint16)
        new = jax.lax.bitcast_convert_type(new, jnp.uint16)
    # Mixed advanced indices around a slice put the token axis first: the update is [T, K, E].
    out = cache.at[layer, :, page, off, :].set(new, mode="drop")
    return jax.lax.bitcast_convert_type(out, dtype) if as_bits else out
