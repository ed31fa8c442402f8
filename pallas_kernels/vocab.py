"""Batch-invariant reductions over the vocabulary: logsumexp and log_softmax.

Reduction plan (both): V is cut into C = ceil(V / CHUNK) fixed chunks of CHUNK = 4 x BLOCK_V
lanes, C a function of V only. Pass 1, one program per (row, chunk): the chunk max m_c (max is
exact in any order) and s_c = sum of exp(x - m_c) over the chunk, accumulated lane-wise in f32 over
its 4 blocks of BLOCK_V lanes, then the BLOCK_V lanes summed by one fixed-shape reduction (s_c = 0
for a chunk of only -inf). Pass 2: M = max_c m_c, S = sum_c s_c * exp(m_c - M) as one fixed-shape
reduction over a power-of-two block of the C partials, lse = M + log(S); for log_softmax every
(row, chunk) program recomputes this lse (the same bits in each) and writes its chunk's x - lse.
Nothing depends on the number of rows N, so row i is bitwise the same for any N (XLA's own row
reductions are not: on an H100 `sum(x*x, -1)` of row 0 changes between B=2 and B=7).

Why two passes over chunks and not one program per row: a decode step has N = 1 row of 128-152k
logits, and one program walking them is latency-bound (two calls per step: the reported
log-probs and the top-p filter); C programs per row make it an order of magnitude faster
(benchmarks/profile_step.py shows a step's kernels).

On a CPU `xla_fixed` runs instead (the sum as a halving tree over V), or these kernels in
interpret mode with JDET_PALLAS_INTERPRET=1.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels import _platform, xla_fixed


def _load(ref, mask, other):
    """Masked load where the block is ragged; a plain load (Triton rejects `other` without a
    mask) where it is not."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    if mask is None:
        return pltriton.load(ref)
    return pltriton.load(ref, mask=mask, other=other)


BLOCK_V = 2048
CHUNK_BLOCKS = 4  # BLOCK_V blocks per chunk (pass 1 program)
CHUNK = BLOCK_V * CHUNK_BLOCKS


def num_chunks(v: int) -> int:
    """Chunks of a row of V logits: a function of V only."""
    return pl.cdiv(v, CHUNK)


def _chunk_lanes(x_ref, c, j, v: int, other: float):
    """Block j of chunk c as f32 lanes (masked past V), and its indices and mask."""
    idx = c * CHUNK + j * BLOCK_V + jnp.arange(BLOCK_V)
    mask = (idx < v) if v % CHUNK != 0 else None
    return _load(x_ref.at[idx], mask, other).astype(jnp.float32), idx, mask


def _partials_kernel(x_ref, m_ref, s_ref, *, v: int):
    """Pass 1 for (row, chunk c = program_id(1)): the chunk's max and exp-sum about it."""
    c = pl.program_id(1)
    lanes = [_chunk_lanes(x_ref, c, j, v, -jnp.inf)[0] for j in range(CHUNK_BLOCKS)]
    mx = lanes[0]
    for x in lanes[1:]:
        mx = jnp.maximum(mx, x)
    m = jnp.max(mx)
    safe = jnp.where(m == -jnp.inf, 0.0, m)  # a chunk of only -inf contributes s = 0
    acc = jnp.zeros((BLOCK_V,), jnp.float32)
    for x in lanes:
        acc = acc + jnp.exp(x - safe)
    m_ref[...] = jnp.full(m_ref.shape, m, jnp.float32)
    s_ref[...] = jnp.full(s_ref.shape, jnp.sum(acc), jnp.float32)


def _lse_from_partials(m_ref, s_ref, c_pad: int):
    """Pass 2's combination of one row's C partials (fixed-shape block of c_pad >= C lanes)."""
    c = m_ref.shape[0]
    idx = jnp.arange(c_pad)
    mask = (idx < c) if c_pad != c else None
    m = _load(m_ref.at[idx], mask, -jnp.inf)
    s = _load(s_ref.at[idx], mask, 0.0)
    big = jnp.max(m)
    safe = jnp.where(big == -jnp.inf, 0.0, big)
    scaled = jnp.where(m == -jnp.inf, 0.0, s * jnp.exp(m - safe))
    return big + jnp.log(jnp.sum(scaled))


def _lse_kernel(m_ref, s_ref, o_ref, *, c_pad: int):
    o_ref[...] = jnp.full(o_ref.shape, _lse_from_partials(m_ref, s_ref, c_pad), jnp.float32)


