"""The invariant kernels as plain XLA for CPU backends: fixed-shape dots and fixed-tree sums.

Why: on a CPU the Pallas kernels can only run in interpret mode, which executes every grid point
one after another (the embedded 7.7M-parameter model took ~17-50 s for 24 tokens). These are
ordinary jnp/lax programs that XLA compiles, with every reduction order fixed by model shapes.
Backend "xla" of `matmul`, `tree_matmul(_partial)`, `rms_norm`, `log_softmax`, `logsumexp` and
`paged_attention`; the default on CPU (`_platform.xla_fixed_default`; JDET_PALLAS_INTERPRET=1
brings back the interpret-mode Pallas kernels). CPU bits differ from GPU bits; invariance holds
within the backend, in every cell the GPU is tested on.

What XLA CPU does with a dot (measured on the 2-core CI machine, JAX 0.10.2, rows of A[:M] @ B
compared with np.array_equal against the rows of the M=512 product, M in {1,2,3,7,16,64,512},
(K, N) in {(256,768), (768,256), (512,256), (256,8192), (64,256)}):
- a plain `jnp.dot`: bf16 row 0 changes at M=1 (matrix-vector path); f32 rows change between
  M <= 16 and M = 512 (different GEMM blocking); so does a sequence of 32-wide K-tile dots with
  M padded to 8 when N = 8192, and column shards (N/2, N/8) of a padded-M f32 dot.
- stable for every M, every row position and every column shard, in bf16 and f32: M cut into
  blocks of BM rows (`lax.map`, one block per iteration) and N into blocks of BN columns (a batch
  dimension of `dot_general`), so that every dot XLA runs has the one shape [BM, Kd] x [Kd, BN]
  with Kd fixed by the weight. M and N then only choose how many identical dots run.
So that is the rule here: a dot's shape never depends on M, N or the batch, with one measured
exception (`row_block`): a product of 1-4 rows (a decode step of 1-4 tokens) runs
[2 or 4, Kd] x [Kd, BN] dots, whose rows XLA CPU computes as the BM-row dot computes them
(tests/pallas_kernels/test_xla_fixed_row_blocks.py; a 1-row dot is the matrix-vector path and is
never used). A 1-token decode then does a quarter of the 8-row block's dot work.

Reduction plans (each a function of model shapes only):
- `matmul` (BIO): every [BM, K] x [K, BN] block is one dot over the whole K (XLA's own order for
  that fixed shape, f32 accumulation), cast at the end.
- `tree_subtree` (TBIK, `tree_matmul` and `tree_matmul_partial`): K is cut into the leaves of
  `tree_plan(K)` (num_leaves leaves of leaf_k columns); each leaf is one fixed-shape dot
  [BM, leaf_k] x [leaf_k, BN] in f32, and the leaves combine in the fixed binary tree of
  `combine_tree` (0+1, 2+3, ..., lower K on the left). A TP shard holds whole leaves of the same
  shape, so its result is exactly that subtree, and the tree all-reduce finishes the same tree.
- `rms_norm`: x^2 is formed in f32, then summed over D by a halving tree (x[:h] + x[h:], D
  zero-padded to a power of two): element-wise adds only, each element computed the same way
  whatever T is. The tree's first level adds two squares, where an FMA contraction could fuse
  one (below, "FMA contraction"): the optimization barrier on x^2 does not prevent it (XLA CPU
  drops it before fusion: the head norms' first level fuses with the squares), but the square of
  a 16-bit float is exact in f32, so no contraction can change it. An f32 x's is not: its square
  is built from exact partial products instead (`_square`).
- `logsumexp` / `log_softmax`: the row max (exact in any order), then exp(x - max) summed by the
  same halving tree over V; lse = max + log(sum).
- `sort_descending` (the sampler's top-k/top-p sort on a CPU): no arithmetic; int32 keys that
  order as the floats, for XLA CPU's faster integer sort.
- `prefix_sum` (the sampler's top-p cumulative mass on a CPU): blocks of 128 columns, a running
  sum left to right within each block, plus the blocks' totals summed left to right before it.
- `rope`: RoPE's x*cos + rotate_half(x)*sin in f32 with every product exact (module section
  "FMA contraction" below), so that no fused multiply-add XLA's LLVM backend may form changes a
  bit: the value of the plain f32 expression, rounded once per product and once per sum.
- `paged_attention`: KV positions cut into blocks of block_kv tokens aligned to position 0
  (`default_block_kv(partition_size, page_size)`, as the Pallas plan), folded in increasing order
  with the online-softmax rule from the sentinel (m, l, acc) = (-inf, 0, 0). Per query token (the
  tokens run in lax.map groups of TB, each group a loop over the blocks its tokens need; a step
  of one group, T <= TB, runs its real tokens one at a time instead, below):
      s = (q . k) * scale   one fixed-shape dot [1, E] x [E, block_kv] per (token, query head)
      s = -inf where kv_pos > p;  m' = max(m, max s);  m* = (m' == -inf ? 0 : m')
      p = exp(s - m*);  alpha = exp(m - m*);  l = l*alpha + halving_tree(p)
      acc = acc*alpha + p.astype(v) @ v   (one fixed-shape dot [1, block_kv] x [block_kv, E])
  out = acc / l. A block wholly past a token's position is an exact identity on its state
  (alpha = 1, p = 0), so neither the loop's trip count (the longest context in the token's group)
  nor the batch's page-table width shows in its bits: one-shot prefill, chunked prefill and decode
  give the same bits. The loop body has one shape whatever the batch (every value is [TB, ...]),
  so XLA compiles the same arithmetic for every step; tokens per iteration (TB, or 1 for a step
  of one group: a batch-1 decode pads to 8 rows, whose 7 padding rows the group would gather KV
  for and compute like real ones) is only a batch dimension of every dot and element-wise op,
  as the matmuls' n blocks are, so a token's bits are the same either way (tested: chunk 1 and 7
  against the whole prompt; measured, batch-1 "tp" decode step min 5.83 -> 4.75 ms, same bits,
  and no slower for a step of 8 real tokens). Dots are per query head, not per kv head
  ([G, E] x [E, block_kv]): G differs between TP sizes when kv heads are replicated, and a dot of
  another shape may round differently (TP=8 disagreed with TP=1 on the tiny test model).

FMA contraction (why a T < 8 bucket could leave score()'s bits). XLA's CPU backend compiles with
LLVM's fp-contract=fast: a multiply feeding an add in one fusion may become a fused multiply-add,
which rounds once where the plain expression rounds twice. Where an add has two products as
operands (RoPE's x*cos + rot*sin), LLVM fuses one of them, and which one follows the code it
generates for the fusion, so the same expression compiled into another shape may round otherwise.
Measured on the embedded model (layer 2 at position 37): in an 8-row step the
query's RoPE (vectorised, sincosf) gave fma(x, cos, round(rot*sin)); in a 1-row step, where the
fusion also pads the query to 8 rows and was compiled to a scalar loop (cosf, sinf), it gave
another rounding, one bf16 ulp apart in one head, and decode left score() from output 23 on.
`lax.optimization_barrier` does not stop it (XLA removes barriers before fusion). What does: a
product whose value is exact needs no rounding, so fusing it into an add changes nothing. `rope`
cuts cos and sin into a high part of 8 significant bits and the exact rest (<= 16 bits), and x
into 8-bit parts (one for bf16): every partial product then has <= 24 significant bits, exact
in f32, and x*cos_hi + x*cos_lo rounds once, to the f32 product x*cos. The step's optimized HLO
at T = 1, 8 and 16 (embedded model) has no other add of two products but rms_norm's first level
(exact squares, above); an add of one product contracts alike anywhere (LLVM fuses a product
into the add it alone feeds; only the choice between two products follows the generated code).
"""

