"""The paged-attention kernels' Triton lowering at the Llama-3-8B decode shape, on a CPU.

Why: CI has no GPU, but `jax.export` for platform 'cuda' runs the Pallas Triton lowering (the part
that rejects a bad block shape, index or mask) without ptxas. Shared by the tests that check a
kernel variant still lowers (test_merge_rows, test_attention_knobs_gpu).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.paged_attention_pallas import attention_meta


def triton_calls_at_8b_decode(monkeypatch, attend: Callable) -> list[str]:
    """The lines of the Triton custom calls in `attend` exported for 'cuda': one token, 32 query
    heads over 8 kv heads of 128, a stacked 2-layer cache of 64 pages of 16, partition 256.
    `attend(q, kc, vc, pt, cl, qs, pos, layer, meta)` is the attention call under test."""
    from jax import export

    from pallas_kernels import _platform

    monkeypatch.setattr(_platform, "interpret_default", lambda: False)
    sd = jax.ShapeDtypeStruct
    cache = sd((2, 8, 64, 16, 128), jnp.bfloat16)
    t, s, pmax = 1, 1, 64

    def f(q, kc, vc, pt, cl, qs, pos, layer):
        meta = attention_meta(pt, cl, qs, pos, t=t, g=4, num_pages=64, page_size=16,
                              partition_size=256)  # fmt: skip
        return attend(q, kc, vc, pt, cl, qs, pos, layer, meta)

    args = (sd((t, 32, 128), jnp.bfloat16), cache, cache, sd((s, pmax), jnp.int32),
            sd((s,), jnp.int32), sd((s + 1,), jnp.int32), sd((t,), jnp.int32),
            sd((), jnp.int32))  # fmt: skip
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(*args)
    return [ln for ln in text.mlir_module().splitlines() if "__gpu$xla.gpu.triton" in ln]
