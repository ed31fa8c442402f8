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

from pallas_kernels import _platform, xla_fixed


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


def contraction_by_shape_measured() -> bool:
    """Whether XLA CPU here is one whose FMA contractions by program shape were observed
    (sessions 10-12: jaxlib 0.10 on x86-64 with AVX2): the controls that show the compiler
    contracting (plain RoPE, plain f32 squares) assert it there. JAX 0.11.2 on an AVX-512 Xeon
    did not contract those programs (session 16), so elsewhere the controls assert
    `contracted_*` below, which contract by construction. The same XLA and CPU as the small
    row blocks were measured on."""
    return _platform.small_row_blocks_verified_here()


def _split12(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """f32 x = hi + lo, hi its 12 leading significant bits, lo the exact rest (<= 12 bits)."""
    hi = xla_fixed.hi12(x)
    return hi, x - hi


def _parts(a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """a*b (f32) as three terms: ah*bh exact, the two cross products summed, al*bl exact."""
    ah, al = _split12(a.astype(jnp.float32))
    bh, bl = _split12(b.astype(jnp.float32))
    return ah * bh, ah * bl + al * bh, al * bl


def product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a*b rounded (up to a last-bit double rounding) from exact partial products: an operand
    that no contraction can change, since it is no multiply (a plain product beside another
    one in an add is what LLVM may fuse either way)."""
    hh, cross, ll = _parts(a, b)
    return (hh + cross) + ll


def contracted(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """a*b + c (f32) with the product's exact parts added to c one at a time: the rounding of a
    fused multiply-add (the product is not rounded before c joins it), up to the last bit. With
    c from `product` (no multiply), every product here is exact and is the only product in its
    add, so no contraction XLA forms can change it: a contraction by construction."""
    hh, cross, ll = _parts(a, b)
    return ((hh + c) + cross) + ll


def contracted_rope_by_rows(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """jdet/ops.py `apply_rope` with the contraction chosen by the step's rows, as LLVM's
    was (pallas_kernels/xla_fixed.py, "FMA contraction"): x*cos fused into the add in a step of
    fewer than 8 rows, rot*sin in one of 8 or more."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    c = jnp.broadcast_to(cos[:, None, :], xf.shape)
    s = jnp.broadcast_to(sin[:, None, :], xf.shape)
    if x.shape[0] < 8:
        out = contracted(xf, c, product(rot, s))
    else:
        out = contracted(rot, s, product(xf, c))
    return out.astype(x.dtype)


def contracted_sum_squares(x: jax.Array) -> jax.Array:
    """`xla_fixed.sum_squares` of f32 x with one square contracted into each add of the tree's
    first level (square + square): what LLVM made of the plain f32 squares on the CI machine,
    here by construction."""
    x = x.astype(jnp.float32)
    x = xla_fixed._pad_axis(x, -1, xla_fixed._next_pow2(x.shape[-1]))
    h = x.shape[-1] // 2
    left, right = x[..., :h], x[..., h:]
    return xla_fixed.tree_sum(contracted(left, left, product(right, right)))