def _log_softmax_kernel(x_ref, m_ref, s_ref, o_ref, *, v: int, c_pad: int):
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    lse = _lse_from_partials(m_ref, s_ref, c_pad)
    c = pl.program_id(1)
    for j in range(CHUNK_BLOCKS):
        x, idx, mask = _chunk_lanes(x_ref, c, j, v, 0.0)
        pltriton.store(o_ref.at[idx], x - lse, mask=mask)


def _params(interpret: bool):
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    return None if interpret else pltriton.CompilerParams(num_warps=8, num_stages=1)


def _check(x: jax.Array, name: str) -> None:
    if x.ndim != 2:
        raise ValueError(f"{name} expects logits x[N, V]; got shape {x.shape}")


def _partials(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Pass 1: per-(row, chunk) max and exp-sum, each f32[N, C]."""
    n, v = x.shape
    c = num_chunks(v)
    interpret = _platform.interpret_default()
    row = pl.BlockSpec((None, v), lambda i, j: (i, 0))
    part = pl.BlockSpec((None, 1), lambda i, j: (i, j))
    shape = jax.ShapeDtypeStruct((n, c), jnp.float32)
    return pl.pallas_call(
        functools.partial(_partials_kernel, v=v),
        out_shape=(shape, shape),
        grid=(n, c),
        in_specs=[row],
        out_specs=(part, part),
        interpret=interpret,
        compiler_params=_params(interpret),
        name="bi_vocab_partials",
    )(x)


def _pow2(c: int) -> int:
    return 1 << max(0, (c - 1).bit_length())


@jax.jit
def _logsumexp_pallas(x: jax.Array) -> jax.Array:
    n, v = x.shape
    m, s = _partials(x)
    c = m.shape[1]
    interpret = _platform.interpret_default()
    parts = pl.BlockSpec((None, c), lambda i: (i, 0))
    return pl.pallas_call(
        functools.partial(_lse_kernel, c_pad=_pow2(c)),
        out_shape=jax.ShapeDtypeStruct((n, 1), jnp.float32),
        grid=(n,),
        in_specs=[parts, parts],
        out_specs=pl.BlockSpec((1, 1), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=_params(interpret),
        name="bi_logsumexp",
    )(m, s)[:, 0]


@jax.jit
def _log_softmax_pallas(x: jax.Array) -> jax.Array:
    n, v = x.shape
    m, s = _partials(x)
    c = m.shape[1]
    interpret = _platform.interpret_default()
    row = pl.BlockSpec((None, v), lambda i, j: (i, 0))
    parts = pl.BlockSpec((None, c), lambda i, j: (i, 0))
    return pl.pallas_call(
        functools.partial(_log_softmax_kernel, v=v, c_pad=_pow2(c)),
        out_shape=jax.ShapeDtypeStruct((n, v), jnp.float32),
        grid=(n, c),
        in_specs=[row, parts, parts],
        out_specs=row,
        interpret=interpret,
        compiler_params=_params(interpret),
        name="bi_log_softmax",
    )(x, m, s)


def _use_xla(x: jax.Array, backend: str | None, name: str) -> bool:
    _check(x, name)
    return _platform.resolve(backend, name) == "xla"


def logsumexp(x: jax.Array, *, backend: str | None = None) -> jax.Array:
    """Row-wise logsumexp of x[N, V] in f32, batch invariant. `backend`: 'auto' (this kernel;
    `xla_fixed` on a CPU unless JDET_PALLAS_INTERPRET=1), 'pallas' or 'xla'."""
    if _use_xla(x, backend, "logsumexp"):
        return xla_fixed.logsumexp(x)
    return _logsumexp_pallas(x)


def log_softmax(x: jax.Array, *, backend: str | None = None) -> jax.Array:
    """Row-wise log_softmax of x[N, V] in f32, batch invariant. `backend` as in `logsumexp`."""
    if _use_xla(x, backend, "log_softmax"):
        return xla_fixed.log_softmax(x)
    return _log_softmax_pallas(x)


def logsumexp_reference(x: jax.Array) -> jax.Array:
    """XLA's logsumexp in f32 (not batch invariant on GPUs)."""
    return jax.nn.logsumexp(x.astype(jnp.float32), axis=-1)


def log_softmax_reference(x: jax.Array) -> jax.Array:
    """XLA's log_softmax in f32 (not batch invariant on GPUs)."""
    return jax.nn.log_softmax(x.astype(jnp.float32), axis=-1)
