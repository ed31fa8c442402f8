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

Five schedules compute that one expression; they differ only in traffic, never in bits:

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

# "auto" (benchmarks/tp_bench.py on H200s over NVLink; BENCHMARKS.md has the table): one
# all-gather is fastest while the gathered n * bytes stays small (decode, and prefill up to ~4 MiB
# per device at TP=4); above that, TP=2 is best served by one full swap ("exchange") and TP>=4 by
# the bandwidth-optimal reduce-scatter + NCCL all-gather ("halving_ag"). TP=8 is unmeasured: it
# follows the TP=4 rule.
GATHER_MAX_BYTES_TP2 = 256 << 10  # per device
GATHER_MAX_TOTAL_BYTES = 16 << 20  # n * per-device bytes, TP >= 4

ALGORITHMS = ("auto", "pairs", "gather", "exchange", "halving", "halving_ag")


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


def auto_schedule(bytes_per_device: int, n: int) -> str:
    """The schedule "auto" runs for n devices and a payload of this size (static, never data)."""
    if n == 2:
        return "gather" if bytes_per_device <= GATHER_MAX_BYTES_TP2 else "exchange"
    return "gather" if n * bytes_per_device <= GATHER_MAX_TOTAL_BYTES else "halving_ag"


def tree_allreduce(x: jax.Array, axis_name: str, *, algorithm: str = "auto") -> jax.Array:
    """Sum `x` over mesh axis `axis_name` in the fixed pairwise tree; call inside `shard_map`.

    Every device returns the identical full sum. `x` should be f32 (the partials of a row-parallel
    matmul); any float dtype works but then the adds round in that dtype.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    n = _axis_size(axis_name)
    _check_pow2(n)
    if n == 1:
        return x
    if algorithm == "auto":
        algorithm = auto_schedule(x.size * x.dtype.itemsize, n)
    if algorithm == "pairs":
        return _pairs(x, axis_name, n)
    if algorithm == "gather":
        return _gather(x, axis_name, n)
    if algorithm == "exchange":
        return _exchange(x, axis_name, n)
    return _halving(x, axis_name, n, nccl_gather=algorithm == "halving_ag")


def _pairwise(parts: list) -> Any:
    _check_pow2(len(parts))
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def tree_sum_reference(parts: Sequence[np.ndarray]) -> np.ndarray:
    """Pure-numpy pairwise tree sum of `parts` (index order = rank order), in their dtype."""
    return _pairwise([np.asarray(p) for p in parts])
