"""Batch-invariant matmul ("BIO"): C[M, N] = A[M, K] @ B[K, N].

Reduction plan: every (block_m, block_n) tile of C reduces K sequentially in fixed steps of
block_k, each step's product accumulated into one f32 accumulator (the MMA's own accumulate on a
GPU). block_m and block_k are fixed per dtype, block_n depends on N only; M is padded up to a
multiple of block_m and never chooses anything. So row i of C is bitwise the same for any M: it is
computed by the same program position, with the same tile shapes and the same order of additions.

Backends (chosen by `resolve_backend`): Hopper GPU -> Mosaic GPU kernel (`matmul_mosaic.py`: the
same kind of plan -- fixed 64-wide K steps into an f32 accumulator -- with CTA shapes that may
follow M, never changing an element's arithmetic); other GPUs -> this module's `pl.pallas_call`
(Triton lowering); CPU -> `xla_fixed.matmul` (fixed-shape XLA dots, plan in that module), or
with JDET_PALLAS_INTERPRET=1 the same `pallas_call` in interpret mode. Invariance holds within a
backend; bits differ across backends.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _platform, xla_fixed
from pallas_kernels.decode_tiles import DEFAULT_TILES, DecodeTiles

BACKENDS = ("auto", "mosaic", "pallas", "xla")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tile plan of the portable kernel; a function of (K, N, dtype) only, never of M."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def _is_16bit(dtype: jnp.dtype) -> bool:
    return jnp.dtype(dtype).itemsize == 2


def tile_config(k: int, n: int, dtype: jnp.dtype) -> TileConfig:
    """The portable kernel's tiles for a (K, N) weight of `dtype`.

    16-bit inputs use 64x64 MMA steps (block_m=64 keeps the wasted rows of a padded decode step
    cheap); f32 uses 32-wide K steps at full (IEEE) precision. block_n is always 128 (a narrow N
    is padded with zero columns): a tensor-parallel shard of a column-parallel weight then runs
    the very same MMA shape as the whole weight, whatever the shard width — with a narrower tile
    the CPU's dot rounded differently and TP=1 and TP=8 disagreed on small models.
    K only matters through `tree_plan`.
    """
    del k, n  # neither changes the portable tile shape; kept so callers state the contract.
    bk = 64 if _is_16bit(dtype) else 32
    bn = 128
    return TileConfig(block_m=64, block_n=bn, block_k=bk)


def _precision(dtype: jnp.dtype) -> lax.Precision:
    # f32 inputs must not silently drop to tf32/bf16 passes: ask for the full-precision product.
    return lax.Precision.DEFAULT if _is_16bit(dtype) else lax.Precision.HIGHEST


def _pad_to(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    size = x.shape[axis]
    pad = -size % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)


def _check_operands(a: jax.Array, b: jax.Array) -> jnp.dtype:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(
            f"matmul expects a[M, K] @ b[K, N]; got a{tuple(a.shape)} and b{tuple(b.shape)}"
        )
    return jnp.promote_types(a.dtype, b.dtype)


def resolve_backend(backend: str | None) -> str:
    """'mosaic' on Hopper (when the Mosaic GPU module imports), 'xla' (`xla_fixed`) on a CPU
    unless JDET_PALLAS_INTERPRET=1, else 'pallas'."""
    backend = backend or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto":
        return backend
    if _platform.xla_fixed_default():
        return "xla"
    if _platform.is_hopper():
        try:
            from pallas_kernels import matmul_mosaic  # noqa: F401
        except ImportError:  # pragma: no cover - depends on the installed jax
            return "pallas"
        return "mosaic"
    return "pallas"


def _mma_tiles(a_ref, b_ref, first_tile: int, num_tiles: int, cfg: TileConfig, precision):
    """Sequential f32 accumulation of `num_tiles` K tiles starting at tile `first_tile`."""
    bk = cfg.block_k

    def body(t, acc):
        start = pl.multiple_of((first_tile + t) * bk, bk)
        a = a_ref[:, pl.ds(start, bk)]
        b = b_ref[pl.ds(start, bk), :]
        return acc + jnp.dot(a, b, preferred_element_type=jnp.float32, precision=precision)

    acc0 = jnp.zeros((a_ref.shape[0], b_ref.shape[1]), jnp.float32)
    return lax.fori_loop(0, num_tiles, body, acc0)


def _matmul_kernel(a_ref, b_ref, o_ref, *, cfg: TileConfig, num_tiles: int, precision):
    acc = _mma_tiles(a_ref, b_ref, 0, num_tiles, cfg, precision)
    o_ref[...] = acc.astype(o_ref.dtype)


def tiled_pallas_call(kernel, a: jax.Array, b: jax.Array, cfg: TileConfig, out_dtype, name: str):
    """Run `kernel(a_ref[bm, Kp], b_ref[Kp, bn], o_ref[bm, bn])` over the padded (M, N) grid."""
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    m, n = a.shape[0], b.shape[1]
    a_p = _pad_to(_pad_to(a, 0, cfg.block_m), 1, cfg.block_k)
    b_p = _pad_to(_pad_to(b, 0, cfg.block_k), 1, cfg.block_n)
    mp, kp = a_p.shape
    np_ = b_p.shape[1]
    grid = (mp // cfg.block_m, np_ // cfg.block_n)
    interpret = _platform.interpret_default()
    compiler_params = None
    if not interpret:
        compiler_params = pltriton.CompilerParams(
            num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
    out = pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((mp, np_), out_dtype),
        grid=grid,
        in_specs=[
            pl.BlockSpec((cfg.block_m, kp), lambda i, j: (i, 0)),
            pl.BlockSpec((kp, cfg.block_n), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((cfg.block_m, cfg.block_n), lambda i, j: (i, j)),
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
    )(a_p, b_p)
    if (mp, np_) != (m, n):
        out = out[:m, :n]
    return out


@functools.partial(jax.jit, static_argnames=("out_dtype",))
def _matmul_pallas(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    dtype = _check_operands(a, b)
    a, b = a.astype(dtype), b.astype(dtype)
    cfg = tile_config(a.shape[1], b.shape[1], dtype)
    num_tiles = pl.cdiv(a.shape[1], cfg.block_k)
    kernel = functools.partial(
        _matmul_kernel, cfg=cfg, num_tiles=num_tiles, precision=_precision(dtype)
    )
    return tiled_pallas_call(kernel, a, b, cfg, out_dtype, "bio_matmul")


def matmul(
    a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None, *, backend: str | None = None,
    tiles: DecodeTiles = DEFAULT_TILES,
) -> jax.Array:  # fmt: skip
    """Batch-invariant a[M, K] @ b[K, N] with f32 accumulation, cast to out_dtype (default:
    the operands' dtype). `backend` ('auto', 'mosaic', 'pallas', 'xla') exists for
    tests/benchmarks; `tiles`: the Hopper kernel's decode CTAs (pallas_kernels/decode_tiles.py,
    never the bits)."""
    dtype = _check_operands(a, b)
    out_dtype = jnp.dtype(out_dtype or dtype)
    resolved = resolve_backend(backend)
    if resolved == "xla":
        return xla_fixed.matmul(a, b, out_dtype)
    if resolved == "mosaic":
        from pallas_kernels import matmul_mosaic  # slow Mosaic GPU import: Hopper only

        if matmul_mosaic.supports(a.shape[1], b.shape[1], dtype):
            return matmul_mosaic.matmul(a.astype(dtype), b.astype(dtype), out_dtype, tiles=tiles)
    return _matmul_pallas(a, b, out_dtype)


def matmul_reference(a: jax.Array, b: jax.Array, out_dtype: jnp.dtype | None = None) -> jax.Array:
    """Plain XLA product with f32 accumulation (fast, not batch invariant)."""
    dtype = _check_operands(a, b)
    out = jnp.dot(a, b, preferred_element_type=jnp.float32, precision=_precision(dtype))
    return out.astype(out_dtype or dtype)
