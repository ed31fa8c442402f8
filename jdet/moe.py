"""The mixture-of-experts FFN (Qwen3-MoE, Mixtral): router, top-k, experts, combine.

Per token t of h[T, D] (the post-attention norm's output), every step alike:
1. router logits l[t] = h[t] @ router [D, E] through `Ops.matmul` with an f32 result (the
   invariant BIO matmul in the invariant modes);
2. p = softmax(l[t]) in f32: the max (exact in any order), exp(l - max), their sum over E by a
   halving tree of element-wise adds (`tree_sum`), one division. Nothing here is a reduction
   across tokens, so a token's probabilities are its own whatever the batch;
3. the top k of p by `lax.top_k`, whose documented order puts the lower index first among equal
   values: ties go to the lower expert index. With `norm_topk_prob` the k values are divided by
   their halving-tree sum (Mixtral always; Qwen3-MoE as its config says). Qwen3-MoE rounds the
   weights to the model's dtype, as transformers does; Mixtral keeps them f32;
4. the T*k (token, slot) rows (row t*k + j: token t's j-th choice) are laid out by expert
   (pallas_kernels/grouped_matmul.py `layout`) and run through the grouped matmul, whose
   reduction plan is fixed by the weight shapes (a row's bits do not depend on how many rows its
   expert serves): gate and up (`Ops.grouped_gate_up`, BIO, reading each row's token from h),
   SwiGLU, down (`Ops.grouped_row_matmul`: the TBIK tree in "tp", whose leaves a TP shard of the
   experts' F holds and the tree all-reduce finishes, per (token, slot) row), rounded to the
   model's dtype. Only the step's T tokens have rows: the rows the residual stream carries past
   T (`Ops.row_pad`) get a zero FFN output without entering the layout, and the padding tokens
   within T (slot -1) are left out of it: neither takes a tile or reads an expert;
5. out[t] = sum over slots j = 0..k-1, in that order (the tie-broken top-k order, never the order
   rows arrived at an expert), of w[t, j] * y[t, j] in f32, rounded once. Each product is formed
   from exact partial products (`_exact_product`), so an FMA contraction XLA's CPU backend may
   make (pallas_kernels/xla_fixed.py, "FMA contraction") cannot change a bit.
"none" runs the same routing and the same grouped kernels on a GPU (BIO for the down projection),
`lax.ragged_dot` elsewhere (XLA's own order), and combines with plain products.

Mixed dense and sparse layers (Qwen3-MoE's `mlp_only_layers` / `decoder_sparse_step`): the
model's one layer loop stays one loop. The dense MLP weights are stacked over the dense layers and
the experts over the sparse ones (jdet/params.py); `pop_ffn` takes both out of the loop's weights
and `ffn_forward` picks a layer's kind from a static table: statically where every layer is of one
kind (every published Qwen3-MoE and Mixtral checkpoint: no branch at all), by `lax.cond` on the
layer index otherwise (one compiled body with both branches; only the taken one runs). Splitting
the loop into runs of same-kind layers would compile one loop per run and change the loop code
every dense model runs; the cond costs a predicate per layer on the rare mixed model only.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet.config import ModelConfig
from jdet.ops import Ops, swiglu_act
from pallas_kernels import backend
from pallas_kernels.xla_fixed import exp_rows, hi12, tree_sum

DENSE_FFN = ("w_gate", "w_up", "w_down", "w_gate_up")
SPARSE_FFN = ("router", "expert_gate", "expert_up", "expert_down")


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """(weights f32 [T, k], expert ids int32 [T, k]) of f32 router logits [T, E] (module
    docstring, steps 2-3). Row-local: each row's result depends on that row only."""
    logits = logits.astype(jnp.float32)
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    # on a CPU, exp's bits follow the array's row count unless every block has one shape
    e = exp_rows(shifted) if backend().cpu else jnp.exp(shifted)
    probs = e / tree_sum(e)[:, None]
    top, ids = lax.top_k(probs, k)  # equal values: the lower index first (documented)
    if normalize:
        top = top / tree_sum(top)[:, None]
    return top, ids.astype(jnp.int32)


