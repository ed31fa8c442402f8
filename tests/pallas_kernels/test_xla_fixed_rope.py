"""The CPU path's RoPE (`xla_fixed.rope`, issue 17): its bits do not depend on the step's rows.

XLA's CPU backend lets LLVM contract a multiply feeding an add into a fused multiply-add, and in
RoPE's x*cos + rot*sin, which product it fuses follows the code it generates for the fusion: the
query's RoPE of a 1-token step (fused with its padding to 8 rows) rounded otherwise than an
8-token step's, so a `min_tokens_bucket` < 8 engine left `score()`'s bits (pallas_kernels/
xla_fixed.py, "FMA contraction"). The inputs here are drawn so that the two contractions round
differently to bf16 (about 1 in 10^5 random inputs does); the negative control runs the plain
expression (jdet/ops.py `apply_rope`) in the same program and must see the rows differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.ops import apply_rope
from jdet.step import CPU_XLA_OPTIONS
from pallas_kernels import xla_attention, xla_fixed
from tests.pallas_kernels import variants

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "cpu", reason="the contraction is XLA's CPU backend's"
)

H, E, PAGE, PAGES = 8, 64, 16, 8


def _tables(pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    inv = (1.0 / 10000 ** (np.arange(0, E, 2) / E)).astype(np.float32)
    emb = np.concatenate([pos[:, None].astype(np.float32) * inv[None]] * 2, -1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def _to(x: np.ndarray, dtype) -> np.ndarray:
    return np.asarray(jnp.asarray(np.asarray(x, np.float32)).astype(dtype).astype(jnp.float32))


def _roundings(x, r, c, s):
    """bf16 of x*c + r*s: plain (each product rounded), one product fused, the other fused."""
    p1, p2 = np.float32(x * c), np.float32(r * s)
    return [_to(v, jnp.bfloat16) for v in (
        np.float32(p1 + p2), np.float32(x * c + np.float64(p2)), np.float32(r * s + np.float64(p1))
    )]  # fmt: skip


def _sensitive_row(rng, cos: np.ndarray, sin: np.ndarray, tries: int = 200_000) -> np.ndarray:
    """A query head x[E] of bf16 values where, for many elements, the plain expression and the
    two contractions round to different bf16 values (x_j and x_{j+E/2} enter both j and j+E/2)."""
    x, half = np.zeros(E, np.float32), E // 2
    for j in range(half):
        a, b = (_to(rng.standard_normal(tries), jnp.bfloat16) for _ in range(2))
        a64, b64 = a.astype(np.float64), b.astype(np.float64)
        v1 = _roundings(a64, -b64, np.float64(cos[j]), np.float64(sin[j]))
        v2 = _roundings(b64, a64, np.float64(cos[j + half]), np.float64(sin[j + half]))
        hit = np.flatnonzero((v1[0] != v1[1]) | (v1[0] != v1[2]) | (v2[0] != v2[1])
                             | (v2[0] != v2[2]))  # fmt: skip
        i = hit[0] if len(hit) else 0
        x[j], x[j + half] = a[i], b[i]
    return x


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_rope_is_the_f32_expression_rounded_once_per_operation(dtype):
    """16-bit inputs: bitwise round(round(x*cos) + round(rot*sin)) in f32, then x's dtype."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((6, 3, E)) * 3, dtype)
    cos, sin = _tables(rng.integers(0, 8192, 6))
    got = np.asarray(xla_fixed.rope(x, jnp.asarray(cos), jnp.asarray(sin)).astype(jnp.float32))
    xf = np.asarray(x.astype(jnp.float32)).astype(np.float64)
    rot = np.concatenate([-xf[..., E // 2 :], xf[..., : E // 2]], -1)
    want = np.float32(np.float32(xf * cos[:, None]) + np.float32(rot * sin[:, None]))
    assert np.array_equal(got, _to(want, dtype))


def _attention_rows(rope, q, k, v, pos, cos, sin, t: int) -> np.ndarray:
    """Row 0 of RoPE then the CPU attention, in one program (the step's), for a t-row step."""

    def f(q, k, v, pt, cl, qs, pos, cos, sin):
        q = rope(q, cos, sin)
        return xla_attention.paged_attention(q, k, v, pt, cl, qs, pos, scale=E**-0.5,
                                             block_kv=64, layer=jnp.int32(0))  # fmt: skip

    ctx = int(pos[0]) + 1
    out = jax.jit(f, compiler_options=CPU_XLA_OPTIONS)(
        q[:t], k, v, jnp.arange(PAGES, dtype=jnp.int32)[None], jnp.array([ctx], jnp.int32),
        jnp.array([0, 1], jnp.int32), jnp.asarray(pos[:t]), jnp.asarray(cos[:t]),
        jnp.asarray(sin[:t]),
    )  # fmt: skip
    return np.asarray(out[0].astype(jnp.float32))


def test_rope_bits_do_not_depend_on_the_step_rows():
    """A decode token's attention output (its query's RoPE fused into the step) is the same in a
    1-, 4- and 8-row step with `xla_fixed.rope`; with the plain expression it is not."""
    rng = np.random.default_rng(0)
    pos = np.zeros(8, np.int32)
    pos[0] = 39
    cos, sin = _tables(pos)
    q = rng.standard_normal((8, H, E)).astype(np.float32)
    q[0] = [_sensitive_row(rng, cos[0], sin[0]) for _ in range(H)]
    q = jnp.asarray(q, jnp.bfloat16)
    # the stacked uint16 cache of a CPU engine (jdet/kv_cache.py), one layer
    k, v = (jax.lax.bitcast_convert_type(
        jnp.asarray(rng.standard_normal((1, H, PAGES, PAGE, E)), jnp.bfloat16), jnp.uint16)
        for _ in range(2))  # fmt: skip
    rows = {t: _attention_rows(xla_fixed.rope, q, k, v, pos, cos, sin, t) for t in (1, 4, 8)}
    assert np.array_equal(rows[1], rows[8]) and np.array_equal(rows[4], rows[8])
    # negative controls: a contraction chosen by the step's rows, by construction (every
    # backend), and the plain expression, whose contraction LLVM chose by the program's shape
    # where that was observed (variants.contraction_by_shape_measured; not on JAX 0.11.2)
    by_rows = {t: _attention_rows(variants.contracted_rope_by_rows, q, k, v, pos, cos, sin, t)
               for t in (1, 8)}  # fmt: skip
    assert not np.array_equal(by_rows[1], by_rows[8])
    if variants.contraction_by_shape_measured():
        plain = {t: _attention_rows(apply_rope, q, k, v, pos, cos, sin, t) for t in (1, 8)}
        assert not np.array_equal(plain[1], plain[8])
