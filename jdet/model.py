"""The transformer as pure functions over a params pytree and a paged KV cache.

Dimension letters (einsum): T tokens, S sequences, D model dim, H query heads, K kv heads,
G = H // K, E head dim, F ffn dim, V vocab, L layers.

One decoder layer: RMSNorm -> q/k/v projections (+bias, + per-head qk-norm for Qwen3) -> RoPE ->
write this step's K/V into the paged cache -> paged attention (reads the pages, so a token sees
bitwise the K/V that any other schedule would have written) -> o_proj -> residual -> RMSNorm ->
SwiGLU MLP (or, in a mixture-of-experts model's sparse layers, the routed experts: jdet/moe.py)
-> residual. Layers run under one loop over the stacked weights (a `lax.while_loop`
whose counter is the layer in the invariant modes, a `lax.scan` in "none"), with the cache in
the carry so XLA updates it in place. Head counts are read from weight shapes, so the same code
runs on a tensor-parallel shard. All reductions go through `ops` (jdet/ops.py).

A mixture-of-experts model whose dense and expert layers are mixed keeps this one loop: its FFN
weights are stacked per kind (experts over the sparse layers, the dense MLP over the others),
taken out of the loop's weights, and each layer picks its kind from a static table (jdet/moe.py
says why one loop with a per-layer `lax.cond` rather than runs of same-kind layers).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jdet.batch import StepBatch
from jdet.config import ModelConfig
from jdet.kv_cache import write_kv
from jdet.moe import ffn_forward, pop_ffn
from jdet.ops import Ops, swiglu_act
from jdet.plan import backend


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [T, E] in float32, exactly as transformers builds them (freqs in f32)."""
    inv, scale = cfg.rope_inv_freq()
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv)[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


# The per-layer vectors (norm weights) stay stacked [L, D] outside the scan's xs: the norm kernel
# reads layer l's row in place, where slicing them per iteration cost a copy launch each.
NORMS = ("attn_norm", "mlp_norm", "q_norm", "k_norm")


def _head_norm(ops: Ops, x: jax.Array, w: jax.Array, eps: float, layer: jax.Array) -> jax.Array:
    T, n, E = x.shape
    return ops.rms_norm(x.reshape(T * n, E), w, eps, layer).reshape(T, n, E)


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
    norms: dict,
    attn_meta: dict | None = None,
    h: jax.Array | None = None,
    next_norm: jax.Array | None = None,
    ffn: dict | None = None,
) -> tuple[jax.Array, dict, jax.Array | None]:
    """One layer on x[T', D]. T' >= T = batch.num_tokens rows (`Ops.row_pad`): rows past T are
    padding that only the matmuls and norms see (attention, RoPE and the KV write take the
    first T). `norms`: the stacked [L, D] norm weights (`NORMS`), indexed by `layer`.

    Returns (x, kv, h_next). With `next_norm` (`Ops.fold_down_norm`: the stacked attention-norm
    weights shifted by one layer, so that row `layer` is the next layer's), down_proj's combine,
    the residual add and the next layer's attention norm run as one `residual_norm` and h_next
    is that norm, which the next layer takes as `h` instead of normalising x itself (the same
    arithmetic: one launch instead of two). Otherwise h_next is None. `ffn`: a
    mixture-of-experts model's FFN stacks (jdet/moe.py `pop_ffn`), not in `lp`."""
    T = batch.token_ids.shape[0]
    rows = x.shape[0]
    E = cfg.head_dim
    eps = cfg.rms_norm_eps
    if h is None:
        h = ops.rms_norm(x, norms["attn_norm"], eps, layer)
    qkv_rows = None  # the fused projection's rows, all of them (`Ops.rope_kv` reads them)
    if ops.fused:  # fused q|k|v (jdet/plan.py fuse_projections): same bits, one launch
        nk = kv["k"].shape[1] * E  # local kv heads x E, read off the (sharded) cache
        qkv_rows = ops.matmul(h, lp["wqkv"])
        nq = qkv_rows.shape[-1] - 2 * nk
        qk = None
        if cfg.qk_norm and not cfg.qkv_bias and ops.fuses_rope_kv(attn_meta):
            # Qwen3: the head norms read the rows in place and rope_kv reads v from them (no
            # slices); the same bits as the slice + norm path below (Ops.head_norms)
            qk = ops.head_norms(qkv_rows, norms["q_norm"], norms["k_norm"], eps, layer, T,
                                nq // E, nk // E)  # fmt: skip
        if qk is not None:
            q, kv = ops.rope_kv_write((qk, qkv_rows), cos, sin, kv, layer, batch, attn_meta,
                                      nq // E)  # fmt: skip
            return _attention_and_mlp(lp, x, q, kv, layer, batch, cfg, ops, norms, attn_meta,
                                      rows, next_norm, ffn)  # fmt: skip
        qkv = qkv_rows[:T]
        q, k, v = qkv[:, :nq], qkv[:, nq : nq + nk], qkv[:, nq + nk :]
    else:
        q = ops.matmul(h, lp["wq"])[:T]
        k = ops.matmul(h, lp["wk"])[:T]
        v = ops.matmul(h, lp["wv"])[:T]
    if cfg.qkv_bias:
        q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q = q.reshape(T, -1, E)
    k = k.reshape(T, -1, E)
    v = v.reshape(T, -1, E)
    if cfg.qk_norm:
        q = _head_norm(ops, q, norms["q_norm"], eps, layer)
        k = _head_norm(ops, k, norms["k_norm"], eps, layer)
    if ops.fuses_rope_kv(attn_meta):  # RoPE + K/V write + q's attention layout: one kernel
        plain = qkv_rows is not None and not (cfg.qkv_bias or cfg.qk_norm)
        q, kv = ops.rope_kv_write(qkv_rows if plain else (q, k, v), cos, sin, kv, layer, batch,
                                  attn_meta, q.shape[1])  # fmt: skip
    else:
        q = ops.rope(q, cos, sin)
        k = ops.rope(k, cos, sin)
        kv = {
            "k": write_kv(kv["k"], layer, k, batch.slot_mapping),
            "v": write_kv(kv["v"], layer, v, batch.slot_mapping),
        }
    return _attention_and_mlp(lp, x, q, kv, layer, batch, cfg, ops, norms, attn_meta, rows,
                              next_norm, ffn)  # fmt: skip


def _attention_and_mlp(
    lp: dict, x: jax.Array, q: Any, kv: dict, layer: jax.Array, batch: StepBatch,
    cfg: ModelConfig, ops: Ops, norms: dict, attn_meta: dict | None, rows: int,
    next_norm: jax.Array | None, ffn: dict | None = None,
) -> tuple[jax.Array, dict, jax.Array | None]:  # fmt: skip
    """The rest of `layer_forward` once the query is ready and the cache written."""
    E = cfg.head_dim
    eps = cfg.rms_norm_eps
    T = batch.token_ids.shape[0]  # the rows o_proj's and down_proj's all-reduce must reduce
    attn = ops.attention(q, kv, layer, batch, E**-0.5, meta=attn_meta, out_rows=rows)
    attn = attn.reshape(rows, -1)
    if cfg.o_bias:
        x = x + (ops.row_matmul(attn, lp["wo"]) + lp["bo"])
        h = ops.rms_norm(x, norms["mlp_norm"], eps, layer)
    else:  # o_proj's combine, the residual add and the norm: one kernel where it can be
        x, h = ops.residual_norm(x, attn, lp["wo"], norms["mlp_norm"], eps, layer, live=T)
    if cfg.is_moe:  # the expert / dense FFN by the layer's kind (jdet/moe.py)
        x = x + ffn_forward(ffn or {}, h, layer, cfg, ops, batch.slot_mapping)
        h_next = None if next_norm is None else ops.rms_norm(x, next_norm, eps, layer)
        return x, kv, h_next
    if ops.fused:  # fused gate|up, as wqkv (SwiGLU in its epilogue where Ops can)
        act = ops.gate_up_act(h, lp["w_gate_up"], x.dtype)
    else:
        gate = ops.matmul(h, lp["w_gate"])
        up = ops.matmul(h, lp["w_up"])
        act = swiglu_act(gate, up, x.dtype)
    if next_norm is not None:
        x, h_next = ops.residual_norm(x, act, lp["w_down"], next_norm, eps, layer, live=T)
        return x, kv, h_next
    x = ops.add_row_matmul(x, act, lp["w_down"], live=T)
    return x, kv, None


def embed(params: dict, token_ids: jax.Array) -> jax.Array:
    return jnp.take(params["embed"], token_ids, axis=0)


def lm_head_weight(params: dict, cfg: ModelConfig, ops: Ops) -> jax.Array:
    """The tied embedding's transpose, unless the weights hold an `lm_head` (`Ops.untied`)."""
    return params["embed"].T if cfg.tie_word_embeddings and not ops.untied else params["lm_head"]


# The layer loop of the invariant modes (`Ops.layer_while_loop`): a `lax.while_loop` whose
# counter is the layer, or a `lax.scan` over the stacked weights and arange(L). The same
# arithmetic either way. "none" keeps the scan: jdet/train.py differentiates its forward, and a
# while loop has no VJP.
# On a GPU, every mode runs its layers unrolled (`Ops.unroll_layers_gpu`; "none" too: its
# fastest form there, and still differentiable): L calls of one jitted layer function (traced and
# lowered once, inlined by XLA), each reading its layer's weights at a constant offset. Why: XLA
# runs a loop's body from the host as a CUDA graph and re-records it every iteration
# (`command_buffer::update`, the Mosaic matmuls stream-captured again: tens of microseconds of
# host time a layer, benchmarks/step_timeline.py), so a small model's step held the host longer
# than the device: the engine was host-bound. Unrolled, the step is a few graphs, re-recorded only
# when a step's buffers move, which the async engine hides behind the previous step
# (BENCHMARKS.md). Same kernels on the same operands: the same bits
# (tests/jdet/test_invariance_gpu.py).
UNROLL_BELOW_BYTES = 128 << 20  # unroll_layers_gpu = 2 (0.6B: 30 MiB a layer, 8B: 368-416)


def hidden_states(
    params: dict, cfg: ModelConfig, kv: dict, batch: StepBatch, ops: Ops
) -> tuple[dict, jax.Array]:
    """All layers; returns the updated cache and the final hidden states [T, D] (pre-norm).

    Per-step work that does not depend on the layer is done here, once, not in the scan (XLA
    does not hoist it): the attention kernel's batch-derived operands (`Ops.attention_meta`),
    the row padding of the residual stream (`Ops.row_pad`), the RoPE tables."""
    T = batch.token_ids.shape[0]
    rows = ops.row_pad(T)
    x = embed(params, batch.token_ids)
    if rows > T:
        x = jnp.pad(x, ((0, rows - T), (0, 0)))
    cos, sin = rope_tables(cfg, batch.positions)
    layers = dict(params["layers"])
    norms = {n: layers.pop(n) for n in (NORMS if cfg.qk_norm else NORMS[:2])}
    ffn = pop_ffn(layers, cfg)  # a MoE model's FFN stacks: not over every layer (jdet/moe.py)
    L = jax.tree_util.tree_leaves(layers)[0].shape[0]
    meta = ops.attention_meta(batch, kv, _q_heads(layers, kv, cfg, ops))
    # Weights that read their layer in place (the CPU's blocked weights, pallas_kernels/
    # xla_blocked.py) stay out of the scan's xs too: XLA CPU copies each scanned slice.
    in_place = {k: layers.pop(k) for k in list(layers) if hasattr(layers[k], "at_layer")}

    # Down_proj's combine + residual add folded into the next layer's attention norm
    # (`Ops.fold_down_norm`): layer 0's norm runs here, layer l computes layer l+1's, and the last
    # layer's (of `next_norm`'s wrapped row 0) is discarded: the final norm stays in
    # `logits_from_hidden`. The roll is one [L, D] copy a step, not one per layer.
    h = next_norm = None
    if ops.fold_down_norm():
        h = ops.rms_norm(x, norms["attn_norm"], cfg.rms_norm_eps, jnp.int32(0))
        next_norm = jnp.roll(norms["attn_norm"], -1, axis=0)

    def body(carry: tuple, xs: tuple) -> tuple:
        x, h, kv = carry
        lp, layer = xs
        lp = {**lp, **{k: w.at_layer(layer) for k, w in in_place.items()}}
        x, kv, h = layer_forward(
            lp, x, kv, layer, batch, cos, sin, cfg, ops, norms, meta, h=h, next_norm=next_norm,
            ffn=ffn,
        )
        return (x, h, kv), None

    # Not a mixture of experts whose experts run `ragged_dot` (Ops.ragged_experts): XLA on a GPU
    # rewrites it into a dense dot over every expert, whose operands (the layer's [E, D, F]
    # weights as arrays, the rows masked per expert) unrolled layers could all hold at once; a
    # loop holds one layer's. The grouped kernels read the experts in place and unroll.
    if _unroll(layers, L, ops) and not in_place and not (ffn and ops.ragged_experts):

        @jax.jit
        def one_layer(layer: jax.Array, x: jax.Array, h: Any, kv: dict) -> tuple:
            lp = _layer_weights(layers, layer)
            (x, h, kv), _ = body((x, h, kv), (lp, layer))
            return x, h, kv

        for i in range(L):
            x, h, kv = one_layer(jnp.int32(i), x, h, kv)
        return kv, x[:T]

    # Looped (off a GPU, or layers too large to gain from unrolling). Not lax.scan(unroll=2 or
    # 4): with it the weight slices are copied out of the stack, not read in place (a step over
    # twice as slow on a GPU).
    if not (ops.layer_while_loop and ops.invariant):  # "none" stays differentiable (train.py)
        xs = (layers, jnp.arange(L, dtype=jnp.int32))
        (x, _, kv), _ = jax.lax.scan(body, (x, h, kv), xs)
        return kv, x[:T]

    # The loop's own counter is the layer index: the same layer bodies as the scan over
    # (weights, arange(L)), without the per-layer slice of arange(L) (an async copy a layer on a
    # GPU) that the scan's xs needed.
    def step(carry: tuple) -> tuple:
        layer, x, h, kv = carry
        lp = _layer_weights(layers, layer)
        (x, h, kv), _ = body((x, h, kv), (lp, layer))
        return layer + 1, x, h, kv

    _, x, _, kv = jax.lax.while_loop(lambda c: c[0] < L, step, (jnp.int32(0), x, h, kv))
    return kv, x[:T]


def _layer_weights(layers: dict, layer: jax.Array) -> dict:
    """Layer `layer`'s weights, each read in place from its [L, ...] stack (a dynamic index)."""
    return jax.tree.map(lambda w: jax.lax.dynamic_index_in_dim(w, layer, keepdims=False), layers)


def _unroll(layers: dict, num_layers: int, ops: Ops) -> bool:
    """Whether the layer loop runs unrolled (`Ops.unroll_layers_gpu`): on a GPU only, any mode."""
    if not ops.unroll_layers_gpu or not backend().gpu:
        return False
    per_layer = sum(w.size * w.dtype.itemsize for w in jax.tree_util.tree_leaves(layers))
    return ops.unroll_layers_gpu == 1 or per_layer // num_layers < UNROLL_BELOW_BYTES


def _q_heads(layers: dict, kv: dict, cfg: ModelConfig, ops: Ops) -> int:
    """Query heads of this (possibly tensor-parallel) shard, read off the weight shapes."""
    if ops.fused:
        nk = kv["k"].shape[1] * cfg.head_dim  # kv is [L, K, P, B, E]
        return (layers["wqkv"].shape[-1] - 2 * nk) // cfg.head_dim
    return layers["wq"].shape[-1] // cfg.head_dim


def logits_from_hidden(params: dict, cfg: ModelConfig, x: jax.Array, ops: Ops) -> jax.Array:
    h = ops.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
    return ops.matmul(h, lm_head_weight(params, cfg, ops), out_dtype=jnp.float32)


def forward(
    params: dict, cfg: ModelConfig, kv: dict, batch: StepBatch, ops: Ops
) -> tuple[dict, jax.Array]:
    """One step: returns (updated cache, f32 logits for `batch.logits_rows` [N, V])."""
    kv, x = hidden_states(params, cfg, kv, batch, ops)
    return kv, logits_from_hidden(params, cfg, x[batch.logits_rows], ops)
