"""The Mosaic GPU looped paged attention (pallas_kernels/paged_attention_mosaic.py) on a CPU.

CI cannot run Mosaic GPU kernels; it checks what a CPU can: the Pallas -> Mosaic GPU lowering
(layouts, barriers, TMA copies; only the PTX compilation needs a device) and, marked slow, the
kernel's pipeline and plan under Mosaic GPU's interpreter (wgmma replaced by plain dots there,
so these bits are not the GPU's). The GPU checks (accuracy, one-shot == chunks == decodes,
speed) are benchmarks/attention_mosaic.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

PAGE = 16


def _lower(f, *args) -> str:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a JAX without Mosaic GPU
        pytest.skip(f"no Mosaic GPU Pallas in this JAX: {exc}")
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _shapes(n: int, h: int, kh: int, e: int, layers: int | None):
    s = jax.ShapeDtypeStruct
    pool = (kh, n // PAGE + 2, PAGE, e) if layers is None else (layers, kh, n // PAGE + 2, PAGE, e)
    return (s((n, h, e), jnp.bfloat16), s(pool, jnp.bfloat16), s(pool, jnp.bfloat16),
            s((1, n // PAGE), jnp.int32), s((1,), jnp.int32), s((2,), jnp.int32),
            s((n,), jnp.int32))  # fmt: skip


@pytest.mark.parametrize(("block_kv", "consumers", "layers"), [(64, 1, 2), (128, 2, None)])
def test_the_mosaic_kernel_lowers_for_cuda_on_a_cpu(block_kv, consumers, layers):
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    e = 128

    def f(q, k, v, pt, lens, qs, pos):
        layer = None if layers is None else jnp.int32(layers - 1)
        return paged_attention_mosaic(q, k, v, pt, lens, qs, pos, scale=e**-0.5,
                                      partition_size=256, layer=layer, block_kv=block_kv,
                                      consumers=consumers)  # fmt: skip

    text = _lower(f, *_shapes(512, 32, 8, e, layers))
    assert sum("custom_call @mosaic_gpu" in ln for ln in text.splitlines()) == 1


def test_the_tma_probe_lowers_for_cuda_on_a_cpu():
    from benchmarks.paged_tma_probe import attention

    n, h, kh, e = 256, 8, 2, 128
    s = jax.ShapeDtypeStruct
    args = (s((n, h, e), jnp.bfloat16), s((kh, n // PAGE, PAGE, e), jnp.bfloat16),
            s((kh, n // PAGE, PAGE, e), jnp.bfloat16), s((n // PAGE,), jnp.int32))  # fmt: skip
    text = _lower(lambda q, k, v, pt: attention(q, k, v, pt, block_kv=64, steps=2, paged=True),
                  *args)  # fmt: skip
    assert "mosaic_gpu" in text


def _case(n: int, h: int, kh: int, e: int):
    k = jax.random.split(jax.random.PRNGKey(n), 4)
    pps = n // PAGE
    kc = jax.random.normal(k[0], (kh, pps + 2, PAGE, e), jnp.bfloat16)
    vc = jax.random.normal(k[1], (kh, pps + 2, PAGE, e), jnp.bfloat16)
    pt = (jax.random.permutation(k[2], pps) + 2)[None].astype(jnp.int32)
    q = jax.random.normal(k[3], (n, h, e), jnp.bfloat16)
    return (q, kc, vc, pt, jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32),
            jnp.arange(n, dtype=jnp.int32))  # fmt: skip


@pytest.mark.slow
def test_the_interpreted_kernel_is_accurate_and_chunks_give_the_one_shot_bits():
    """Two partitions of one block each (pages permuted), G = 4: allclose to the reference, and
    the rows of two ragged chunks in one batch equal the one-shot rows; the control (XLA's
    attention) differs."""
    from pallas_kernels.paged_attention import paged_attention_reference, paged_attention_xla
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    n, e = 96, 64
    args = q, kc, vc, pt, _, _, _ = _case(n, 4, 1, e)
    kw = dict(scale=e**-0.5, partition_size=64, block_kv=64, interpret=True)
    full = paged_attention_mosaic(*args, **kw)
    ref = paged_attention_reference(*args, scale=e**-0.5)
    np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)  # fmt: skip
    c = 37
    chunks = paged_attention_mosaic(q, kc, vc, jnp.repeat(pt, 2, axis=0),
                                    jnp.array([c, n], jnp.int32), jnp.array([0, c, n], jnp.int32),
                                    jnp.arange(n, dtype=jnp.int32), **kw)  # fmt: skip
    bits = np.asarray(full).view(np.uint16)
    assert np.array_equal(np.asarray(chunks).view(np.uint16), bits)
    xla = np.asarray(paged_attention_xla(*args, scale=e**-0.5)).view(np.uint16)
    assert not np.array_equal(xla, bits)
