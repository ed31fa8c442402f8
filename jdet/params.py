"""The one description of every weight: shape, logical axes, Hugging Face name, initialisation.

Why one table: loading, random init, abstract shapes and tensor-parallel sharding all read it, so a
weight added here is added everywhere. Matrices are stored `[in, out]` (HF stores torch's
`[out, in]`, so loading transposes), and per-layer weights are stacked on a leading layer axis so
the forward is one `lax.scan`.

Logical axes name what tensor parallelism may split: "vocab", "heads" (q output), "kv_heads"
(k/v output), "ffn" (gate/up output, down input), "o_in" (o_proj input, = heads), None replicated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    path: tuple[str, ...]  # location in the params pytree
    shape: tuple[int, ...]  # without the layer axis
    axes: tuple[str | None, ...]  # logical axes, same length as shape
    hf_name: str  # with {i} for the layer index
    transpose: bool  # HF tensor is the transpose of ours
    init: str  # "normal", "ones" or "zeros"
    per_layer: bool
    # The layers a per-layer weight is stacked over (None: every layer). A mixture-of-experts
    # model holds its dense MLP over `cfg.dense_layers` and its experts over `cfg.sparse_layers`.
    layers: tuple[int, ...] | None = None
    # > 0: shape[0] is this many experts, stacked from the HF tensors named with {e}
    experts: int = 0
    # transformers' in-memory fused expert tensor holding this weight, as (name with {i}, part,
    # parts): part `part` of `parts` equal slices of its torch "out" axis -2 (gate_up_proj
    # [E, 2F, D]: gate 0, up 1 of 2; down_proj [E, D, F]: 0 of 1). A checkpoint may hold
    # either form (save_pretrained writes the per-expert one, as published checkpoints are).
    fused_hf: tuple[str, int, int] | None = None


def weight_specs(cfg: ModelConfig) -> list[WeightSpec]:
    D, F, V, E = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    Q, KV = cfg.q_size, cfg.kv_size
    pre = "model.layers.{i}."
    specs = [
        WeightSpec(
            ("embed",), (V, D), ("vocab", None), "model.embed_tokens.weight", False, "normal", False
        ),
        WeightSpec(("final_norm",), (D,), (None,), "model.norm.weight", False, "ones", False),
    ]
    if not cfg.tie_word_embeddings:
        specs.append(
            WeightSpec(
                ("lm_head",), (D, V), (None, "vocab"), "lm_head.weight", True, "normal", False
            )
        )

    def L(name: str, shape: tuple[int, ...], axes: tuple, hf: str, tr: bool, init: str) -> None:
        specs.append(WeightSpec(("layers", name), shape, axes, pre + hf, tr, init, True))

    L("attn_norm", (D,), (None,), "input_layernorm.weight", False, "ones")
    L("wq", (D, Q), (None, "heads"), "self_attn.q_proj.weight", True, "normal")
    L("wk", (D, KV), (None, "kv_heads"), "self_attn.k_proj.weight", True, "normal")
    L("wv", (D, KV), (None, "kv_heads"), "self_attn.v_proj.weight", True, "normal")
    if cfg.qkv_bias:
        L("bq", (Q,), ("heads",), "self_attn.q_proj.bias", False, "normal")
        L("bk", (KV,), ("kv_heads",), "self_attn.k_proj.bias", False, "normal")
        L("bv", (KV,), ("kv_heads",), "self_attn.v_proj.bias", False, "normal")
    if cfg.qk_norm:
        L("q_norm", (E,), (None,), "self_attn.q_norm.weight", False, "ones")
        L("k_norm", (E,), (None,), "self_attn.k_norm.weight", False, "ones")
    L("wo", (Q, D), ("o_in", None), "self_attn.o_proj.weight", True, "normal")
    if cfg.o_bias:
        L("bo", (D,), (None,), "self_attn.o_proj.bias", False, "zeros")
    L("mlp_norm", (D,), (None,), "post_attention_layernorm.weight", False, "ones")
    dense = cfg.dense_layers
    if dense:
        on = dense if cfg.is_moe else None
        for name, shape, axes, hf in (
            ("w_gate", (D, F), (None, "ffn"), "mlp.gate_proj.weight"),
            ("w_up", (D, F), (None, "ffn"), "mlp.up_proj.weight"),
            ("w_down", (F, D), ("ffn", None), "mlp.down_proj.weight"),
        ):
            specs.append(WeightSpec(("layers", name), shape, axes, pre + hf, True, "normal", True,
                                    layers=on))  # fmt: skip
    if cfg.is_moe:
        specs.extend(moe_specs(cfg))
    return specs


# Where each architecture keeps its experts: (router, experts' prefix, gate, up, down names).
MOE_HF_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", "w1", "w3", "w2"),
}


def moe_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """The expert layers' weights, stacked over `cfg.sparse_layers`: the router [D, E] and the
    experts' SwiGLU weights [E, D, Fe] (gate, up) and [E, Fe, D] (down). Tensor parallelism
    splits every expert's Fe ("ffn"), as the dense MLP's F; the router is replicated."""
    D, E, Fe = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    router, prefix, gate, up, down = MOE_HF_NAMES[cfg.moe or "qwen3_moe"]
    pre = "model.layers.{i}."
    fused = pre + "mlp.experts."
    on = cfg.sparse_layers
    # transformers' in-memory Mixtral keeps its router at mlp.gate, as Qwen3-MoE does
    fused_router = (pre + "mlp.gate.weight", 0, 1) if cfg.moe == "mixtral" else None
    return [
        WeightSpec(("layers", "router"), (D, E), (None, None), pre + router, True, "normal", True,
                   layers=on, fused_hf=fused_router),
        WeightSpec(("layers", "expert_gate"), (E, D, Fe), (None, None, "ffn"),
                   pre + prefix + gate + ".weight", True, "normal", True, layers=on, experts=E,
                   fused_hf=(fused + "gate_up_proj", 0, 2)),
        WeightSpec(("layers", "expert_up"), (E, D, Fe), (None, None, "ffn"),
                   pre + prefix + up + ".weight", True, "normal", True, layers=on, experts=E,
                   fused_hf=(fused + "gate_up_proj", 1, 2)),
        WeightSpec(("layers", "expert_down"), (E, Fe, D), (None, "ffn", None),
                   pre + prefix + down + ".weight", True, "normal", True, layers=on, experts=E,
                   fused_hf=(fused + "down_proj", 0, 1)),
    ]  # fmt: skip


def spec_layers(cfg: ModelConfig, spec: WeightSpec) -> tuple[int, ...]:
    """The model layers a per-layer weight's stack holds, in stack order."""
    return spec.layers if spec.layers is not None else tuple(range(cfg.num_layers))


