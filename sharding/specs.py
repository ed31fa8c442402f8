"""How every weight and the KV cache are laid out across the 'tp' mesh axis.

Column-parallel (output split): wq/bq over query heads, wk/wv/bk/bv over kv heads, w_gate/w_up over
the FFN width, lm_head over the vocabulary. Row-parallel (input split, partial sums combined by the
tree all-reduce): wo over query heads, w_down over the FFN width. Replicated: norms, embed, bo.
The KV cache `[L, K, P, B, E]` is split on its kv-head axis 1.

Padding is the reduction plan's (jdet/plan.py `pad_params`): sizes that do not divide by tp are
padded, never refused, once for every TP size, so this module imports no kernel.

KV heads: replicated when tp > K (jdet/tp_layout.py `expand_kv_heads`, part of the plan's weight
layout). The forward reads local head counts from weight shapes, so it runs unchanged on a shard.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdet.config import ModelConfig
from jdet.params import weight_specs
from sharding.mesh import TP_AXIS

# Logical axes (jdet.params) that tensor parallelism splits. "vocab" is split only on lm_head: the
# embedding is a row gather, replicated (a vocab-parallel gather would need an extra all-reduce).
_SPLIT_AXES = frozenset({"heads", "kv_heads", "ffn", "o_in"})


def _axes_by_name(cfg: ModelConfig) -> dict[str, tuple[str | None, ...]]:
    axes = {spec.path[-1]: spec.axes for spec in weight_specs(cfg)}
    axes["lm_head"] = (None, "vocab")
    # fused column-parallel weights (jdet/plan.py fuse_projections): split like their parts
    axes["wqkv"], axes["w_gate_up"] = axes["wq"], (None, "ffn")
    return axes


def param_partition_specs(params: dict, cfg: ModelConfig) -> dict:
    """A PartitionSpec for every leaf of `params` (stacked layer leaves get a leading None)."""
    axes = _axes_by_name(cfg)

    def spec(name: str, leaf: Any, per_layer: bool) -> P:
        logical = axes.get(name)
        if logical is None:
            raise ValueError(f"no partition rule for weight {name!r}; add it to jdet.params")
        split = tuple(
            TP_AXIS if (a in _SPLIT_AXES or (a == "vocab" and name == "lm_head")) else None
            for a in logical
        )
        full = ((None,) if per_layer else ()) + split
        if len(full) != leaf.ndim:
            raise ValueError(f"weight {name!r} has shape {leaf.shape}, expected rank {len(full)}")
        return P(*full)

    out = {k: spec(k, v, False) for k, v in params.items() if k != "layers"}
    out["layers"] = {k: spec(k, v, True) for k, v in params["layers"].items()}
    return out


def kv_partition_spec() -> P:
    """Spec of each of kv['k'], kv['v'] `[L, K, P, B, E]`: split on kv heads."""
    return P(None, TP_AXIS, None, None, None)


def kv_partition_specs(kv: dict) -> dict:
    return {k: kv_partition_spec() for k in kv}


def named(mesh: jax.sharding.Mesh, specs: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P)
    )
