"""`system_fingerprint`: equal fingerprint + equal request => equal output (DESIGN §1).

It hashes everything the bits depend on: the weights, the config (EOS ids included: they decide
where generation stops), the invariance mode, the kernel plan (attention partition size, page
size, TP size), the jdet version, the JAX and jaxlib versions (a compiler change can change
bits), the kernel backend (Mosaic GPU, Pallas Triton, Pallas interpret, or the CPU's fixed-order
XLA path: each has its own bits) and the device kind.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax
import jaxlib

from jdet.plan import Plan
from jdet.spec_config import ADAPTIVE_POLICY  # which steps verify (rejection mode's bits)
from jdet.version import __version__


def kernel_backend() -> str:
    """The name of the kernel implementation the invariant modes run on this process."""
    from pallas_kernels import _platform

    named = getattr(_platform, "kernel_backend", None)
    if named is not None:
        return named()
    if _platform.interpret_default():
        return "pallas-interpret"
    return "mosaic-gpu" if _platform.is_hopper() else f"pallas-{_platform.platform()}"


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
