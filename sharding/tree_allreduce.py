"""Pairwise tree all-reduce across a mesh axis: the cross-device half of TBIK.

Reduction plan: with n = 2^m devices on the axis, device r holding x_r, every element of the result
is the same expression on every device,

    ((x_0 + x_1) + (x_2 + x_3)) + ((x_4 + x_5) + (x_6 + x_7))        (n = 8)

i.e. a full binary tree over contiguous rank blocks, the left operand always the lower ranks' block.
This is exactly how `tree_matmul` combines its tiles of the input width I, so when rank r holds the
exact subtree of I shard r (`tree_matmul_partial`), the all-reduced value is bitwise the TP=1
`tree_matmul` result, whatever n is (TBIK paper, Theorem 1 and Algorithm 2). XLA's `psum` (NCCL
ring/tree, or a serial sum on CPU) promises no order, which is why "batch" mode may differ between
TP sizes.

Six schedules compute that one expression; they differ only in traffic, never in bits:

- "pull": one Mosaic GPU kernel (pallas_kernels/allreduce_mosaic.py) in which every device reads
  each peer's partial over NVLink and adds the tree itself: one launch, no NCCL call, for
  decode-sized payloads. Hopper GPUs in a single-process job only (`pull_runs_here`); an
  explicit request elsewhere is a ValueError, never a silent fallback. Its kernel also takes the
  partial as the tree matmul's leaf groups, adds a residual and skips padding rows
  (`tree_allreduce_parts`), each with the bits of the same steps done apart.
- "pairs": for d = 1, 2, 4, ... one `lax.psum` over the pairs {r, r ^ d} (`axis_index_groups`).
  A sum of two operands has one rounding whatever the collective does inside (NCCL ring or tree,
  XLA's one-shot kernel), and IEEE addition is commutative, so each level is exactly the tree's
  `lower + upper`. An optimization barrier between levels keeps XLA from folding the levels into
  one n-way all-reduce (which would sum in its own order). At n = 2 this is one plain psum, so
  it runs on whatever all-reduce XLA has: with `xla_gpu_unsupported_use_all_reduce_one_shot_kernel`
  (jdet/step.py turns it on where XLA has it) a single kernel that reads the peer's buffer over
  NVLink, instead of an NCCL launch.

- "gather" (the TBIK paper's Algorithm 2): one `lax.all_gather` of every partial, then the tree
  over the gathered blocks in one fused kernel. One collective, like psum, so the fewest
  latencies; n times the bytes, so only for small (decode) activations.
- "exchange" (recursive doubling): for d = 1, 2, 4, ... every device swaps its whole partial with
  partner `rank ^ d` (`lax.ppermute`) and both add lower-block-first. log2(n) messages of the full
  size; at n = 2 a single swap, the best schedule for large activations.
- "halving" (recursive halving, then recursive doubling; Rabenseifner): at distance d a device
  sends half of its current rows to `rank ^ d` and adds the half it keeps (lower-block-first),
  so after log2(n) steps it owns 1/n of the fully reduced buffer; the same pairs then swap rows
  back (d = n/2, ..., 1) to rebuild the whole buffer. Each element is still summed by the same
  tree (just on one device, then copied), and the bytes moved equal a ring all-reduce's 2(n-1)/n.
- "halving_ag": the same reduce-scatter, then one `lax.all_gather` (NCCL's) to rebuild: copies
  only, so the bits are the same; rows are split by interleaving so rank r ends with segment r
  and the gathered rows need no permutation.

"auto" picks by the per-device byte size of `x` (a static shape, so one compiled program never
switches), and since all schedules give the same bits the choice is invisible in the output.
"xla_auto" is "auto" without "pull": the choice among the XLA-collective schedules (NCCL's on a
GPU), for comparing the two.
IEEE addition is commutative, so `a + b` and `b + a` are bitwise equal; writing the lower block on
the left anyway keeps the code a literal transcription of the tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet.plan import backend
from pallas_kernels.combine import combine_tree

# "auto" (benchmarks/tp_bench.py on H200s over NVLink; BENCHMARKS.md has the table): one
# all-gather is fastest while the gathered n * bytes stays small (decode, and prefill up to ~4 MiB
# per device at TP=4); above that, TP=2 is best served by one full swap ("exchange") and TP>=4 by
# the bandwidth-optimal reduce-scatter + NCCL all-gather ("halving_ag"). TP=8 is unmeasured: it
# follows the TP=4 rule.
GATHER_MAX_BYTES_TP2 = 256 << 10  # per device
GATHER_MAX_TOTAL_BYTES = 16 << 20  # n * per-device bytes, TP >= 4
# "pull" where it runs, up to this many bytes of the reduced partial per device: a TP 2 decode
# step of an 8B model (D = 4096, f32 partials) ran faster with it than with the NCCL schedules
# up to 32 rows (benchmarks/tp_step_probe.py times the step, benchmarks/tp_bench.py the
# all-reduce alone). TP >= 4 is unmeasured: the same rule.
PULL_MAX_BYTES = 512 << 10

ALGORITHMS = ("auto", "xla_auto", "pull", "pairs", "gather", "exchange", "halving", "halving_ag")


def _axis_size(axis_name: str) -> int:
    return (
        int(lax.axis_size(axis_name)) if hasattr(lax, "axis_size") else int(lax.psum(1, axis_name))
    )


def _check_pow2(n: int) -> None:
    if n < 1 or n & (n - 1):
        raise ValueError(
            f"tree all-reduce needs a power-of-two number of devices on the axis, got {n}; "
            "use tp = 1, 2, 4 or 8"
        )


def _swap(x: jax.Array, axis_name: str, n: int, d: int) -> jax.Array:
    """What partner rank ^ d holds (one collective-permute)."""
    return lax.ppermute(x, axis_name, perm=[(i, i ^ d) for i in range(n)])


def _lower_first_add(mine: jax.Array, theirs: jax.Array, is_lower: jax.Array) -> jax.Array:
    lo = jnp.where(is_lower, mine, theirs)
    hi = jnp.where(is_lower, theirs, mine)
    return lo + hi


def _exchange(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    rank = lax.axis_index(axis_name)
    d = 1
    while d < n:
        is_lower = (rank & d) == 0
        x = _lower_first_add(x, _swap(x, axis_name, n, d), is_lower)
        d *= 2
    return x


def _pairs(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    d = 1
    while d < n:
        if d > 1:  # XLA's all-reduce folder would merge psum(psum(x)) into one n-way sum
            x = lax.optimization_barrier(x)
        groups = None if n == 2 else [[i, i + d] for i in range(n) if not i & d]
        x = lax.psum(x, axis_name, axis_index_groups=groups)
        d *= 2
    return x


def _gather(x: jax.Array, axis_name: str, n: int) -> jax.Array:
    parts = lax.all_gather(x, axis_name, axis=0, tiled=False)  # [n, ...], rank order
    return _pairwise([parts[i] for i in range(n)])


def _halving(x: jax.Array, axis_name: str, n: int, *, nccl_gather: bool) -> jax.Array:
    rank = lax.axis_index(axis_name)
    shape, size = x.shape, x.size
    seg = -(-size // n)
    flat = x.reshape(-1)
    if seg * n != size:  # padded tail positions are summed and then dropped
        flat = jnp.pad(flat, (0, seg * n - size))
    # Row i of `buf` is segment i*d + (rank mod d): at distance d the pair splits its rows by the
    # parity of i (segment bit log2 d), the lower rank keeping the even ones, so after the last
    # step rank r holds segment r, summed over all ranks by the tree.
    buf = flat.reshape(n, seg)
    d = 1
    while d < n:
        is_lower = (rank & d) == 0
        pairs = buf.reshape(buf.shape[0] // 2, 2, seg)
        mine = jnp.where(is_lower, 0, 1)
        keep = lax.dynamic_index_in_dim(pairs, mine, axis=1, keepdims=False)
        send = lax.dynamic_index_in_dim(pairs, 1 - mine, axis=1, keepdims=False)
        buf = _lower_first_add(keep, _swap(send, axis_name, n, d), is_lower)
        d *= 2
    if nccl_gather:  # rank order is segment order: a plain all-gather rebuilds the buffer
        buf = lax.all_gather(buf, axis_name, axis=0, tiled=True)
    else:  # the same pairs in reverse, re-interleaving rows: exact copies, no arithmetic
        d = n // 2
        while d >= 1:
            is_lower = (rank & d) == 0
            theirs = _swap(buf, axis_name, n, d)
            lo = jnp.where(is_lower, buf, theirs)
            hi = jnp.where(is_lower, theirs, buf)
            buf = jnp.stack([lo, hi], axis=1).reshape(-1, seg)
            d //= 2
    return buf.reshape(-1)[:size].reshape(shape)


def pull_runs_here() -> bool:
    """Whether the "pull" kernel can run in this process: a Hopper GPU (Mosaic GPU), and one
    process (its peers' buffers are reached over NVLink within one process's devices)."""
    return backend().hopper and jax.process_count() == 1


def auto_schedule(bytes_per_device: int, n: int, *, pull: bool | None = None) -> str:
    """The schedule "auto" runs for n devices and a payload of this size (static, never data).
    `pull`: whether "pull" can take this payload here (default `pull_runs_here()`; the caller
    adds its shape check: `tree_allreduce` does). Never "pull" on a CPU."""
    if pull is None:
        pull = pull_runs_here()
    if pull and bytes_per_device <= PULL_MAX_BYTES:
        return "pull"
    if n == 2:
        return "gather" if bytes_per_device <= GATHER_MAX_BYTES_TP2 else "exchange"
    return "gather" if n * bytes_per_device <= GATHER_MAX_TOTAL_BYTES else "halving_ag"


def _resolve(algorithm: str, n: int, nbytes: int, pull_why_not: Any) -> str:
    """The schedule to run: `algorithm`, or auto's choice. `pull_why_not()`: why the pull kernel
    cannot take these operands (None when it can)."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if algorithm == "pull" and n > 1:  # (one device reduces nothing: any schedule will do)
        if not pull_runs_here():
            raise ValueError(
                "tree all-reduce algorithm 'pull' is a Mosaic GPU kernel for Hopper GPUs in one "
                f"process; this process runs {backend().kernels!r} kernels in "
                f"{jax.process_count()} process(es). Use 'auto', which picks it where it runs"
            )
        if why := pull_why_not():
            raise ValueError(f"tree all-reduce algorithm 'pull' cannot take this payload: {why}")
        return algorithm
    if algorithm in ("auto", "xla_auto"):
        pull = algorithm == "auto" and pull_runs_here() and pull_why_not() is None
        return auto_schedule(nbytes, n, pull=pull)
    return algorithm


