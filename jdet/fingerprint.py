"""`system_fingerprint`: equal fingerprint + equal request => equal output (README.md).

It hashes everything the bits depend on: the weights, the config (EOS ids included: they decide
where generation stops), the invariance mode, the kernel plan (attention partition size, page
size, TP size), the jdet version, the JAX and jaxlib versions (a compiler change can change
bits), the kernel backend (Mosaic GPU, Pallas Triton, Pallas interpret, or the CPU's fixed-order
XLA path: each has its own bits) and the device kind; on a CPU also the host CPU (`host_cpu`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
from typing import Any

import jax
import jaxlib

from jdet.plan import Plan
from jdet.spec_config import ADAPTIVE_POLICY  # which steps verify (rejection mode's bits)
from jdet.version import __version__
from pallas_kernels import _platform, kernel_backend

# Instruction-set features whose presence changes the code XLA CPU generates for a step (vector
# width, FMA, the rsqrt estimate behind 1/sqrt and its precision), so possibly its bits.
_CPU_FEATURES = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                 "avx512_bf16", "avx512_fp16", "amx_bf16")  # fmt: skip


@functools.cache
def host_cpu() -> str:
    """The host CPU as XLA CPU sees it: vendor, model name and `_CPU_FEATURES` present. Why: on a
    CPU the step's bits may follow the instruction set (XLA turns 1/sqrt into the hardware's
    rsqrt estimate plus a Newton step, and the estimate differs between vendors and between
    AVX2 and AVX-512 code), so a fingerprint that names only "cpu" could promise equal bits
    across machines that do not give them. Linux's /proc/cpuinfo; elsewhere `platform`."""
    fields = _platform.host_cpu_fields()
    if fields is None:
        return f"{platform.machine()} {platform.processor()}".strip()
    flags = _platform.host_cpu_flags()
    have = [f for f in _CPU_FEATURES if f in flags]
    return " | ".join((fields.get("vendor_id", "?"), fields.get("model name", "?"), " ".join(have)))


def fingerprint(model: Any, plan: Plan, *, page_size: int, speculative: Any = None) -> str:
    """The fingerprint of `model` run by `plan` (jdet/plan.py) with `page_size`-token pages.
    `speculative` (a SpeculativeConfig) counts only where it can change the bits: verify=
    "rejection"; "exact" speculation gives the bits of plain decoding, so the same print."""
    dev = jax.devices()[0]
    parts = {
        "weights": model.weights_hash,
        "config": model.cfg.to_dict(),
        "dtype": str(model.dtype),
        "invariance": plan.invariance,
        "kernel_plan": plan.kernel_plan(page_size),
        "jdet": __version__,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "kernel_backend": kernel_backend(),
        "backend": dev.platform,
        "device_kind": dev.device_kind,
    }
    if plan.backend.cpu:
        parts["host_cpu"] = host_cpu()
    if speculative is not None and speculative.changes_bits:
        dm = speculative.draft_model
        parts["speculative"] = {
            "method": speculative.method, "num_tokens": speculative.num_tokens,
            "verify": speculative.verify, "ngram": [speculative.ngram_min, speculative.ngram_max],
            "draft_layers": speculative.draft_layers,
            "adaptive": [speculative.min_alpha, speculative.probe_every, ADAPTIVE_POLICY],
            "draft": None if dm is None else getattr(dm, "weights_hash", str(dm)),
        }  # fmt: skip
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"fp_jdet_{h[:16]}"
