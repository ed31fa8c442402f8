"""`system_fingerprint`: equal fingerprint + equal request => equal output (DESIGN §1).

It hashes everything the bits depend on: the weights, the config, the invariance mode, the kernel
plan (attention partition size, page size, TP size), the jdet version, and the backend/device kind.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import jax

from jdet.version import __version__


def fingerprint(
    model: Any, invariance: str, *, page_size: int, tp: int = 1, attn_partition: int = 512
) -> str:
    dev = jax.devices()[0]
    parts = {
        "weights": model.weights_hash,
        "config": model.cfg.to_dict(),
        "dtype": str(model.dtype),
        "invariance": invariance,
        "kernel_plan": {
            "page_size": page_size,
            "attn_partition": attn_partition,
            "tp": tp if invariance != "tp" else "any",
        },
        "jdet": __version__,
        "backend": dev.platform,
        "device_kind": dev.device_kind,
    }
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()
    return f"fp_jdet_{h[:16]}"