def _exact_product(a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b (f32) as a fixed sum of exact partial products: each operand cut into its 12
    leading significant bits and the exact rest (`xla_fixed.hi12`), so every product has <= 24
    significant bits and is exact in f32. Contracting any of them into an add changes nothing,
    so the bits do not depend on the code XLA generates for the fusion's shape."""
    ah, bh = hi12(a), hi12(b)
    al, bl = a - ah, b - bh
    return ah * bh + ((ah * bl + al * bh) + al * bl)


def combine_slots(w: jax.Array, y: jax.Array, out_dtype: Any, invariant: bool) -> jax.Array:
    """sum_j w[:, j] * y[:, j] over slots j in order (w f32 [T, k], y [T, k, D]), in f32, rounded
    once to out_dtype."""
    y = y.astype(jnp.float32)
    mul = _exact_product if invariant else (lambda a, b: a * b)
    acc = mul(w[:, 0, None], y[:, 0])
    for j in range(1, w.shape[1]):
        acc = acc + mul(w[:, j, None], y[:, j])
    return acc.astype(out_dtype)


def moe_block(
    lp: dict, h: jax.Array, cfg: ModelConfig, ops: Ops, real: jax.Array | None = None,
    layer: jax.Array | None = None, tokens: int | None = None,
) -> jax.Array:  # fmt: skip
    """The expert FFN of h[T', D] (module docstring) with one layer's weights `lp`: router [D, E],
    expert_gate/expert_up [E, D, F], expert_down [E, F, D] (F: this device's shard); with
    `layer`, `lp` holds the stacks of the sparse layers ([L', ...]) and the kernels read that
    entry in place: an expert stack's entry as an array would be a copy of every expert
    (pallas_kernels/grouped_matmul.py, "Stacked weights"). `tokens` (static, default T'): the
    step's tokens, the first rows of h; the rows past them (the residual stream's CTA padding)
    get zeros. `real` (bool [tokens]): the step's real tokens; the others (bucket padding) take
    no expert tile and give zeros, so a padded decode step still reads only its tokens'
    experts."""
    t, d = h.shape
    n = t if tokens is None else tokens
    k = cfg.num_experts_per_tok
    router = lp["router"] if layer is None else _at(lp["router"], layer)  # [D, E]: small
    logits = ops.matmul(h, router, out_dtype=jnp.float32)  # all T' rows: the matmul's own shape
    w, ids = route(logits[:n], k, cfg.norm_topk_prob)
    if cfg.moe == "qwen3_moe":  # transformers rounds Qwen3-MoE's weights to the model dtype
        w = w.astype(h.dtype).astype(jnp.float32)
    if real is not None:  # id E: left out of the grouped layout
        ids = jnp.where(real[:, None], ids, cfg.num_experts)
    tiles = ops.grouped_tiles(ids.reshape(-1), cfg.num_experts)
    live = cfg.moe_intermediate_size  # past it the plan's padding: zeros
    gate, up = ops.grouped_gate_up(h, lp["expert_gate"], lp["expert_up"], tiles, k, live, layer)
    act = swiglu_act(gate, up, h.dtype)  # [n*k, F], row order
    y = ops.grouped_row_matmul(act, lp["expert_down"], tiles, live, layer)  # [n*k, D]
    out = combine_slots(w, y.reshape(n, k, d), h.dtype, ops.invariant)
    return out if n == t else jnp.pad(out, ((0, t - n), (0, 0)))


def pop_ffn(layers: dict, cfg: ModelConfig) -> dict:
    """For a mixture-of-experts model, take its FFN stacks (dense over `cfg.dense_layers`,
    experts over `cfg.sparse_layers`) out of the layer loop's weights `layers` (modified) and
    return them; {} for a dense model, whose FFN stays in the loop's weights."""
    if not cfg.is_moe:
        return {}
    return {n: layers.pop(n) for n in (*DENSE_FFN, *SPARSE_FFN) if n in layers}


def _at(w: Any, i: jax.Array) -> Any:
    """Stack entry i of w: read in place (`at_layer`, the CPU's blocked weights) or indexed."""
    if hasattr(w, "at_layer"):
        return w.at_layer(i)
    return lax.dynamic_index_in_dim(w, i, keepdims=False)


def _local_index(layers: tuple[int, ...], num_layers: int) -> np.ndarray:
    """Model layer -> its position in a stack over `layers` (0 for the layers not in it)."""
    table = np.zeros(num_layers, np.int32)
    table[list(layers)] = np.arange(len(layers), dtype=np.int32)
    return table


def dense_ffn(lp: dict, h: jax.Array, ops: Ops) -> jax.Array:
    """The dense SwiGLU MLP (jdet/model.py's, without the fused-norm variants)."""
    if ops.fused:
        act = ops.gate_up_act(h, lp["w_gate_up"], h.dtype)
    else:
        act = swiglu_act(ops.matmul(h, lp["w_gate"]), ops.matmul(h, lp["w_up"]), h.dtype)
    return ops.row_matmul(act, lp["w_down"])


def ffn_forward(
    ffn: dict, h: jax.Array, layer: jax.Array, cfg: ModelConfig, ops: Ops,
    slot_mapping: jax.Array | None = None,
) -> jax.Array:  # fmt: skip
    """Layer `layer`'s FFN of a mixture-of-experts model on h[T', D] (`pop_ffn`'s stacks).
    `slot_mapping` [T <= T']: the step's K/V slots, -1 on padding rows (jdet/batch.py), which
    with the rows past T skip the experts (`moe_block`'s `real` and `tokens`)."""
    t = h.shape[0] if slot_mapping is None else slot_mapping.shape[0]
    if ops.row_shards > 1 and t < h.shape[0]:
        # Under TP only the step's rows: the FFN's all-reduce would send `Ops.row_pad`'s
        # padding rows too (they come back as zeros: no real row reads them)
        out = ffn_forward(ffn, h[:t], layer, cfg, ops, slot_mapping)
        return jnp.pad(out, ((0, h.shape[0] - t), (0, 0)))
    sparse = {n: ffn[n] for n in SPARSE_FFN}
    dense = {n: ffn[n] for n in DENSE_FFN if n in ffn}
    real = None if slot_mapping is None else slot_mapping >= 0
    tokens = None if slot_mapping is None else slot_mapping.shape[0]

    def run_sparse(h: jax.Array) -> jax.Array:
        i = jnp.asarray(_local_index(cfg.sparse_layers, cfg.num_layers))[layer]
        return moe_block(sparse, h, cfg, ops, real, layer=i, tokens=tokens)

    if not cfg.dense_layers:
        return run_sparse(h)

    def run_dense(h: jax.Array) -> jax.Array:
        i = jnp.asarray(_local_index(cfg.dense_layers, cfg.num_layers))[layer]
        return dense_ffn({n: _at(w, i) for n, w in dense.items()}, h, ops)

    is_sparse = np.zeros(cfg.num_layers, bool)
    is_sparse[list(cfg.sparse_layers)] = True
    return lax.cond(jnp.asarray(is_sparse)[layer], run_sparse, run_dense, h)
