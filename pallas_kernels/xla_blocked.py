"""Matmul weights held in the layout of the CPU path's fixed-shape dots (`xla_fixed`), made once.

Why: `xla_fixed.tree_subtree` computes a[M, K] @ b[K, N] as one [BM, leaf_k] x [leaf_k, BN] dot per
(leaf, n block); cutting b into those blocks in the step is a copy of every weight in every layer
of every step. `BlockedWeight` holds them cut (jdet/plan.py `matmul_weights`, "tp" at TP 1 on a
CPU), and three things keep the step from touching more memory than the dots need (a batch-1
decode step on a CPU is bound by reading its f32 weights; benchmarks/cpu_bench.py times it):
- bf16 weights are held as their 16 bits (uint16, `compute="float32"`) and widened to f32 in the
  step (`widen`: the bits shifted into the high half, which is what a bf16 -> f32 convert is, so
  the dots get bitwise the f32 operands they had): half the bytes read. Held as bf16, XLA CPU
  would convert the whole stacked array to f32 around each layer slice (no bf16 dynamic-slice);
  held as uint16 the slice and the widening are one fusion.
- the dots run in groups of n blocks of at most GROUP_BYTES of f32 weights (`blocked_products`),
  each group widened just before its dots read it, so it is read from the core's L2, not written
  to and read back from memory.
- a layer of a stacked [L, ...] weight is read in place (`at_layer`): jdet/model.py keeps such
  weights out of the layer scan's xs (whose per-iteration slice XLA CPU materialises, a copy of
  every layer's weights) and each group slices its own blocks out of the stack.
- blocks known to be zero are not held (`block_weight(live_k=, live_n=)`: the FFN columns and
  rows `jdet/plan.py pad_params` adds for the TP tree, 25 % of the embedded model's MLP): an
  n block past live_n gives zero columns, a tree leaf past live_k a zero part, without its dots.
None of this changes a dot or the order the dots are combined in: same bits as the [K, N] array
(tests/pallas_kernels/test_xla_fixed.py). (A skipped block's dot of finite activations with a
zero block is a zero; an exact zero stands in for it, in the same place of the tree.)
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# f32 weight bytes per group of n blocks (`blocked_products`): half the core's L2 (512 KiB) on the
# CI machine, so a widened group is still in L2 when its dots read it; a group the size of L2 or
# more is read back from memory.
GROUP_BYTES = 256 * 1024


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["blocks", "layer"],
    meta_fields=["k", "n", "compute", "full"],
)
@dataclasses.dataclass(frozen=True)
class BlockedWeight:
    """A matmul weight b[K, N] as blocks [..., num_leaves, nb, leaf_k, BN] (K zero-padded to
    num_leaves * leaf_k, N to nb * BN): block [i, j] = b[i*leaf_k:(i+1)*leaf_k, j*BN:(j+1)*BN].
    Leading axes (a stacked layer axis) are allowed. `compute`: the dtype the dots take when it is
    not the blocks' own ("float32" for bf16 bits held as uint16). `layer`: set by `at_layer`, the
    layer of stacked blocks this weight stands for (read in place). `full`: (num_leaves, nb) of
    the whole plan when the blocks hold only the leading (live) ones, the rest being zero.

    It answers `shape`, `ndim` and `dtype` as the [.., K, N] weight of `compute` dtype, so the
    kernels' entry points check and plan it like one; only the xla_fixed kernels compute with it."""

    blocks: jax.Array
    k: int
    n: int
    compute: str | None = None
    layer: jax.Array | None = None
    full: tuple[int, int] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        lead = self.blocks.shape[:-4]
        return (*(lead[1:] if self.layer is not None else lead), self.k, self.n)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute or self.blocks.dtype)

    @property
    def leaves(self) -> tuple[int, int]:
        """(num_leaves, leaf_k) of the tree the blocks were cut for."""
        return (self.full[0] if self.full else self.blocks.shape[-4]), self.blocks.shape[-2]

    def at_layer(self, layer: jax.Array) -> BlockedWeight:
        """Layer `layer` of stacked [L, ...] blocks, read in place by the dots (no slice copy)."""
        if self.layer is not None or self.blocks.ndim != 5:
            raise ValueError(
                f"at_layer needs stacked blocks [L, leaf, nb, leaf_k, BN], got {self.blocks.shape}"
            )
        return dataclasses.replace(self, layer=layer)