from __future__ import annotations

import functools
import os
import platform

import jax
import jax.numpy as jnp
import jaxlib
from jax import lax

from pallas_kernels import xla_blocked
from pallas_kernels._platform import as_float, host_cpu_flags, kv_compute_dtype
from pallas_kernels.xla_blocked import BlockedWeight, blocked_products

# Rows of every matmul dot. Fixed: it is part of the plan (changing it may change bits).
BM = 8
# Row blocks for a product of fewer than BM rows (a decode step of 1-4 tokens): `row_block`.
# XLA CPU's [m, K] x [K, BN] dot gives every row the bits of the same row of the BM-row dot for
# m = 2..7 (benchmarks/row_block_probe.py, at every K probed; tests/pallas_kernels/
# test_xla_fixed_row_blocks.py checks model shapes), but not for m = 1 (a matrix-vector path,
# other bits for K >= 384): a 1-row product pads to 2 rows. 0 turns them off (BM rows always).
# That equality is a measured property of one XLA on one instruction set, not a construction, so
# the small blocks are on only where it was measured (`small_row_blocks_verified`); elsewhere
# every product runs BM-row dots, invariant by construction (a batch-1 CPU decode is then slower:
# 234-259 -> 167-171 tok/s for the embedded model on the CI machine, serving/engine/shapes.py).
SMALL_ROW_BLOCKS_ENV = "JDET_SMALL_ROW_BLOCKS"  # "1" / "0": force them on / off (measurements)
# jaxlib versions whose XLA CPU was measured to keep the rows (the CI machine's 0.10.2, x86-64
# with AVX2). Not 0.11.2: on the H100 host's Xeon its 2- and 4-row dots gave rows other than
# the 8-row dot's at K = 1536 and 4096 (f32 and bf16), also with `--xla_cpu_max_isa=AVX2` and
# with the XNNPACK/YNNPACK/oneDNN fusions off, so it is the compiler, not the ISA (BENCHMARKS.md,
# "CPU (embedded model)").
SMALL_ROW_BLOCKS_JAXLIB = ("0.10.",)


