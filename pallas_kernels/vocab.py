"""Batch-invariant reductions over the vocabulary: logsumexp and log_softmax.

Reduction plan (log_softmax / logsumexp): one row per program. Pass 1 takes the row max (max is
exact in any order). Pass 2 walks V in fixed blocks of BLOCK_V lanes, accumulating exp(x - max)
lane-wise in f32, then sums the BLOCK_V lanes with one fixed-shape reduction; lse = max + log(sum).
Pass 3 (log_softmax) writes x - lse. BLOCK_V is a constant and nothing depends on the number of
rows N, so row i is bitwise the same for any N (XLA's own row reductions are not: on an H100
`sum(x*x, -1)` of row 0 changes between B=2 and B=7). On a CPU `xla_fixed` runs instead (the sum
as a halving tree over V), or these kernels in interpret mode with JDET_PALLAS_INTERPRET=1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels import _platform


def _load(ref, mask, other):
    """Masked load where the block is ragged; a plain load (Triton rejects `other` without a
    mask) where it is not."""
    if mask is None:
        return pltriton.load(ref)
    return pltriton.load(ref, mask=mask, other=other)


BLOCK_V = 2048


def _row_lse(x_ref, block_v: int):
    v = x_ref.shape[0]
    steps = pl.cdiv(v, block_v)
    ragged = v % block_v != 0

    def load(i):
        idx = i * block_v + jnp.arange(block_v)
        mask = (idx < v) if ragged else None
        x = _load(x_ref.at[idx], mask, -jnp.inf)
        return x.astype(jnp.float32)

    def max_body(i, m):
        return jnp.maximum(m, load(i))

    m = jnp.max(lax.fori_loop(0, steps, max_body, jnp.full((block_v,), -jnp.inf, jnp.float32)))

    def sum_body(i, s):
        return s + jnp.exp(load(i) - m)

    s = jnp.sum(lax.fori_loop(0, steps, sum_body, jnp.zeros((block_v,), jnp.float32)))
    return m + jnp.log(s)


def _lse_kernel(x_ref, o_ref, *, block_v: int):
    o_ref[...] = jnp.full(o_ref.shape, _row_lse(x_ref, block_v), jnp.float32)


def _log_softmax_kernel(x_ref, o_ref, *, block_v: int):
    lse = _row_lse(x_ref, block_v)
    v = x_ref.shape[0]
    ragged = v % block_v != 0

    def body(i, carry):
        idx = i * block_v + jnp.arange(block_v)
        mask = (idx < v) if ragged else None
        x = _load(x_ref.at[idx], mask, 0.0).astype(jnp.float32)
        pltriton.store(o_ref.at[idx], x - lse, mask=mask)
        return carry

    lax.fori_loop(0, pl.cdiv(v, block_v), body, 0)


def _row_call(kernel, x: jax.Array, out_cols: int | None, name: str) -> jax.Array:
    if x.ndim != 2:
        raise ValueError(f"{name} expects logits x[N, V]; got shape {x.shape}")
    n, v = x.shape
    interpret = _platform.interpret_default()
    params = None if interpret else pltriton.CompilerParams(num_warps=8, num_stages=1)
    if out_cols is None:  # one f32 per row, stored as an [N, 1] block
        out_shape = jax.ShapeDtypeStruct((n, 1), jnp.float32)
        out_spec = pl.BlockSpec((1, 1), lambda i: (i, 0))
    else:
        out_shape = jax.ShapeDtypeStruct((n, v), jnp.float32)
        out_spec = pl.BlockSpec((None, v), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(kernel, block_v=BLOCK_V),
        out_shape=out_shape,
        grid=(n,),
        in_specs=[pl.BlockSpec((None, v), lambda i: (i, 0))],
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=params,
        name=name,
    )(x)


@jax.jit
def _logsumexp_pallas(x: jax.Array) -> jax.Array:
    return _row_call(_lse_kernel, x, None, "bi_logsumexp")[:, 0]


@jax.jit
def _log_softmax_pallas(x: jax.Array) -> jax.Array:
    return _row_call(_log_softmax_kernel, x, x.shape[1], "bi_log_softmax")


def _use_xla(x: jax.Array, backend: str | None, name: str) -> bool:
    if x.ndim != 2:
        raise ValueError(f"{name} expects logits x[N, V]; got shape {x.shape}")
    return _platform.resolve(backend, name) == "xla"


def logsumexp(x: jax.Array, *, backend: str | None = None) -> jax.Array:
    """Row-wise logsumexp of x[N, V] in f32, batch invariant. `backend`: 'auto' (this kernel;
    `xla_fixed` on a CPU unless JDET_PALLAS_INTERPRET=1), 'pallas' or 'xla'."""
    if _use_xla(x, backend, "logsumexp"):
        from pallas_kernels import xla_fixed

        return xla_fixed.logsumexp(x)
    return _logsumexp_pallas(x)


def log_softmax(x: jax.Array, *, backend: str | None = None) -> jax.Array:
    """Row-wise log_softmax of x[N, V] in f32, batch invariant. `backend` as in `logsumexp`."""
    if _use_xla(x, backend, "log_softmax"):
        from pallas_kernels import xla_fixed

        return xla_fixed.log_softmax(x)
    return _log_softmax_pallas(x)


def logsumexp_reference(x: jax.Array) -> jax.Array:
    """XLA's logsumexp in f32 (not batch invariant on GPUs)."""
    return jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)


def log_softmax_reference(x: jax.Array) -> jax.Array:
    """XLA's log_softmax in f32 (not batch invariant on GPUs)."""
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
