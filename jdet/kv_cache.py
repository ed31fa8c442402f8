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

import contextlib
from collections.abc import Callable
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
    shape = kv_shape(cfg, num_pages, page_size, num_kv_heads)
    dtype = storage_dtype(dtype)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def kv_shape(
    cfg: ModelConfig, num_pages: int, page_size: int, num_kv_heads: int | None = None
) -> tuple[int, int, int, int, int]:
    """[L, K, P, B, E] of one half (k or v) of a pool of `num_pages` pages."""
    return (cfg.num_layers, num_kv_heads or cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


def make_halves(make: Callable[[], jax.Array]) -> dict[str, jax.Array]:
    """The pool's k and v, each from its own `make()` and waited for before the next.

    Why not one program with two outputs: a pool is sized to what the device has free, so its
    allocation may fail. Made one at a time, a failure is always of one whole array: the half
    made before it is deleted here, at once, and the error leaves nothing allocated behind it
    (serving/engine/memory.py `allocate_to_fit` then tries a smaller pool)."""
    made: dict[str, jax.Array] = {}
    try:
        for name in ("k", "v"):
            made[name] = make()
            made[name].block_until_ready()
    except Exception:
        for a in made.values():
            with contextlib.suppress(Exception):
                a.delete()
        made.clear()
        raise
    return made


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
