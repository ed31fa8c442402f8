"""The transformer as pure functions over a params pytree and a paged KV cache.

Dimension letters (einsum): T tokens, S sequences, D model dim, H query heads, K kv heads,
G = H // K, E head dim, F ffn dim, V vocab, L layers.

One decoder layer: RMSNorm -> q/k/v projections (+bias, + per-head qk-norm for Qwen3) -> RoPE ->
write this step's K/V into the paged cache -> paged attention (reads the pages, so a token sees
bitwise the K/V that any other schedule would have written) -> o_proj -> residual -> RMSNorm ->
SwiGLU MLP -> residual. Layers run under one `lax.scan` over the stacked weights, with the cache in
the carry so XLA updates it in place. Head counts are read from weight shapes, so the same code
runs on a tensor-parallel shard. All reductions go through `ops` (jdet/ops.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jdet.batch import StepBatch
from jdet.config import ModelConfig
from jdet.kv_cache import write_kv
from jdet.ops import Ops


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, E] in float32, exactly as transformers builds them (freqs in f32)."""
    inv, scale = cfg.rope_inv_freq()
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x[T, n, E] rotated with HF's rotate-half convention, computed in f32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


def _head_norm(ops: Ops, x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    T, n, E = x.shape
    return ops.rms_norm(x.reshape(T * n, E), w, eps).reshape(T, n, E)


def layer_forward(
    lp: dict,
    x: jax.Array,
    kv: dict,
    layer: jax.Array,
    batch: StepBatch,
    cos: jax.Array,
    sin: jax.Array,
    cfg: ModelConfig,
    ops: Ops,
) -> tuple[jax.Array, dict]:
    T = x.shape[0]
    E = cfg.head_dim
    eps = cfg.rms_norm_eps
    h = ops.rms_norm(x, lp["attn_norm"], eps)
    if "wqkv" in lp:  # fused q|k|v (jdet/plan.py fuse_projections): same bits, one launch
        nk = kv["k"].shape[1] * E  # local kv heads x E, read off the (sharded) cache
        qkv = ops.matmul(h, lp["wqkv"])
        nq = qkv.shape[-1] - 2 * nk
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
    else:
        q = ops.matmul(h, lp["wq"])
        k = ops.matmul(h, lp["wk"])
        v = ops.matmul(h, lp["wv"])
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(T, -1, E)
    k = k.reshape(T, -1, E)
    v = v.reshape(T, -1, E)
    if cfg.qk_norm:
        q = _head_norm(ops, q, lp["q_norm"], eps)
        k = _head_norm(ops, k, lp["k_norm"], eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    kv = {
        "k": write_kv(kv["k"], layer, k, batch.slot_mapping),
        "v": write_kv(kv["v"], layer, v, batch.slot_mapping),
    }
    attn = ops.attention(q, kv, layer, batch, scale=E**-0.5)
    o = ops.row_matmul(attn.reshape(T, -1), lp["wo"])
    if cfg.o_bias:
        o = o + lp["bo"]
    x = x + o
    h = ops.rms_norm(x, lp["mlp_norm"], eps)
    if "w_gate_up" in lp:  # fused gate|up, as wqkv
        gate_up = ops.matmul(h, lp["w_gate_up"])
        gate, up = jnp.split(gate_up, 2, axis=-1)
    else:
        gate = ops.matmul(h, lp["w_gate"])
        up = ops.matmul(h, lp["w_up"])
    act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    x = x + ops.row_matmul(act, lp["w_down"])
    return x, kv


def embed(params: dict, token_ids: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], token_ids, axis=0)


def lm_head_weight(params: dict) -> jax.Array:
    return params["lm_head"] if "lm_head" in params else params["embed"].T


def hidden_states(
    params: dict, cfg: ModelConfig, kv: dict, batch: StepBatch, ops: Ops
) -> tuple[dict, jax.Array]:
    """All layers; returns the updated cache and the final hidden states [T, D] (pre-norm)."""
    x = embed(params, batch.token_ids)
    cos, sin = rope_tables(cfg, batch.positions)
    L = jax.tree_util.tree_leaves(params["layers"])[0].shape[0]

    def body(carry: tuple, xs: tuple) -> tuple:
        x, kv = carry
        lp, layer = xs
        x, kv = layer_forward(lp, x, kv, layer, batch, cos, sin, cfg, ops)
        return (x, kv), None

    (x, kv), _ = jax.lax.scan(body, (x, kv), (params["layers"], jnp.arange(L, dtype=jnp.int32)))
    return kv, x


def logits_from_hidden(params: dict, cfg: ModelConfig, x: jax.Array, ops: Ops) -> jax.Array:
    h = ops.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return ops.matmul(h, lm_head_weight(params), out_dtype=jnp.float32)


def forward(
    params: dict, cfg: ModelConfig, kv: dict, batch: StepBatch, ops: Ops
) -> tuple[dict, jax.Array]:
    """One step: returns (updated cache, f32 logits for `batch.logits_rows` [N, V])."""
    kv, x = hidden_states(params, cfg, kv, batch, ops)
    return kv, logits_from_hidden(params, cfg, x[batch.logits_rows], ops)
