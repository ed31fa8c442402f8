"""Where a kernel runs: compiled on a GPU, interpreted everywhere else.

Why: CI has no GPU, so every Pallas kernel must also run in interpret mode on the CPU; on a GPU the
same `pallas_call` compiles (Triton lowering), and Hopper-only paths use Mosaic GPU.
"""

from __future__ import annotations

import functools

import jax


@functools.cache
def platform() -> str:
    """The default backend's platform name: 'cpu', 'gpu' (cuda/rocm) or 'tpu'."""
    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def interpret_default() -> bool:
    """Interpret Pallas kernels unless the default backend can compile them."""
    return platform() not in ("gpu", "tpu")


def is_hopper() -> bool:
    """True on an sm_90 GPU (H100/H200), where the Mosaic GPU kernels are used."""
    if platform() != "gpu":
        return False
    kind = jax.devices()[0].device_kind.lower()
    return any(tag in kind for tag in ("h100", "h200", "h800", "gh200"))
