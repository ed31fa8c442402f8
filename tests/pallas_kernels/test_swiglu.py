"""The gate|up projection with SwiGLU in the Mosaic matmul's epilogue (pallas_kernels/swiglu.py).

GPU (Hopper): rows bitwise independent of M (M <= 64 runs on the decode CTA, larger M on 128-row
CTAs), close to XLA's unfused product + SwiGLU; the negative control is XLA's own bf16 product
whose row 0 changes with M (the same comparison sees it), or else the split-K variant of
tests/pallas_kernels/variants.py. The model-level cells (alone = batched = chunked, "tp" and
"batch") run with the epilogue in tests/jdet/test_invariance_gpu.py (Qwen3-0.6B shapes).
CPU: the epilogue is refused off Hopper, and the model keeps the unfused path (its bits are
the goldens').
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import swiglu
from tests.pallas_kernels.variants import first_row_changes, split_k_by_m


def _rand(key: int, shape: tuple[int, ...]) -> jax.Array:
    x = np.random.default_rng(key).standard_normal(shape, np.float32)
    return jnp.asarray(x.astype(jnp.bfloat16))


def test_swiglu_epilogue_is_not_used_off_hopper():
    assert not swiglu.supported(4096, 28672, jnp.bfloat16)
    with pytest.raises(ValueError, match="matmul_swiglu: unsupported"):
        swiglu.matmul_swiglu(_rand(0, (1, 64)), _rand(1, (64, 256)))


@pytest.mark.gpu
@pytest.mark.parametrize("k,two_f", [(4096, 28672), (4096, 3584), (1024, 6144)])
def test_gpu_swiglu_rows_do_not_depend_on_m(k, two_f):
    """Llama-3-8B's gate|up, its TP-8 shard, Qwen3-0.6B's: rows of M = 1, 7, 64 (decode CTA),
    65, 300 equal the M = 512 rows bitwise; the result is XLA's SwiGLU to bf16 rounding."""
    h = _rand(1, (512, k))
    w = _rand(2, (k, two_f)) * float(1.0 / np.sqrt(k))
    full = np.asarray(swiglu.matmul_swiglu(h, w).astype(jnp.float32))
    assert full.shape == (512, two_f // 2) and np.isfinite(full).all()
    ref = np.asarray(swiglu.swiglu_reference(h, w).astype(jnp.float32))
    assert np.abs(full - ref).max() / np.abs(ref).max() < 2e-2
    for m in (1, 7, 64, 65, 300):
        part = np.asarray(swiglu.matmul_swiglu(h[:m], w).astype(jnp.float32))
        assert np.array_equal(part, full[:m]), f"rows changed at M={m} (K={k}, 2F={two_f})"


@pytest.mark.gpu
def test_gpu_swiglu_negative_control_a_batch_dependent_product_is_seen():
    """The comparison above can fail: XLA's own product + SwiGLU changes row 0 with M here, or
    else the split-K-by-M variant does."""
    h, w = _rand(3, (512, 4096)), _rand(4, (4096, 3584)) * (1.0 / 64)
    sizes = (7, 64, 65, 300, 512)
    differs = first_row_changes(jax.jit(lambda a: swiglu.swiglu_reference(a, w)), h, sizes)
    differs = differs or first_row_changes(jax.jit(lambda a: split_k_by_m(a, w)), h, sizes)
    assert differs
