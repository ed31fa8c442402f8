"""Where a kernel runs: compiled Pallas on a GPU, plain XLA with fixed reduction orders on a CPU.

Why: on a GPU the `pallas_call`s compile (Triton lowering; Hopper paths use Mosaic GPU). On a CPU
Pallas can only interpret them, one grid point after another, which made the embedded model
generate a few tokens per second; so the CPU runs `xla_fixed` (same invariance, its own bits).
JDET_PALLAS_INTERPRET=1 brings back the interpret-mode kernels on a CPU: the kernel tests use it,
since those kernels are the GPU path and the reference for GPU bits.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import jax
import jax.numpy as jnp


@functools.cache
def platform() -> str:
    """The default backend's platform name: 'cpu', 'gpu' (cuda/rocm) or 'tpu'."""
    p = jax.default_backend()
    return "gpu" if p in ("gpu", "cuda", "rocm") else p


def interpret_default() -> bool:
    """Interpret Pallas kernels unless the default backend can compile them."""
    return platform() not in ("gpu", "tpu")


INTERPRET_ENV = "JDET_PALLAS_INTERPRET"


def pallas_interpret_forced() -> bool:
    """True when JDET_PALLAS_INTERPRET=1 asks for the Pallas kernels in interpret mode on CPU."""
    return os.environ.get(INTERPRET_ENV, "").strip().lower() in ("1", "true", "yes")


def xla_fixed_default() -> bool:
    """Whether a kernel called with backend 'auto' runs its `xla_fixed` version: on a CPU,
    unless JDET_PALLAS_INTERPRET=1. Read at trace time (a jitted step keeps what it traced)."""
    return platform() == "cpu" and not pallas_interpret_forced()


def resolve(backend: str | None, name: str) -> str:
    """'xla' or 'pallas' for a kernel without a Mosaic version (backend None/'auto' chooses)."""
    backend = backend or "auto"
    if backend not in ("auto", "pallas", "xla"):
        raise ValueError(f"{name}: backend must be 'auto', 'pallas' or 'xla', got {backend!r}")
    if backend == "auto":
        return "xla" if xla_fixed_default() else "pallas"
    return backend


@functools.cache
def host_cpu_fields() -> dict[str, str] | None:
    """The first processor's fields of Linux's /proc/cpuinfo (vendor_id, model name, flags,
    ...), or None where there is none. XLA CPU compiles for the host's instruction set, so the
    CPU path's bits, and some of its measured properties, follow it (jdet/fingerprint.py
    `host_cpu`, xla_fixed.py `small_row_blocks_verified`)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read().split("\n\n")[0]
    except OSError:
        return None
    fields = dict(ln.split(":", 1) for ln in info.splitlines() if ":" in ln)
    return {k.strip(): v.strip() for k, v in fields.items()}


def host_cpu_flags() -> frozenset:
    """The host CPU's feature flags (`host_cpu_fields`; empty where unknown)."""
    return frozenset((host_cpu_fields() or {}).get("flags", "").split())


def is_hopper() -> bool:
    """True on an sm_90 GPU (H100/H200), where the Mosaic GPU kernels are used."""
    if platform() != "gpu":
        return False
    kind = jax.devices()[0].device_kind.lower()
    return any(tag in kind for tag in ("h100", "h200", "h800", "gh200"))


def matmul_weight_dtype(dtype: Any) -> Any:
    """The dtype a matmul weight is best held in for the kernels that run here: float32 for a
    16-bit float weight on the xla_fixed CPU path, else `dtype` unchanged.

    Why: XLA CPU computes a bf16 dot by converting both operands to f32 on every call, so a bf16
    weight passed to the step is converted again in every layer of every step (measured: about
    half of a batch-1 decode step of the embedded model). Held as f32 once, the weights feed the
    fixed-shape f32 dots directly. The dots then run in f32 (the activations are cast up,
    exactly), which gives other CPU bits than bf16 operands did; every TP size and batch shares
    them (jdet/plan.py `prepare_params` applies it for every TP size alike)."""
    dtype = jnp.dtype(dtype)
    if xla_fixed_default() and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
        return jnp.dtype(jnp.float32)
    return dtype


# A 16-bit float KV cache is stored as uint16 on a CPU (jdet/kv_cache.py `storage_dtype`).
def kv_compute_dtype(cache_dtype: Any, query_dtype: Any) -> Any:
    """The float type a cache's values are: its own, or for a uint16-stored one the query's."""
    return jnp.dtype(query_dtype) if jnp.dtype(cache_dtype) == jnp.uint16 else cache_dtype


def as_float(x: jax.Array, dtype: Any) -> jax.Array:
    """Cache values (or a gathered part of them) as `dtype`: a bitcast of a uint16-stored one."""
    if x.dtype == jnp.uint16 and jnp.dtype(dtype) != jnp.uint16:
        return jax.lax.bitcast_convert_type(x, dtype)
    return x
