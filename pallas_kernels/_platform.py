"""Where a kernel runs: compiled Pallas on a GPU, plain XLA with fixed reduction orders on a CPU.

Why: on a GPU the `pallas_call`s compile (Triton lowering; Hopper paths use Mosaic GPU). On a CPU
Pallas can only interpret them, one grid point after another, which made the embedded model
generate a few tokens per second; so the CPU runs `xla_fixed` (same invariance, its own bits).
JDET_PALLAS_INTERPRET=1 brings back the interpret-mode kernels on a CPU: the kernel tests use it,
since those kernels are the GPU path and the reference for GPU bits.

`backend()` is the one answer to "where does this run" for code outside this package: jdet's
Plan names it (jdet/plan.py `backend`, `Plan.backend`), and every call site asks a property of
the `Backend` it returns instead of probing the platform itself (tests/test_layers.py checks).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform as _host
from typing import Any

import jax
import jax.numpy as jnp
import jaxlib


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
    `host_cpu`, `small_row_blocks_verified`)."""
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
    return any(tag in _device_kind() for tag in ("h100", "h200", "h800", "gh200"))


@functools.cache
def _device_kind() -> str:
    return jax.devices()[0].device_kind.lower()


# -- the small row blocks of the CPU path (xla_fixed.row_block) -----------------------------------
# XLA CPU's [m, K] x [K, BN] dot gives every row the bits of the same row of the 8-row dot for
# m = 2..7 (benchmarks/row_block_probe.py, at every K probed; tests/pallas_kernels/
# test_xla_fixed_row_blocks.py checks model shapes), but not for m = 1 (a matrix-vector path,
# other bits for K >= 384): a 1-row product pads to 2 rows. That equality is a measured property
# of one XLA on one instruction set, not a construction, so the small blocks are on only where it
# was measured (`small_row_blocks_verified`); elsewhere every product runs 8-row dots, invariant by
# construction (a batch-1 CPU decode is then slower: BENCHMARKS.md, "CPU (embedded model)").
SMALL_ROW_BLOCKS_ENV = "JDET_SMALL_ROW_BLOCKS"  # "1" / "0": force them on / off (measurements)
# jaxlib versions whose XLA CPU was measured to keep the rows (x86-64 with AVX2). Not 0.11: on an
# AVX-512 Xeon its 2- and 4-row dots gave rows other than the 8-row dot's at K = 1536 and 4096
# (f32 and bf16), also with `--xla_cpu_max_isa=AVX2` and with the XNNPACK/YNNPACK/oneDNN fusions
# off, so it is the compiler, not the ISA (BENCHMARKS.md, "CPU (embedded model)").
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


@functools.cache
def small_row_blocks_verified_here() -> bool:
    """`small_row_blocks_verified` for this process's jaxlib and host CPU."""
    return small_row_blocks_verified(jaxlib.__version__, _host.machine(), host_cpu_flags())


def small_row_blocks() -> bool:
    """Whether the CPU path's products of 1-4 rows run 2- or 4-row dots (`xla_fixed.row_block`):
    where verified, unless JDET_SMALL_ROW_BLOCKS=0/1 forces it. Read at trace time."""
    env = os.environ.get(SMALL_ROW_BLOCKS_ENV, "").strip().lower()
    if env:
        return env in ("1", "true", "yes")
    return small_row_blocks_verified_here()


# -- the backend, as the rest of jdet asks for it -------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Backend:
    """Where this process's kernels run, named once (jdet/plan.py `Plan.backend` wraps it).

    `platform`: the default device's ('cpu', 'gpu' or 'tpu'). `kernels`: the implementation the
    invariant modes run, whose bits differ from the others' (part of system_fingerprint):
    'xla-fixed-cpu' (`xla_fixed`; 'xla-fixed-cpu/8-row' without the small row blocks),
    'pallas-interpret', 'mosaic-gpu' (Hopper; 'mosaic-gpu+mosaic-attention' with
    JDET_ATTENTION=mosaic), 'pallas-triton' or 'pallas-<platform>'.
    """

    platform: str
    kernels: str

    @property
    def cpu(self) -> bool:
        """A CPU process (whichever kernels: `xla_fixed`, or Pallas interpreted)."""
        return self.platform == "cpu"

    @property
    def gpu(self) -> bool:
        return self.platform == "gpu"

    @property
    def xla_fixed(self) -> bool:
        """The kernels are `xla_fixed`'s fixed-order XLA programs (a CPU, not interpreting)."""
        return self.kernels.startswith("xla-fixed-cpu")

    @property
    def interpret(self) -> bool:
        """The Pallas kernels run in interpret mode (a CPU under JDET_PALLAS_INTERPRET=1)."""
        return self.kernels == "pallas-interpret"

    @property
    def hopper(self) -> bool:
        """An sm_90 GPU, where the Mosaic GPU kernels run."""
        return self.kernels.startswith("mosaic-gpu")

    @property
    def mosaic_attention(self) -> bool:
        """Hopper with JDET_ATTENTION=mosaic: the invariant modes' paged attention is the Mosaic
        GPU family (pallas_kernels/paged_attention_mosaic.py), other bits than the Triton
        kernel's, so the name (and the fingerprint) says so."""
        return self.kernels == MOSAIC_ATTENTION_KERNELS

    @property
    def small_row_blocks(self) -> bool:
        """The CPU path runs products of 1-4 rows as 2- or 4-row dots (`small_row_blocks`)."""
        return self.kernels == "xla-fixed-cpu"


# JDET_ATTENTION=mosaic (Hopper): the Mosaic GPU paged attention. Off by default: its prefill
# is ~2x the Triton kernel's, but its split (decode) layout is slower at long contexts
# (BENCHMARKS.md, "Prefill attention").
ATTENTION_ENV = "JDET_ATTENTION"
MOSAIC_ATTENTION_KERNELS = "mosaic-gpu+mosaic-attention"


def backend() -> Backend:
    """This process's `Backend`. Not cached: JDET_PALLAS_INTERPRET, JDET_SMALL_ROW_BLOCKS and
    JDET_ATTENTION are read when a kernel is traced (a jitted step keeps what it traced), and
    tests set them."""
    p = platform()
    if xla_fixed_default():
        kernels = "xla-fixed-cpu" if small_row_blocks() else "xla-fixed-cpu/8-row"
    elif interpret_default():
        kernels = "pallas-interpret"
    elif is_hopper():
        mosaic = os.environ.get(ATTENTION_ENV, "").strip().lower() == "mosaic"
        kernels = MOSAIC_ATTENTION_KERNELS if mosaic else "mosaic-gpu"
    else:
        kernels = "pallas-triton" if p == "gpu" else f"pallas-{p}"
    return Backend(platform=p, kernels=kernels)


def matmul_weight_dtype(dtype: Any) -> Any:
    """The dtype a matmul weight is best held in for the kernels that run here: float32 for a
    16-bit float weight on the xla_fixed CPU path, else `dtype` unchanged.

    Why: XLA CPU computes a bf16 dot by converting both operands to f32 on every call, so a bf16
    weight passed to the step is converted again in every layer of every step (a large share of
    a batch-1 decode step of the embedded model). Held as f32 once, the weights feed the
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