def block_weight(
    w, *, num_leaves: int, leaf_k: int, bn: int, compute=None,
    live_k: int | None = None, live_n: int | None = None,
) -> BlockedWeight:  # fmt: skip
    """w[..., K, N] cut into the blocks `tree_subtree(leaf_k=leaf_k, num_leaves=num_leaves)`
    reads (num_leaves=1, leaf_k=K: the BIO matmul's). A numpy `w` is cut by numpy (no XLA
    compile per weight while an engine starts); a jax array (or tracer) by jnp. `compute`
    float32 with a bf16 `w`: held as its bits (uint16), widened in the step (module docstring);
    any other `compute` than w's dtype is refused. `live_k` / `live_n`: rows >= live_k and
    columns >= live_n are zero (padding), so the leaves and n blocks wholly past them are not
    held and their dots not run; a numpy `w` whose skipped part is not zero is refused."""
    *lead, k, n = w.shape
    if num_leaves * leaf_k < k:
        raise ValueError(f"{num_leaves} leaves of {leaf_k} cannot hold K={k}")
    xp = np if isinstance(w, np.ndarray) else jnp
    nb = -(-n // bn)
    live_leaves = num_leaves if live_k is None else max(1, -(-live_k // leaf_k))
    live_nb = nb if live_n is None else max(1, -(-live_n // bn))
    if live_leaves > num_leaves or live_nb > nb:
        raise ValueError(f"live_k={live_k}, live_n={live_n} exceed the weight's K={k}, N={n}")
    if xp is np and (
        np.any(w[..., live_leaves * leaf_k :, :]) or np.any(w[..., live_nb * bn :])
    ):
        raise ValueError(
            f"rows >= {live_leaves * leaf_k} or columns >= {live_nb * bn} of the weight are not "
            f"zero, but live_k={live_k} / live_n={live_n} would skip them; pass the true extent"
        )
    widths = [(0, 0)] * len(lead) + [(0, num_leaves * leaf_k - k), (0, nb * bn - n)]
    w = xp.swapaxes(xp.pad(w, widths).reshape(*lead, num_leaves, leaf_k, nb, bn), -3, -2)
    full = None
    if (live_leaves, live_nb) != (num_leaves, nb):
        w, full = w[..., :live_leaves, :live_nb, :, :], (num_leaves, nb)
    if compute is None or jnp.dtype(compute) == w.dtype:
        return BlockedWeight(w, k, n, full=full)
    if (jnp.dtype(compute), jnp.dtype(w.dtype)) != (jnp.float32, jnp.bfloat16):
        raise ValueError(
            f"a {w.dtype} weight cannot be held for {jnp.dtype(compute)} dots; only bf16 weights "
            f"are held as their bits for float32 dots (pass compute=None to keep {w.dtype})"
        )
    bits = w.view(np.uint16) if xp is np else lax.bitcast_convert_type(w, jnp.uint16)
    return BlockedWeight(bits, k, n, "float32", full=full)


def widen(blocks: jax.Array, dtype) -> jax.Array:
    """Blocks as `dtype`; uint16 blocks hold bf16 bits, made f32 by shifting them into the high
    half of the word: exactly a bf16 -> f32 conversion, as integer ops (module docstring)."""
    if blocks.dtype == jnp.uint16:
        blocks = lax.bitcast_convert_type(blocks.astype(jnp.uint32) << 16, jnp.float32)
    return blocks.astype(dtype)


def group_size(nb: int, block_bytes: int) -> int:
    """n blocks per group: the largest divisor of nb whose blocks fit GROUP_BYTES (at least 1)."""
    g = max(1, min(nb, GROUP_BYTES // max(block_bytes, 1)))
    while nb % g:
        g -= 1
    return g


def blocked_products(
    products: Callable[[jax.Array], jax.Array],
    b: BlockedWeight,
    dtype,
    *,
    leaf_k: int,
    num_leaves: int,
) -> tuple[jax.Array, int]:
    """products(w4) over b's blocks, a group of n blocks at a time (module docstring).

    `products` maps blocks w4 [leaf, g, leaf_k, BN] of `dtype` to [m blocks, BM, g * BN] (the
    dots of every row block with those columns; w4 holds b's live leaves, those past them are
    zero); returns its result for all nb blocks, [m blocks, BM, nb * BN] (n blocks b does not
    hold are zero columns), and nb. Each column's dots are the same whatever the grouping."""
    lead = 5 if b.layer is not None else 4
    if b.leaves != (num_leaves, leaf_k) or b.blocks.ndim != lead:
        raise ValueError(
            f"a weight blocked as {b.leaves[0]} leaves of {b.leaves[1]} (blocks "
            f"{b.blocks.shape}) cannot run a plan of {num_leaves} leaves of {leaf_k}; block "
            f"it for this plan (jdet/plan.py matmul_weights) or pass the [K, N] array"
        )
    live, nb, _, bn = b.blocks.shape[-4:]
    g = group_size(nb, live * leaf_k * bn * jnp.dtype(dtype).itemsize)

    def group(i: jax.Array | int) -> jax.Array:
        start = [0, i * g, 0, 0]
        size = [live, g, leaf_k, bn]
        if b.layer is not None:
            start, size = [b.layer, *start], [1, *size]
        if g == nb and b.layer is None:
            w = b.blocks
        else:
            w = lax.dynamic_slice(b.blocks, start, size).reshape(size[-4:])
        return products(widen(w, dtype))

    if g == nb:
        out = group(0)
    else:
        out = lax.map(group, jnp.arange(nb // g, dtype=jnp.int32))  # [groups, mb, BM, g * BN]
        groups, mb, bm, _ = out.shape
        out = out.transpose(1, 2, 0, 3).reshape(mb, bm, nb * bn)
    full_nb = b.full[1] if b.full else nb
    if full_nb > nb:  # the zero n blocks b does not hold: zero columns
        out = jnp.pad(out, ((0, 0), (0, 0), (0, (full_nb - nb) * bn)))
    return out, full_nb