def _collective(x: jax.Array, axis_name: str, n: int, algorithm: str) -> jax.Array:
    if algorithm == "pairs":
        return _pairs(x, axis_name, n)
    if algorithm == "gather":
        return _gather(x, axis_name, n)
    if algorithm == "exchange":
        return _exchange(x, axis_name, n)
    return _halving(x, axis_name, n, nccl_gather=algorithm == "halving_ag")


def _pull_why_not(shape: tuple, dtype: Any, n: int, residual: Any = None,
                  live: int | None = None) -> str | None:  # fmt: skip
    from pallas_kernels import allreduce_mosaic  # slow Mosaic GPU import: Hopper only

    return allreduce_mosaic.unsupported(shape, dtype, n, residual, live)


def _pull(parts: jax.Array, axis_name: str, n: int, **kw: Any) -> jax.Array:
    from pallas_kernels import allreduce_mosaic  # slow Mosaic GPU import: Hopper only

    return allreduce_mosaic.allreduce(parts, axis_name, n, **kw)


def tree_allreduce(x: jax.Array, axis_name: str, *, algorithm: str = "auto") -> jax.Array:
    """Sum `x` over mesh axis `axis_name` in the fixed pairwise tree; call inside `shard_map`.

    Every device returns the identical full sum. `x` should be f32 (the partials of a row-parallel
    matmul); any float dtype works but then the adds round in that dtype. "pull" takes x as one
    leaf group of x.shape[0] rows (a flat row for a vector).
    """
    n = _axis_size(axis_name)
    _check_pow2(n)
    rows = x.shape[0] if x.ndim >= 2 and x.size else 1
    parts_shape = (1, rows, x.size // rows)
    algorithm = _resolve(algorithm, n, x.size * x.dtype.itemsize,
                         lambda: _pull_why_not(parts_shape, x.dtype, n))  # fmt: skip
    if n == 1:
        return x
    if algorithm == "pull":
        return _pull(x.reshape(parts_shape), axis_name, n).reshape(x.shape)
    return _collective(x, axis_name, n, algorithm)


def tree_allreduce_parts(
    parts: jax.Array,
    axis_name: str,
    *,
    residual: jax.Array | None = None,
    live_rows: int | None = None,
    algorithm: str = "auto",
) -> jax.Array:
    """The row-parallel projection's combine: `tree_allreduce(combine_tree(list(parts)))`, plus
    `residual` if given (`residual + sum.astype(residual.dtype)`), over rows [0, live_rows).

    `parts` [G, R, C] (G a power of two) is this device's partial as leaf groups: the tree
    matmul's group results (pallas_kernels/tree_matmul.py `tree_matmul_partial_parts`), added
    by `combine_tree` first, so the groups of all devices form one pairwise tree. `residual`
    [R, C]: the residual stream the projection is added to. `live_rows` (default R): the rows
    to reduce; rows past them are padding (`Ops.row_pad`), returned as the residual's rows
    (zeros without one), never sent. Returns [R, C] in the residual's dtype, else the parts'.
    "pull" does all of it in one kernel with the same bits; the other schedules add the groups
    and the residual in XLA around their collective.
    """
    if parts.ndim != 3:
        raise ValueError(f"parts must be [groups, rows, cols], got shape {parts.shape}")
    g, rows, cols = parts.shape
    _check_pow2(g)
    live = rows if live_rows is None else int(live_rows)
    if not 0 < live <= rows:
        raise ValueError(f"live_rows={live_rows} must be in 1..{rows} (the parts' rows)")
    if residual is not None and residual.shape != (rows, cols):
        raise ValueError(f"residual shape {residual.shape} != the parts' rows {(rows, cols)}")
    n = _axis_size(axis_name)
    _check_pow2(n)
    res = None if residual is None else (residual.shape, residual.dtype)
    algorithm = _resolve(algorithm, n, live * cols * parts.dtype.itemsize,
                         lambda: _pull_why_not(parts.shape, parts.dtype, n, res, live))  # fmt: skip
    if n > 1 and algorithm == "pull":
        return _pull(parts, axis_name, n, residual=residual, live=live)
    total = combine_tree([parts[i, :live] for i in range(g)])
    if n > 1:
        total = _collective(total, axis_name, n, algorithm)
    return _add_residual(total, rows, residual)


def psum_parts(
    parts: jax.Array,
    axis_name: str,
    *,
    residual: jax.Array | None = None,
    live_rows: int | None = None,
) -> jax.Array:
    """`tree_allreduce_parts`' contract with `lax.psum` for the cross-device sum: XLA's (NCCL's)
    order, not the tree, so not TP invariant ("batch" and "none" modes)."""
    g, rows, _ = parts.shape
    live = rows if live_rows is None else int(live_rows)
    total = lax.psum(combine_tree([parts[i, :live] for i in range(g)]), axis_name)
    return _add_residual(total, rows, residual)


def _add_residual(total: jax.Array, rows: int, residual: jax.Array | None) -> jax.Array:
    """[live, C] sums -> [rows, C]: plus the residual's first rows (added as XLA adds
    `x + s.astype(x.dtype)`), then its padding rows; zeros there without a residual."""
    live, cols = total.shape
    if residual is None:
        if live == rows:
            return total
        return jnp.concatenate([total, jnp.zeros((rows - live, cols), total.dtype)])
    out = residual[:live] + total.astype(residual.dtype)
    return out if live == rows else jnp.concatenate([out, residual[live:]])


def _pairwise(parts: list) -> Any:
    _check_pow2(len(parts))
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def tree_sum_reference(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Pure-numpy pairwise tree sum of `parts` (index order = rank order), in their dtype."""
    return _pairwise([np.asarray(p) for p in parts])
