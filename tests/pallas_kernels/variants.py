"""Test-only reductions whose order provably depends on the batch: the negative controls' variants.

Where XLA's own op happens to be batch invariant on this backend at the tested sizes, a control
built on it could only skip; these variants change their order with M (or the row count) by
construction, so the controls always show that a bitwise row comparison detects a batch-dependent
reduction order.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import xla_fixed


def split_k_by_m(a: jax.Array, b: jax.Array) -> jax.Array:
    """f32 a @ b with K split into 1 part when M < 8, else 4 parts, added left to right."""
    parts = 1 if a.shape[0] < 8 else 4
    k = a.shape[1]
    bounds = [k * i // parts for i in range(parts + 1)]
    out = [
        xla_fixed.matmul(a[:, lo:hi], b[lo:hi], jnp.float32)
        for lo, hi in zip(bounds, bounds[1:], strict=False)
    ]
    return functools.reduce(lambda x, y: x + y, out)


def chunked_sum_by_rows(x: jax.Array) -> jax.Array:
    """Row sums of x (f32): a halving tree when there are fewer than 8 rows, else XLA's own
    reduction over 64-lane chunks added left to right (another order for the same row)."""
    x = x.astype(jnp.float32)
    if x.shape[0] < 8:
        return xla_fixed.tree_sum(x)
    v = x.shape[-1]
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, -v % 64)])
    chunks = jnp.sum(x.reshape(*x.shape[:-1], -1, 64), axis=-1)
    # left to right as a scan: a Python chain of V/64 adds (2374 at V = 152k) took the GPU
    # control 226 s to compile
    rest = jnp.moveaxis(chunks[..., 1:], -1, 0)
    return jax.lax.scan(lambda s, c: (s + c, None), chunks[..., 0], rest)[0]


def first_row_changes(f, x: jax.Array, sizes) -> list[int]:
    """The sizes n at which row 0 of f(x[:n]) differs bitwise from row 0 of f(x[:1])."""
    import numpy as np

    x = np.asarray(x)  # cut on the host: an eager slice of a device array compiles per n
    row0 = np.asarray(f(x[:1]))[0]
    return [n for n in sizes if not np.array_equal(np.asarray(f(x[:n]))[0], row0)]