def get_path(tree: dict, path: tuple[str, ...]) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def full_shape(cfg: ModelConfig, spec: WeightSpec) -> tuple[int, ...]:
    return (len(spec_layers(cfg, spec)), *spec.shape) if spec.per_layer else spec.shape


def map_specs(cfg: ModelConfig, fn: Callable[[WeightSpec], Any]) -> dict:
    out: dict = {}
    for spec in weight_specs(cfg):
        set_path(out, spec.path, fn(spec))
    return out


def abstract_params(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> dict:
    return map_specs(cfg, lambda s: jax.ShapeDtypeStruct(full_shape(cfg, s), dtype))


def init_params(
    cfg: ModelConfig,
    seed: int = 0,
    dtype: Any = jnp.bfloat16,
    scale: float = 0.02,
    on_device: bool = False,
) -> dict:
    """Random weights (tests, benchmarks): normal(0, scale) matrices, ones for norms.

    `on_device` draws them with `jax.random` on the default device instead of numpy on the host:
    other values, but an 8B model in seconds instead of minutes of host RNG (GPU benchmarks)."""
    rng = np.random.default_rng(seed)
    key = jax.random.PRNGKey(seed)
    made: list[WeightSpec] = []

    def make(spec: WeightSpec) -> jax.Array:
        shape = full_shape(cfg, spec)
        if spec.init in ("ones", "zeros"):
            return (jnp.ones if spec.init == "ones" else jnp.zeros)(shape, dtype)
        if on_device:
            made.append(spec)
            k = jax.random.fold_in(key, len(made))
            return jax.random.normal(k, shape, dtype) * jnp.asarray(scale, dtype)
        return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) * scale, dtype)

    return map_specs(cfg, make)


def param_count(params: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree_util.tree_leaves(params)))
