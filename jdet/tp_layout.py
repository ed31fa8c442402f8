"""Which tensor-parallel sizes a model can be split over, and how its kv heads are laid out for one.

Why in the core and not in sharding/: the plan (jdet/plan.py) validates the TP size and pads and
replicates the weights for it before any mesh exists, and jdet.train checks a TP size before it
builds one; sharding/ runs the step on the mesh and imports these from here.

KV heads: with tp <= K each device holds K/tp kv heads; with tp > K (e.g. 8 devices, 4 kv heads)
each kv head is replicated tp/K times so that device d holds the one head its H/tp query heads
read, as real deployments do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jdet.config import ModelConfig
from pallas_kernels._platform import matmul_weight_dtype
from pallas_kernels.tree_matmul import tree_plan

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


def ffn_padded(f: int, dtype: Any) -> int:
    """An FFN width as jdet/plan.py `pad_params` pads it: to a multiple of the tree kernel's
    block_k x MAX_TP, so every TP size splits it into whole subtrees."""
    m = tree_plan(f, jnp.dtype(dtype)).block_k * MAX_TP
    return -(-f // m) * m


def check_tree_shards(cfg: ModelConfig, tp: int, dtype: Any) -> None:
    """Raise ValueError, naming the dimension, unless every row-parallel input width (o_proj's,
    the FFN's and the experts' down_proj, padded as the plan pads them) can be cut into `tp`
    whole subtrees of its reduction tree, as the "tp" mode's tree kernel needs. `dtype`: the
    weights' (the kernel's tree follows the dtype it holds them in)."""
    if tp == 1:
        return
    wdt = jnp.dtype(matmul_weight_dtype(dtype))
    c = cfg
    widths = [(f"o_proj's input width {c.q_size} ({c.num_heads} query heads x head_dim "
               f"{c.head_dim})", c.q_size)]  # fmt: skip
    if c.dense_layers:
        widths.append((f"down_proj's input width (intermediate_size {c.intermediate_size}, "
                       "padded)", ffn_padded(c.intermediate_size, dtype)))  # fmt: skip
    if c.is_moe:
        widths.append(("the experts' down_proj input width (moe_intermediate_size "
                       f"{c.moe_intermediate_size}, padded)",
                       ffn_padded(c.moe_intermediate_size, dtype)))  # fmt: skip
    for what, k in widths:
        t = tree_plan(k, wdt)
        whole = k == t.num_tiles * t.block_k
        if tp > t.num_leaves or not whole:
            raise ValueError(
                f"tp={tp} cannot split {what}: invariance='tp' reduces it in a tree of "
                f"{t.num_leaves} leaves of {t.leaf_k} columns ({wdt.name} weights) and each "
                f"device must hold whole leaves; use tp <= {t.num_leaves if whole else 1}, or "
                "invariance='batch' (not TP-invariant)"
            )


def kv_heads_in_cache(cfg: ModelConfig, tp: int) -> int:
    """Global kv-head count of the sharded cache: K, or tp when kv heads are replicated."""
    check_heads(cfg, tp)
    return max(cfg.num_kv_heads, tp)


def expand_kv_heads(
    params: dict, cfg: ModelConfig, tp: int, release: Callable[[Any], None] | None = None
) -> dict:
    """Replicate kv heads (wk, wv, bk, bv) tp/K times when tp > K; identity otherwise.
    `release` (jdet/plan.py `releaser`) is called on each weight replaced."""
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
        if release is not None:
            release(layers[name])
        layers[name] = w
    return {**params, "layers": layers}