def small_row_blocks_verified(jaxlib_version: str, machine: str, cpu_flags: frozenset) -> bool:
    """Whether the small row blocks' equality was measured for this jaxlib and CPU: a listed
    jaxlib on x86-64 with AVX2 and without AVX-512 (whose wider vectors LLVM would use: not
    measured). Unknown flags (no /proc/cpuinfo) are not measured either."""
    return (
        machine.lower() in ("x86_64", "amd64")
        and "avx2" in cpu_flags
        and "avx512f" not in cpu_flags
        and jaxlib_version.startswith(SMALL_ROW_BLOCKS_JAXLIB)
    )


def small_row_blocks_verified_here() -> bool:
    """`small_row_blocks_verified` for this process's jaxlib and host CPU."""
    return small_row_blocks_verified(jaxlib.__version__, platform.machine(), host_cpu_flags())


def _small_row_blocks_default() -> int:
    env = os.environ.get(SMALL_ROW_BLOCKS_ENV, "").strip().lower()
    if env:
        return int(env in ("1", "true", "yes"))
    return int(small_row_blocks_verified_here())


SMALL_ROW_BLOCKS = _small_row_blocks_default()


def row_block(m: int) -> int:
    """Rows of each dot of an [m, K] product: 2 for m <= 2, 4 for m <= 4, else BM."""
    if SMALL_ROW_BLOCKS:
        for bm in (2, 4):
            if m <= bm:
                return bm
    return BM
# Columns of every matmul dot (a TP column shard narrower than BN is zero-padded to BN).
BN = 128
# Query tokens per iteration of the attention loop (how much KV is gathered at once).
TB = 8


def _pad_axis(x: jax.Array, axis: int, size: int, value: float = 0) -> jax.Array:
    pad = size - x.shape[axis]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def tree_sum(x: jax.Array, axis: int = -1) -> jax.Array:
    """Sum over `axis` by a halving tree: x[:h] + x[h:] until one element (zero-padded to a power
    of two). Element-wise adds only, so the bits never depend on the other axes' sizes; a longer
    zero tail leaves the result unchanged (its first level adds exact zeros)."""
    x = jnp.moveaxis(x, axis, -1)
    x = _pad_axis(x, -1, _next_pow2(x.shape[-1]))
    while x.shape[-1] > 1:
        h = x.shape[-1] // 2
        x = x[..., :h] + x[..., h:]
    return x[..., 0]


def _combine_pairwise(parts: list[jax.Array]) -> jax.Array:
    """(0+1), (2+3), ... then up, lower index on the left (tree_matmul.combine_tree's order)."""
    level = list(parts)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]


