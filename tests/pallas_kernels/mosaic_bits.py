"""The bit checks of the Mosaic GPU paged attention family (looped and split layouts), shared by
the CPU tests (Mosaic GPU's interpreter, test_paged_attention_mosaic.py) and the Hopper tests
(compiled, test_paged_attention_mosaic_gpu.py): one sequence's rows computed one-shot, as
ragged chunks and as single-token decodes, in batches with other sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

PAGE = 16


def stacked_case(n: int, h: int, kh: int, e: int, seed: int = 0, layers: int = 2):
    """q [n, H, E], a stacked cache [layers, K, P, PAGE, E] (pages 0-2 unused) and the
    sequence's page table [pages], its pages permuted."""
    k = jax.random.split(jax.random.PRNGKey(n + 1000 * seed), 4)
    pps = -(-n // PAGE)
    shape = (layers, kh, pps + 3, PAGE, e)
    kc = jax.random.normal(k[0], shape, jnp.bfloat16)
    vc = jax.random.normal(k[1], shape, jnp.bfloat16)
    pt = (jax.random.permutation(k[2], pps) + 3).astype(jnp.int32)
    q = jax.random.normal(k[3], (n, h, e), jnp.bfloat16)
    return q, kc, vc, pt


def one_shot(f, case, n: int):
    """The sequence's n tokens as one prefill: f(q, k, v, pt, lens, qs, pos) -> [n, H, E]."""
    q, kc, vc, pt = case
    return f(q[:n], kc, vc, pt[None], jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32),
             jnp.arange(n, dtype=jnp.int32))  # fmt: skip


def chunked_and_decodes(f, case, chunks: list[int], decodes: list[int]):
    """One batch: the sequence's first sum(chunks) tokens as ragged chunks (chunk i a sequence
    whose context ends at its own last token), then one single-token decode per position in
    `decodes`. Returns (chunk rows [sum(chunks), H, E], decode rows [len(decodes), H, E])."""
    q, kc, vc, pt = case
    n = int(sum(chunks))
    ends = np.cumsum(chunks)
    pos = np.asarray(decodes, np.int32)
    lens = np.r_[ends, pos + 1].astype(np.int32)
    qs = np.r_[0, ends, n + np.arange(1, len(pos) + 1)].astype(np.int32)
    positions = np.r_[np.arange(n), pos].astype(np.int32)
    qb = jnp.concatenate([q[:n], q[pos]])
    ptb = jnp.repeat(pt[None], len(lens), axis=0)
    out = f(qb, kc, vc, ptb, jnp.asarray(lens), jnp.asarray(qs), jnp.asarray(positions))
    return out[:n], out[n:]


def bits(x) -> np.ndarray:
    return np.asarray(x).view(np.uint16)


def boundary_positions(n: int, block_kv: int, partition_size: int, extra: int = 2,
                       seed: int = 0) -> list[int]:  # fmt: skip
    """Decode positions whose contexts end on and beside block and partition boundaries, and a
    few random ones, all < n."""
    edges = [0, block_kv - 1, block_kv, partition_size - 1, partition_size, 2 * partition_size]
    pos = {p + d for p in edges for d in (-1, 0, 1)} | {n - 1}
    pos |= set(np.random.default_rng(seed).integers(0, n, extra).tolist())
    return sorted(p for p in pos if 0 <= p < n)
