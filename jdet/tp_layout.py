"""Which tensor-parallel sizes a model can be split over, and how its kv heads are laid out for one.

Why in the core and not in sharding/: the plan (jdet/plan.py) validates the TP size and pads and
replicates the weights for it before any mesh exists, and jdet.train checks a TP size before it
builds one; sharding/ runs the step on the mesh and imports these from here.

KV heads: with tp <= K each device holds K/tp kv heads; with tp > K (e.g. 8 devices, 4 kv heads)
each kv head is replicated tp/K times so that device d holds the one head its H/tp query heads
read, as real deployments do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdet.config import ModelConfig

MAX_TP = 8  # largest TP size the padded weights are laid out for (see jdet/plan.py pad_params)


def check_tp_size(tp: int, available: int | None = None) -> None:
    """Raise ValueError unless `tp` is a power of two <= MAX_TP (and <= available devices)."""
    if not isinstance(tp, int) or tp < 1 or tp & (tp - 1) or tp > MAX_TP:
        raise ValueError(
            f"tp={tp!r} is not supported: the tree all-reduce needs a power of two and weights are "
            f"padded for at most {MAX_TP} devices; use tp = 1, 2, 4 or 8"
        )
    if available is not None and tp > available:
        raise ValueError(
            f"tp={tp} needs {tp} devices but only {available} are visible "
            f"({jax.devices()[0].platform}); lower tp, or on CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing jax"
        )


def check_heads(cfg: ModelConfig, tp: int) -> None:
    """Raise ValueError unless `tp` can split the query heads and serve every kv head."""
    check_tp_size(tp)
    H, K = cfg.num_heads, cfg.num_kv_heads
    if H % tp:
        raise ValueError(f"tp={tp} cannot split {H} query heads evenly; use a tp that divides {H}")
    if tp <= K and K % tp:
        raise ValueError(
            f"tp={tp} cannot split {K} kv heads evenly; use a tp that divides {K} or a multiple "
            f"of {K} (kv heads are then replicated)"
        )
    if tp > K and tp % K:
        raise ValueError(
            f"tp={tp} exceeds the {K} kv heads but is not a multiple of {K}, so the {H // tp} "
            f"query heads of a device would span two kv heads; use a tp that divides {K} or is a "
            f"multiple of it"
        )


def kv_heads_in_cache(cfg: ModelConfig, tp: int) -> int:
    """Global kv-head count of the sharded cache: K, or tp when kv heads are replicated."""
    check_heads(cfg, tp)
    return max(cfg.num_kv_heads, tp)


def expand_kv_heads(params: dict, cfg: ModelConfig, tp: int) -> dict:
    """Replicate kv heads (wk, wv, bk, bv) tp/K times when tp > K; identity otherwise."""
    K, E = cfg.num_kv_heads, cfg.head_dim
    r = kv_heads_in_cache(cfg, tp) // K
    if r == 1:
        return params
    layers = dict(params["layers"])
    for name in ("wk", "wv") + (("bk", "bv") if cfg.qkv_bias else ()):
        w = layers[name]
        lead = w.shape[:-1]
        w = w.reshape(*lead, K, 1, E)
        w = jnp.broadcast_to(w, (*lead, K, r, E)).reshape(*lead, K * r * E)
        layers[name] = w
    return {**params, "layers": layers}
