"""The invariant kernels as plain XLA for CPU backends: fixed-shape dots and fixed-tree sums.

Why: on a CPU the Pallas kernels can only run in interpret mode, which executes every grid point
one after another (far too slow to serve even the embedded 7.7M-parameter model). These are
ordinary jnp/lax programs that XLA compiles, with every reduction order fixed by model shapes.
Backend "xla" of `matmul`, `tree_matmul(_partial)`, `rms_norm`, `log_softmax`, `logsumexp` (and
`paged_attention`: xla_attention.py); the default on CPU (`_platform.xla_fixed_default`;
JDET_PALLAS_INTERPRET=1 brings back the interpret-mode Pallas kernels). CPU bits differ from GPU
bits; invariance holds within the backend, in every cell the GPU is tested on.

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
- `paged_attention`: in pallas_kernels/xla_attention.py (its plan in that module's docstring).

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

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import _platform, xla_blocked
from pallas_kernels.xla_blocked import BlockedWeight, blocked_products

# Rows of every matmul dot. Fixed: it is part of the plan (changing it may change bits).
BM = 8
# Row blocks for a product of fewer than BM rows (a decode step of 1-4 tokens): `row_block`, on
# only where XLA CPU was measured to give their rows the BM-row dot's bits
# (`_platform.small_row_blocks`).


def row_block(m: int) -> int:
    """Rows of each dot of an [m, K] product: 2 for m <= 2, 4 for m <= 4, else BM (all BM
    without the small row blocks: `_platform.small_row_blocks`)."""
    if _platform.small_row_blocks():
        for bm in (2, 4):
            if m <= bm:
                return bm
    return BM
# Columns of every matmul dot (a TP column shard narrower than BN is zero-padded to BN).
BN = 128


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
    if jnp.finfo(x.dtype).nmant + 1 <= 12:
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


def exp_rows(x: jax.Array, block: int = BM) -> jax.Array:
    """exp of x[N, C] computed in fixed blocks of `block` rows (`lax.map`), so every element
    goes through one code path whatever N is.

    Why: XLA CPU's exp is not correctly rounded, and the code it emits for an [N, C] array with
    few columns depends on N: on the 2-core CI machine (JAX 0.10.2) the exp of [512, 8] router
    logits differed in 76 rows from the same rows' exp in [64, 8] pieces. A row of a
    mixture-of-experts router then got other routing weights alone than in a batch or a chunk
    (tests/jdet/test_moe.py). Rows of one block run the identical [block, C] program."""
    n = x.shape[0]
    nb = -(-n // block)
    xb = _pad_axis(x, 0, nb * block).reshape(nb, block, *x.shape[1:])
    return lax.map(jnp.exp, xb).reshape(nb * block, *x.shape[1:])[:n]


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
    (a total order with NaNs) is several times slower than an integer's; here the sort runs on
    int32 keys that order as the floats do (a float's bits,
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
    emitters: a third of the sampler's compile, for one cumsum of [N, V]. These two rolled loops
    compile in a fraction of that and run about as fast (benchmarks/sampler_compile.py). Not
    `jnp.cumsum` (XLA's reduce-window rewrite): its order is XLA's choice, which a compiler
    version may change."""
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