def block_weight(w, *, num_leaves: int, leaf_k: int, compute=None, **live) -> BlockedWeight:
    """w[..., K, N] as the blocks of `tree_subtree(leaf_k=leaf_k, num_leaves=num_leaves)`'s dots
    (`xla_blocked.block_weight` with this plan's BN; num_leaves=1, leaf_k=K: the BIO matmul's;
    `live`: its live_k / live_n, the extent past which the weight is zero padding)."""
    return xla_blocked.block_weight(
        w, num_leaves=num_leaves, leaf_k=leaf_k, bn=BN, compute=compute, **live
    )


def _cut(b: jax.Array, dtype, leaf_k: int, num_leaves: int) -> jax.Array:
    """b[K, N]'s [leaf, n block, leaf_k, BN] blocks of `dtype`, cut in the step."""
    nb = -(-b.shape[1] // BN)
    b = _pad_axis(_pad_axis(b.astype(dtype), 0, num_leaves * leaf_k), 1, nb * BN)
    return b.reshape(num_leaves, leaf_k, nb, BN).transpose(0, 2, 1, 3)


@functools.partial(jax.jit, static_argnames=("leaf_k", "num_leaves", "out_dtype"))
def tree_subtree(
    a: jax.Array, b: jax.Array | BlockedWeight, *, leaf_k: int, num_leaves: int, out_dtype
) -> jax.Array:
    """a[M, Ks] @ b[Ks, N] as `num_leaves` leaves of `leaf_k` columns (Ks zero-padded to
    num_leaves * leaf_k), each a fixed-shape dot, combined in the pairwise tree; f32 until the
    final cast. num_leaves=1 with leaf_k=K is the BIO matmul. `b` may come blocked already
    (`BlockedWeight`, cut for this very plan): the same dots on the same blocks."""
    dtype = jnp.promote_types(a.dtype, b.dtype)
    a = a.astype(dtype)
    m = a.shape[0]
    bm = row_block(m)
    mp = -(-max(m, 1) // bm) * bm
    a = _pad_axis(_pad_axis(a, 1, num_leaves * leaf_k), 0, mp)
    a4 = a.reshape(mp // bm, bm, num_leaves, leaf_k).transpose(0, 2, 1, 3)  # [m block, leaf, ..]
    precision = lax.Precision.HIGHEST if jnp.dtype(dtype).itemsize > 2 else None
    dims = (((3,), (2,)), ((0, 1), (0, 1)))  # batch (leaf, n block); contract leaf_k

    def products(w4: jax.Array) -> jax.Array:  # [leaf, g, leaf_k, BN] -> [m blocks, bm, g*BN]
        live, g = w4.shape[:2]  # leaves past `live` are zero blocks (xla_blocked: not held)

        def block(x: jax.Array) -> jax.Array:  # x [leaf, bm, leaf_k] -> [bm, g*BN] f32
            xb = jnp.broadcast_to(x[:live, None], (live, g, bm, leaf_k))
            parts = lax.dot_general(
                xb, w4, dims, precision=precision, preferred_element_type=jnp.float32
            )  # [leaf, g, BM, BN]
            zero = jnp.zeros_like(parts[0])  # a zero block's dot, in its place of the tree
            acc = _combine_pairwise([parts[i] for i in range(live)]
                                    + [zero] * (num_leaves - live))  # fmt: skip
            return acc.transpose(1, 0, 2).reshape(bm, g * BN)

        return lax.map(block, a4)

    if isinstance(b, BlockedWeight):  # made once: in groups, read in place (xla_blocked)
        n = b.n
        out, nb = blocked_products(products, b, dtype, leaf_k=leaf_k, num_leaves=num_leaves)
    else:
        n = b.shape[1]
        b4 = _cut(b, dtype, leaf_k, num_leaves)
        out, nb = products(b4), b4.shape[1]
    return out.reshape(mp, nb * BN)[:m, :n].astype(out_dtype)


def matmul(a: jax.Array, b: jax.Array, out_dtype) -> jax.Array:
    """BIO a[M, K] @ b[K, N]: one fixed-shape [BM, K] x [K, BN] dot per block, f32 accumulate."""
    return tree_subtree(a, b, leaf_k=a.shape[1], num_leaves=1, out_dtype=jnp.dtype(out_dtype))


# Squares of f32 activations from exact partial products (`_square`); 0: the plain x * x, whose
# first tree level an FMA contraction may round by the program's shape (tests' negative control).
EXACT_F32_SQUARES = 1


def hi12(x: jax.Array) -> jax.Array:
    """f32 x truncated to its 12 leading significant bits: x - hi12(x) is exact (<= 12 bits),
    and the product of two such parts is exact in f32."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFFF000)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _square(x: jax.Array) -> jax.Array:
    """x^2 in f32 for rms_norm, such that no FMA contraction can change a bit of it or of the
    tree's first level (module docstring, "FMA contraction"). A 16-bit float's square (<= 22
    significant bits) is exact in f32: x * x, as it always was. An f32 x is cut into hi, its 12
    leading significant bits, and lo = x - hi (exact, <= 12 bits); every partial product then
    has <= 24 bits, exact in f32, and
        x^2 = hi*hi + (lo*(hi + hi) + lo*lo)
    adds exact products only, so contracting any of them into an add changes nothing: the inner
    sum is rounded once, then the outer, the same bits in every program. That is round(x*x) but
    where the inner rounding tips the outer one (one ulp, ~2 in 10^4 random elements). (Exact
    for |x| >= ~2^-50; below, lo*lo may round as a subnormal, which can reach a sum's bits only
    where the squares it is added to are as tiny.)"""
    x32 = x.astype(jnp.float32)
    if jnp.finfo(x.dtype).nmant + 1 <= 12 or not EXACT_F32_SQUARES:
        return x32 * x32
    hi = hi12(x32)
    lo = x32 - hi  # exact
    return hi * hi + (lo * (hi + hi) + lo * lo)


def sum_squares(x: jax.Array) -> jax.Array:
    """Sum over the last axis of x^2 in f32 (`_square`), by the halving tree: rms_norm's
    statistics, the same bits in every program."""
    return tree_sum(lax.optimization_barrier(_square(x)))


@functools.partial(jax.jit, static_argnames=("eps",))
def rms_norm(x: jax.Array, w: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm of x[T, D]: f32 statistics by a halving tree over D (`sum_squares`), Hugging Face
    rounding."""
    d = x.shape[1]
    x32 = x.astype(jnp.float32)
    inv = 1.0 / jnp.sqrt(sum_squares(x) / d + eps)
    normed = (x32 * inv[:, None]).astype(x.dtype)
    return (w.astype(x.dtype).astype(jnp.float32) * normed.astype(jnp.float32)).astype(x.dtype)


def _hi8(x: jax.Array) -> jax.Array:
    """f32 x truncated to its 8 leading significant bits (bf16's): x - _hi8(x) is exact."""
    bits = lax.bitcast_convert_type(x, jnp.uint32) & jnp.uint32(0xFFFF0000)
    return lax.bitcast_convert_type(bits, jnp.float32)


@jax.jit
def rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x[T, n, E] rotated with Hugging Face's rotate-half convention by cos, sin [T, E] (f32),
    rounded to x's dtype: jdet/ops.py `apply_rope`'s f32 expression x*cos + rot*sin with each
    product and the sum rounded once, computed so that no FMA contraction can change a bit
    (module docstring, "FMA contraction"): x in parts of 8 significant bits (one for bf16),
    cos and sin as hi + lo (8 + 16 bits), every partial product exact. For bf16 (and, measured,
    f16) x the result is bitwise the plain expression's; for f32 x, whose parts' products are
    each rounded, it can differ from it in the last bit, but still not by shape."""
    xf = x.astype(jnp.float32)
    parts = []
    for _ in range(-(-(jnp.finfo(x.dtype).nmant + 1) // 8) - 1):  # bf16: 1 part, f16 2, f32 3
        hi = _hi8(xf)
        parts.append(hi)
        xf = xf - hi  # exact
    parts.append(xf)
    half = x.shape[-1] // 2

    def times(t: jax.Array, rotate: bool) -> jax.Array:  # sum over the parts of part * t
        t_hi = _hi8(t)
        t_hi, t_lo = t_hi[:, None, :], (t - t_hi)[:, None, :]  # t - t_hi: exact
        out = None
        for p in parts:
            if rotate:
                p = jnp.concatenate([-p[..., half:], p[..., :half]], axis=-1)
            prod = p * t_hi + p * t_lo  # two exact products, one rounding: round(p * t)
            out = prod if out is None else out + prod
        return out

    return (times(cos, False) + times(sin, True)).astype(x.dtype)


def _row_lse(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    m = jnp.max(x, axis=-1)
    e = lax.optimization_barrier(jnp.exp(x - m[:, None]))
    return m + jnp.log(tree_sum(e))


@jax.jit
def logsumexp(x: jax.Array) -> jax.Array:
    """Row-wise logsumexp of x[N, V] in f32 (halving-tree sum over V)."""
    return _row_lse(x)


@jax.jit
def log_softmax(x: jax.Array) -> jax.Array:
    """Row-wise log_softmax of x[N, V] in f32: x - logsumexp(x)."""
    return x.astype(jnp.float32) - _row_lse(x)[:, None]


def sort_descending(x: jax.Array) -> jax.Array:
    """x[N, V] f32 sorted along V, largest first: the values of `-jnp.sort(-x)` (ties and
    +-0 may sit in another order among themselves, which no value shows), NaNs aside.

    Why: XLA CPU sorts through a comparator it calls per comparison, and a float's comparator
    (a total order with NaNs) is ~6x slower than an integer's: 12 ms for [8, 8192] f32 against
    2 ms here, where the sort runs on int32 keys that order as the floats do (a float's bits,
    the negative ones with their magnitude bits flipped) and the keys map back to the floats
    bit for bit. A sort moves values and never rounds, so the sampler's top-k/top-p filter
    keeps its bits (tests/pallas_kernels/test_xla_fixed.py)."""
    bits = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    flip = jnp.int32(0x7FFFFFFF)
    keys = jnp.where(bits < 0, bits ^ flip, bits)
    srt = jnp.sort(keys, axis=-1)[:, ::-1]
    return lax.bitcast_convert_type(jnp.where(srt < 0, srt ^ flip, srt), jnp.float32)


PREFIX_BLOCK = 128


def prefix_sum(x: jax.Array, block: int = PREFIX_BLOCK) -> jax.Array:
    """Inclusive prefix sums of x[N, V] along V in f32, in an order fixed by V alone: V is cut
    into blocks of `block` columns (zero-padded at the end); within a block the running sum goes
    left to right from 0 (one loop over the block's columns, every block and row at once), then
    each block adds the sum of the blocks before it, also formed left to right. Element i of
    block b is offset_b + (((0 + x_b0) + x_b1) + ... + x_i): element-wise adds only, so a row's
    bits do not follow N, and the zero tail adds nothing to a real column.

    Why not `lax.associative_scan` (the sampler's top-p cumulative mass on a GPU): on a CPU its
    log2(V) levels of pads, slices and adds become ~40 fusions, each compiled by XLA CPU's
    emitters (~10 ms apiece): 0.57 s of the sampler's 1.5 s compile at V = 8192, for one cumsum
    of [N, V]. These two rolled loops compile in 0.17 s and run about as fast (0.31 vs 0.27 ms
    at N = 8, V = 8192; benchmarks/sampler_compile.py). Not `jnp.cumsum`
    (XLA's reduce-window rewrite, 0.11 s): its order is XLA's choice, which a compiler version
    may change."""
    x = x.astype(jnp.float32)
    n, v = x.shape
    nb = -(-v // block)
    cols = jnp.moveaxis(_pad_axis(x, 1, nb * block).reshape(n, nb, block), 2, 0)  # [block, n, nb]

    def running(c: jax.Array, col: jax.Array):
        c = c + col
        return c, c

    _, within = lax.scan(running, jnp.zeros((n, nb), jnp.float32), cols)  # [block, n, nb]

    def before(c: jax.Array, total: jax.Array):
        return c + total, c

    _, offset = lax.scan(before, jnp.zeros((n,), jnp.float32), within[-1].T)  # [nb, n]
    out = jnp.moveaxis(within, 0, 2) + offset.T[:, :, None]  # [n, nb, block]
    return out.reshape(n, nb * block)[:, :v]


def _token_seq(query_start: jax.Array, t: int):
    qs = query_start.astype(jnp.int32)
    s = qs.shape[0] - 1
    tok = jnp.arange(t, dtype=jnp.int32)
    seq = (jnp.searchsorted(qs, tok, side="right", method="compare_all") - 1).astype(jnp.int32)
    seq_c = jnp.clip(seq, 0, s - 1)
    ok = (seq >= 0) & (seq < s) & (tok >= qs[seq_c]) & (tok < qs[seq_c + 1])
    return seq_c, ok


def _merge_block(state, s, v, precision):
    """Fold one KV block (scores s [TB, K, G, bk], values v [TB, K, bk, E]) into the running
    (m, l, acc) with the online-softmax rule; a fully masked block is an exact identity."""
    m, lsum, acc = state
    m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # exact
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    p = lax.optimization_barrier(jnp.exp(s - m_safe[..., None]))
    alpha = lax.optimization_barrier(jnp.exp(m - m_safe))
    lsum = lsum * alpha + tree_sum(p)
    pv = lax.dot_general(
        p.astype(v.dtype)[..., None, :], v, (((4,), (3,)), ((0, 1, 2), (0, 1, 2))),
        precision=precision, preferred_element_type=jnp.float32,
    )[..., 0, :]  # fmt: skip  [TB, K, G, E]: one [1, bk] x [bk, E] dot per (token, query head)
    return m_new, lsum, acc * alpha[..., None] + pv


@functools.partial(jax.jit, static_argnames=("scale", "block_kv"))
def paged_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    page_table: jax.Array,
    context_lens: jax.Array,
    query_start: jax.Array,
    positions: jax.Array,
    *,
    scale: float,
    block_kv: int,
    layer: jax.Array | None = None,
) -> jax.Array:
    """Causal paged attention of q[T, H, E] (plan in the module docstring); padding rows -> 0.

    k_cache/v_cache [K, P, B, E], or the stacked [L, K, P, B, E] cache with `layer`; a uint16
    cache holds bf16/f16 bits of q's dtype (jdet/kv_cache.py: the CPU storage). The caller
    (`paged_attention.paged_attention`) has validated shapes and chosen block_kv."""
    # The stacked cache is gathered from in place (`layer` is part of each gather's index):
    # slicing the layer out first copied the layer's whole page pool in every layer of every
    # step (measured: ~70% of a decode step with a 4096-page pool).
    stacked = layer is not None
    if not stacked:
        k_cache, v_cache = k_cache[None], v_cache[None]
        layer = jnp.int32(0)
    t, h, e = q.shape
    _, kh, num_pages, page, _ = k_cache.shape
    g = h // kh
    s, pmax = page_table.shape
    ppb = block_kv // page  # pages per block
    nblk = max(1, -(-(pmax * page) // block_kv))
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    pt = _pad_axis(pt, 1, nblk * ppb)  # page 0 is finite (zero-filled) and masked
    seq, ok = _token_seq(query_start, t)
    lim = jnp.minimum(positions.astype(jnp.int32) + 1, context_lens.astype(jnp.int32)[seq])
    lim = jnp.where(ok, jnp.maximum(lim, 0), 0)
    tp = -(-t // TB) * TB
    qg = _pad_axis(q.reshape(t, kh, g, e), 0, tp).reshape(tp // TB, TB, kh, g, e)
    seq_b = _pad_axis(seq, 0, tp).reshape(tp // TB, TB)
    lim_b = _pad_axis(lim, 0, tp).reshape(tp // TB, TB)
    precision = lax.Precision.HIGHEST if jnp.dtype(q.dtype).itemsize > 2 else None
    col = jnp.arange(block_kv, dtype=jnp.int32)

    kv_dtype = kv_compute_dtype(k_cache.dtype, q.dtype)

    def _gather_pages(cache: jax.Array, blk: jax.Array) -> jax.Array:
        """cache[:, blk] as kv_dtype. A uint16-stored cache (jdet/kv_cache.py) is gathered as
        such and only the gathered pages are bitcast. A bf16/f16 cache is gathered as uint16
        too (XLA CPU has no bf16 gather and otherwise upcasts the whole layer to f32), at the
        cost of bitcasting the pool. Bitcasts move the same bits: the result is unchanged."""
        def take(c: jax.Array) -> jax.Array:  # c[layer, :, blk] -> [K, TB, ppb, B, E]
            return jnp.moveaxis(c[layer, :, blk], 2, 0)

        if cache.dtype == jnp.uint16:
            return as_float(take(cache), kv_dtype)
        if cache.dtype not in (jnp.bfloat16, jnp.float16):
            return take(cache)
        return lax.bitcast_convert_type(take(lax.bitcast_convert_type(cache, jnp.uint16)),
                                        cache.dtype)  # fmt: skip

    def attend(qq: jax.Array, ss: jax.Array, ll: jax.Array) -> jax.Array:
        """Tokens qq [tb, K, G, E] of sequences ss [tb] attending to their first ll [tb] KV
        positions -> [tb, K, G, E] f32 (0 where ll = 0). tb tokens per loop iteration: TB for a
        group, 1 for a token alone (`single`); each token's dots and element-wise ops are the
        same whichever (tb is a batch dimension of every dot: module docstring)."""
        tb = qq.shape[0]
        qq = qq.astype(kv_dtype)
        pages = pt[ss]  # [tb, nblk * ppb]

        def body(j, state):
            blk = lax.dynamic_slice_in_dim(pages, j * ppb, ppb, axis=1)  # [tb, ppb]
            # Per query head, so that a dot's shape never depends on G (heads per kv head on
            # this device): TP shards with replicated kv heads have other G than TP=1.
            k, v = _gather_pages(k_cache, blk), _gather_pages(v_cache, blk)
            k = k.reshape(kh, tb, 1, block_kv, e).transpose(1, 0, 2, 3, 4)
            v = v.reshape(kh, tb, 1, block_kv, e).transpose(1, 0, 2, 3, 4)
            k = jnp.broadcast_to(k, (tb, kh, g, block_kv, e))
            v = jnp.broadcast_to(v, (tb, kh, g, block_kv, e))
            sc = lax.dot_general(
                qq[..., None, :], k, (((4,), (4,)), ((0, 1, 2), (0, 1, 2))),
                precision=precision, preferred_element_type=jnp.float32,
            )[..., 0, :] * scale  # fmt: skip  [tb, K, G, bk]: one [1, E] x [E, bk] dot per head
            mask = (j * block_kv + col)[None, :] < ll[:, None]  # [tb, bk]
            sc = jnp.where(mask[:, None, None, :], sc, -jnp.inf)
            return _merge_block(state, sc, v, precision)

        init = (
            jnp.full((tb, kh, g), -jnp.inf, jnp.float32),
            jnp.zeros((tb, kh, g), jnp.float32),
            jnp.zeros((tb, kh, g, e), jnp.float32),
        )
        # Only the blocks some token of this group needs; for the others they would be exact
        # identities anyway, so the trip count (a function of the batch) never shows in the bits.
        n_blk = jnp.minimum((jnp.max(ll) + block_kv - 1) // block_kv, nblk)
        _, lsum, acc = lax.fori_loop(0, n_blk, body, init)
        safe = jnp.where(lsum > 0, lsum, 1.0)
        return jnp.where((lsum > 0)[..., None], acc / safe[..., None], 0.0)

    def single(qq: jax.Array, ss: jax.Array, ll: jax.Array) -> jax.Array:
        """The step's tokens one at a time, up to the last with KV to attend to (ll > 0): a step
        of one group (T <= TB: a decode of up to TB sequences) mostly holds padding rows, which
        the group's loop would gather KV for and compute like real ones (a batch-1 decode: 8x
        the attention's work)."""
        # up to the last token with KV (the batch's padding rows come last; a row with none
        # before it gets attend's zeros, as in a group)
        n = jnp.max(jnp.where(ll > 0, jnp.arange(1, ll.shape[0] + 1, dtype=jnp.int32), 0))

        def token(r, out):
            o = attend(lax.dynamic_slice_in_dim(qq, r, 1), lax.dynamic_slice_in_dim(ss, r, 1),
                       lax.dynamic_slice_in_dim(ll, r, 1))  # fmt: skip
            return lax.dynamic_update_slice_in_dim(out, o, r, axis=0)

        return lax.fori_loop(0, n, token, jnp.zeros(qq.shape, jnp.float32))

    if tp == TB:  # one group (the smallest token bucket): its real tokens alone
        out = single(qg[0], seq_b[0], lim_b[0])[None]
    else:
        out = lax.map(lambda a: attend(*a), (qg, seq_b, lim_b))  # [T/TB, TB, K, G, E]
    out = out.reshape(tp, h, e)[:t]
    return jnp.where(ok[:, None, None], out, 0.0).astype(q.dtype)
