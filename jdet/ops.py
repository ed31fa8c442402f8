"""The one dispatch point between the model and its arithmetic, chosen by invariance mode.

Why: the model is written once; `invariance` decides which implementation every reduction uses.
  "none"  — the fastest non-invariant path: XLA/cuBLAS matmuls and norms, and on a GPU the
            Pallas paged-attention kernel with a KV split chosen from the step's shapes (more,
            shorter partitions when few sequences decode, so a batch-1 step fills the GPU); off a
            GPU, XLA's gather attention (`paged_attention_xla`); experts: `ragged_experts`. Not
            invariant: the matmuls' and the split's reduction orders follow the batch.
  "batch" — Pallas kernels whose reduction order depends on model shapes only (BIO matmul
            everywhere, paged attention with fixed KV partitions, invariant RMSNorm/log_softmax).
  "tp"    — as "batch", and the row-parallel projections (o_proj, down_proj) use the tree-reduce
            matmul (TBIK), whose tree continues across devices, so TP=1..8 give the same bits.
Under tensor parallelism `sharding/` sets `row_partial`/`row_reduce`: a device's f32 partial of a
row-parallel projection as leaf groups [G, T, N], and their cross-device sum (tree all-reduce in
"tp", psum in "batch"; sharding's `tree_allreduce_parts`), which also adds the residual.
Elementwise work (RoPE, SwiGLU, residual adds) has no reduction and is shared by every mode.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels import (
    backend,
    log_softmax,
    matmul,
    paged_attention,
    rms_norm,
    swiglu,
    tree_matmul,
    xla_fixed,
)
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.decode_tiles import DecodeTiles
from pallas_kernels.paged_attention import (
    AttentionConfig,
    _pad_rows,
    none_partition,
    paged_attention_xla,
    step_attention_meta,
)
from pallas_kernels.paged_attention_mosaic_decode import SPLIT_MAX_TOKENS
from pallas_kernels.rms_norm import add_rms_norm, head_rms_norm
from pallas_kernels.rope_kv import QueryTiles, rope_kv
from pallas_kernels.tree_matmul import tree_matmul_parts

MODES = ("tp", "batch", "none")


def swiglu_act(gate: jax.Array, up: jax.Array, out_dtype: Any) -> jax.Array:
    """The MLP's activation silu(gate) * up in f32, rounded once to out_dtype (HF's order):
    the model's unfused projections and `Ops.gate_up_act`'s fallback share it."""
    return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(out_dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x[T, n, E] rotated with HF's rotate-half convention, computed in f32."""
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, None, :] + rot * sin[:, None, :]).astype(x.dtype)


def check_mode(invariance: str) -> str:
    if invariance not in MODES:
        raise ValueError(f"invariance={invariance!r} is not a mode; use one of {MODES}")
    return invariance


def _xla_matmul(x: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
    """The "none" mode's projection: XLA's fastest plan (f32 accumulation either way).

    On a GPU (benchmarks/scan_dot_probe.py: a scan over weights sliced from the stack, as in the
    model) cuBLAS reads a weight slice in place (jdet/step.py turns XLA's Triton GEMMs, which
    copy it first, off for "none") provided the dot outputs bf16 directly (cuBLAS rounds its f32
    accumulator once, as f32-then-cast does): an f32 output at M = 1 made XLA convert the weights
    to f32 first. An f32 output (the LM head) pads its rows to 8, where cuBLAS takes bf16
    operands with an f32 result as they are."""
    if not backend().gpu:
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    if jnp.dtype(out_dtype) == x.dtype:
        return jnp.dot(x, w, preferred_element_type=out_dtype)
    m = x.shape[0]
    xp = jnp.pad(x, ((0, 8 - m), (0, 0))) if m < 8 else x
    return jnp.dot(xp, w, preferred_element_type=jnp.float32)[:m].astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class Ops:
    invariance: str = "tp"
    row_partial: Callable[[jax.Array, jax.Array], jax.Array] | None = None
    row_reduce: Callable[..., jax.Array] | None = None
    # Devices the row-parallel input width is split over (sharding/tp.py make_tp_ops): the
    # experts' down projection computes its own subtree of that many (`grouped_row_matmul`).
    row_shards: int = 1
    # KV partition of the invariant paged attention (tokens), part of the reduction plan. 256, not
    # 512: a batch-1 decode at 1k context then has twice the programs, which a decode step gains
    # more from than a long prefill chunk's attention loses (BENCHMARKS.md).
    attn_partition: int = 256
    # Carry the residual stream padded to the matmuls' CTA rows (`row_pad`). Under TP > 1 only
    # in "tp", whose all-reduce skips the padding rows (`add_row_matmul`); psum would send them.
    pad_rows: bool = True
    # The weight layout the model reads, stated rather than probed from the params' keys: the
    # plan's prepared weights (jdet/plan.py `prepare_params`, the sharded runtime's) hold an
    # untied, vocab-padded `lm_head` (`untied`), and q|k|v, gate|up fused into `wqkv`,
    # `w_gate_up` where `fuse_default()` (`fused`). Both False: the checkpoint's own layout.
    fused: bool = False
    untied: bool = False
    # Fold o_proj's tree combine, the residual add and the MLP's RMSNorm into one kernel
    # (`residual_norm`; same bits). Only where the tree matmul runs on Hopper's Mosaic kernel,
    # and only without a cross-device combine: make_tp_ops sets it for one shard only (there
    # `row_reduce` is the identity and is skipped).
    fuse_residual_norm: bool = True
    # The same fold for down_proj: its combine, the residual add and the *next* layer's attention
    # norm in one kernel (`fold_down_norm`; same bits; a faster decode step: BENCHMARKS.md).
    fuse_down_norm: bool = True
    # RoPE, the K/V cache write and the query's gather into the attention kernel's tile layout
    # as one Pallas kernel (`rope_kv`, pallas_kernels/rope_kv.py) instead of ~5 XLA fusions a
    # layer, where the Pallas paged attention runs (ignored on the CPU's xla_fixed path and by
    # XLA's gather attention). Same arithmetic as apply_rope; that Triton contracts no FMA where
    # XLA does not is checked on the GPU (tests/pallas_kernels/test_rope_kv.py, `gpu`).
    rope_kv: bool = True
    # The split attention's merge kernel writes the final [rows, H, E] output itself, padding
    # rows zeroed, instead of a gather + select fusion after it (`direct_out` of
    # pallas_kernels/paged_attention_pallas.py; the same values in the same places): one launch
    # fewer per layer.
    attn_direct_out: bool = True
    # How the Pallas paged attention loads and launches (`AttentionConfig`), and how the Hopper
    # matmuls spread a decode's few rows over CTAs (`DecodeTiles`, which `row_pad` follows):
    # kernel configs that never change a value or an order; benchmarks vary them.
    attn_config: AttentionConfig = AttentionConfig()
    decode_tiles: DecodeTiles = DecodeTiles()
    # Qwen3's q/k head norms read from the fused projection's rows in one launch (`head_norms`,
    # the same bits); False slices and normalises them as separate ops.
    head_norms_in_place: bool = True
    # The invariant modes' layer loop is a while loop over the layer index (False: a scan); on a
    # GPU the layers run unrolled (0: never, 1: always, 2: layers under model.UNROLL_BELOW_BYTES).
    # jdet/model.py says why; the same bits every way.
    layer_while_loop: bool = True
    unroll_layers_gpu: int = 1

    def __post_init__(self) -> None:
        check_mode(self.invariance)

    invariant = property(lambda self: self.invariance != "none")

    # -- the rows the residual stream carries ---------------------------------------------------
    def row_pad(self, t: int) -> int:
        """Rows the model carries for a T-token step: on Hopper in the invariant modes, T padded
        to the Mosaic matmuls' CTA rows (64 for T <= 64, else a multiple of 128), so no matmul
        pads its input; matmul rows are independent, so no real row's bit changes. T elsewhere."""
        if not (self.invariant and self.pad_rows and backend().hopper):
            return t
        from pallas_kernels import matmul_mosaic  # slow Mosaic GPU import: Hopper only

        small = matmul_mosaic.decode_rows(t, self.decode_tiles)
        m = matmul_mosaic.SMALL_M_ROWS if small else matmul_mosaic.BLOCK_M
        return -(-t // m) * m

    # -- reductions over the hidden dimension ---------------------------------------------------
    def rms_norm(
        self, x: jax.Array, w: jax.Array, eps: float, layer: jax.Array | None = None
    ) -> jax.Array:
        """RMSNorm of x[T, D]; with `layer`, w is the stack [L, D] of every layer's weight."""
        if self.invariant:
            return rms_norm(x, w, eps, layer=layer)
        if layer is not None:
            w = w[layer]
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y.astype(x.dtype) * w).astype(x.dtype)

    def matmul(self, x: jax.Array, w: jax.Array, out_dtype: Any = None) -> jax.Array:
        """Column-parallel / unsharded projection x[T, in] @ w[in, out]."""
        out_dtype = out_dtype or x.dtype
        if self.invariant:
            return matmul(x, w, out_dtype=out_dtype, tiles=self.decode_tiles)
        return _xla_matmul(x, w, out_dtype)

    def gate_up_act(self, h: jax.Array, w: jax.Array, out_dtype: Any) -> jax.Array:
        """silu(gate) * up of the fused gate|up projection w [D, 2F]: on Hopper in the invariant
        modes one Mosaic kernel with SwiGLU in its epilogue (pallas_kernels/swiglu.py: its own
        bits, the same for every M), elsewhere the projection then XLA's SwiGLU."""
        if self.invariant:
            if swiglu.supported(w.shape[0], w.shape[1], w.dtype):
                return swiglu.matmul_swiglu(h, w, out_dtype, self.decode_tiles)
        gate, up = jnp.split(self.matmul(h, w), 2, axis=-1)
        return swiglu_act(gate, up, out_dtype)

    def row_matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
        """Row-parallel projection (o_proj, down_proj): the reduction TP splits across devices."""
        if self.row_reduce is not None:
            assert self.row_partial is not None
            return self.row_reduce(self.row_partial(x, w)).astype(x.dtype)
        if self.invariance == "tp":
            return tree_matmul(x, w, out_dtype=x.dtype, tiles=self.decode_tiles)
        return self.matmul(x, w)

    def add_row_matmul(self, x: jax.Array, a: jax.Array, w: jax.Array,
                       live: int | None = None) -> jax.Array:  # fmt: skip
        """x + row_matmul(a, w); under TP the combine adds x (on Hopper inside the all-reduce
        kernel, same bits) over the step's `live` rows: `row_pad`'s padding keeps x's values."""
        if self.row_reduce is not None and self.row_partial is not None:
            return self.row_reduce(self.row_partial(a, w), residual=x, live_rows=live)
        return x + self.row_matmul(a, w)

    # -- mixture-of-experts: the grouped matmul (pallas_kernels/grouped_matmul.py) ---------------
    @property
    def ragged_experts(self) -> bool:
        """Whether the experts run XLA's `lax.ragged_dot`: "none" off a GPU. On a GPU ragged_dot is
        dense over every expert, so "none" runs the grouped kernels (the chosen experts only)."""
        return not self.invariant and not backend().gpu

    def grouped_tiles(self, ids: jax.Array, num_groups: int) -> Any:
        """The grouped layout of rows with group (expert) `ids` [R] (ragged_dot's: sorted)."""
        return gm.layout(ids, num_groups, "xla" if self.ragged_experts else None)

    def grouped_gate_up(
        self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, tiles: Any, per_src: int,
        live: int | None = None, layer: Any = None,
    ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """The experts' gate and up projections of the layout's rows (row r: x[r // per_src]) ->
        two [R, out], BIO, one launch on a GPU. `live`: the out width before `pad_params`' zeros
        (one shard skips those blocks: same bits). `layer`: stacks [L, G, in, out], in place."""
        if self.ragged_experts:
            return tuple(gm.grouped_matmul_xla(x, w, tiles, per_src=per_src, layer=layer)
                         for w in (w_gate, w_up))  # fmt: skip
        live_n = live if self.row_shards == 1 and live and live < w_gate.shape[-1] else None
        return gm.grouped_matmul_pair(x, w_gate, w_up, tiles, per_src=per_src, live_n=live_n,
                                      layer=layer)  # fmt: skip

    def grouped_row_matmul(
        self, x: jax.Array, w: jax.Array, tiles: Any, live: int | None = None, layer: Any = None
    ) -> jax.Array:
        """The experts' row-parallel down_proj of the layout's rows x[R, in] -> [R, out] (row
        order, x's dtype): the tree in "tp"; under TP each device's f32 partial (its subtree in
        "tp") is combined per row by `row_reduce` before the cast. `live`, `layer`: as above."""
        f32 = jnp.float32
        n = self.row_shards
        live_k = live if n == 1 and live and live < w.shape[-2] else None
        if self.invariance == "tp":
            k_total = w.shape[-2] * n
            part = gm.grouped_tree_partial(x, w, tiles, k_total=k_total, num_shards=n,
                                           live_k=live_k, layer=layer)  # fmt: skip
        elif self.ragged_experts:
            part = gm.grouped_matmul_xla(x, w, tiles, f32, layer=layer)
        else:  # "batch", and "none" on a GPU: K in one sequential leaf
            part = gm.grouped_matmul(x, w, tiles, f32, live_k=live_k, layer=layer)
        if self.row_reduce is not None:
            part = self.row_reduce(part[None])
        return part.astype(x.dtype)

    def residual_norm(
        self, x: jax.Array, a: jax.Array, w: jax.Array, norm_w: jax.Array, eps: float,
        layer: jax.Array, live: int | None = None,
    ) -> tuple[jax.Array, jax.Array]:  # fmt: skip
        """(x + row_matmul(a, w), its RMSNorm with row `layer` of the stacked norm_w [L, D]).

        In "tp" without TP sharding on Hopper, one kernel (`rms_norm.add_rms_norm`) does the
        tree matmul's combine, the add and the norm: one launch instead of two per layer, the
        same bits (the same f32 additions in the same order, the same roundings)."""
        if self.invariance == "tp" and self.fuse_residual_norm:
            parts = tree_matmul_parts(a, w, tiles=self.decode_tiles)
            if parts is not None:
                return add_rms_norm(x, parts, norm_w, eps, layer=layer)
        x = self.add_row_matmul(x, a, w, live)
        return x, self.rms_norm(x, norm_w, eps, layer)

    def fold_down_norm(self) -> bool:
        """Whether the model folds down_proj's combine + residual add into the next layer's
        attention norm (jdet/model.py hidden_states): where `residual_norm` is one kernel (Hopper,
        "tp", one shard); elsewhere it would only add a discarded norm for the last layer."""
        if not (self.fuse_down_norm and self.fuse_residual_norm and self.invariance == "tp"):
            return False
        return backend().hopper

    # -- position encoding ------------------------------------------------------------------------
    def rope(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        """RoPE of x[T, n, E] by the step's cos, sin [T, E] (`apply_rope`). On the
        CPU's fixed-order path (invariant modes) `xla_fixed.rope`: the same f32 expression with
        exact partial products, whose bits no FMA contraction can change, so they do not depend
        on the shape XLA compiles the step for (a 1-token step's RoPE rounded otherwise)."""
        if self.invariant and backend().xla_fixed:
            return xla_fixed.rope(x, cos, sin)
        return apply_rope(x, cos, sin)

    # -- attention over the paged cache ---------------------------------------------------------
    def _attn_partition(self, t: int, batch: Any, kv: dict) -> int | None:
        """The Pallas kernel's KV partition, or None where XLA's gather attention runs."""
        if self.invariant:
            if backend().xla_fixed:
                return None
            return self.attn_partition
        if backend().gpu:  # the Mosaic looped launch folds partitions in its CTA: 512
            mosaic = self.attn_kernel(t) == "mosaic"
            return 512 if mosaic else none_partition(t, batch.page_table.shape, kv["k"].shape)
        return None

    def attention_meta(self, batch: Any, kv: dict, q_heads: int) -> dict | None:
        """The attention kernel's batch-derived operands for this step (the same for every
        layer), or None where no Pallas kernel runs; the model computes it once per step."""
        t = batch.token_ids.shape[0]
        ps = self._attn_partition(t, batch, kv)
        if ps is None:
            return None
        return step_attention_meta(
            batch.page_table, batch.context_lens, batch.query_start, batch.positions, t=t,
            q_heads=q_heads, cache_shape=kv["k"].shape, partition_size=ps,
            kernel=self.attn_kernel(t),
        )  # fmt: skip

    def attn_kernel(self, t: int) -> str:
        """The paged attention's family for a step of `t` tokens: "mosaic" on Hopper with
        JDET_ATTENTION=mosaic (`Backend.mosaic_attention`), in "none" for looped steps only."""
        if not backend().mosaic_attention:
            return "triton"
        return "mosaic" if self.invariant or t > SPLIT_MAX_TOKENS else "triton"

    def fuses_rope_kv(self, meta: dict | None) -> bool:
        """Whether the model runs `rope_kv` this step: the flag is on and the Pallas attention
        runs (`meta`, the step's `attention_meta`, exists only then)."""
        return bool(self.rope_kv) and meta is not None

    def head_norms(
        self, qkv: jax.Array, q_w: jax.Array, k_w: jax.Array, eps: float, layer: jax.Array,
        tokens: int, q_heads: int, kv_heads: int,
    ) -> jax.Array | None:  # fmt: skip
        """Qwen3's q and k head norms read from the fused projection's rows in one launch
        (`rms_norm.head_rms_norm`: the same bits as `rms_norm` on the sliced heads), for
        `rope_kv_write`'s (q|k rows, fused rows) form; None where `rms_norm` is not the Pallas
        kernel (the model then slices and normalises as before)."""
        if not (self.head_norms_in_place and self.invariant):
            return None
        if backend().xla_fixed:
            return None
        return head_rms_norm(qkv, q_w, k_w, eps, layer=layer, tokens=tokens, q_heads=q_heads,
                             kv_heads=kv_heads)  # fmt: skip

    def rope_kv_write(
        self, qkv: Any, cos: jax.Array, sin: jax.Array, kv: dict, layer: jax.Array, batch: Any,
        meta: dict, q_heads: int,
    ) -> tuple[Any, dict]:  # fmt: skip
        """(RoPE(q) as query tiles for `attention`, the cache with RoPE(k) and v written): one
        kernel (pallas_kernels/rope_kv.py). `qkv`: the fused projection's rows [T' >= T,
        (H + 2K) E] or (q[T, H, E], k, v[T, K, E])."""
        tiles, k, v = rope_kv(
            qkv, cos, sin, batch.slot_mapping, kv["k"], kv["v"], meta["tok_c"], layer=layer,
            q_heads=q_heads, rows=meta["lim"].shape[1],
        )  # fmt: skip
        return tiles, {"k": k, "v": v}

    def attention(
        self,
        q: Any,
        kv: dict,
        layer: jax.Array,
        batch: Any,
        scale: float,
        meta: dict | None = None,
        out_rows: int | None = None,
    ) -> jax.Array:
        """q[T, H, E] against layer `layer` of the cache, which already holds this step's K/V.
        `meta`: `attention_meta` of this step; returns [out_rows or T, H, E], zeros past T.
        q may be `rope_kv_write`'s query tiles (pallas_kernels/rope_kv.py QueryTiles)."""
        q_heads, t = None, None
        if isinstance(q, QueryTiles):
            q, q_heads, t = q.tiles, q.heads, q.tokens
        ps = self._attn_partition(t or q.shape[0], batch, kv)
        if ps is not None or self.invariant:  # invariant off a GPU: the kernel's XLA version
            return paged_attention(
                q, kv["k"], kv["v"], batch.page_table, batch.context_lens, batch.query_start,
                batch.positions, scale=scale, partition_size=ps or self.attn_partition,
                layer=layer, meta=meta, out_rows=out_rows, q_heads=q_heads,
                direct_out=bool(self.attn_direct_out), config=self.attn_config,
                kernel=self.attn_kernel(t or q.shape[0]),
            )  # fmt: skip
        if q_heads is not None:
            raise ValueError("query tiles (rope_kv) need the Pallas paged attention")
        return _pad_rows(paged_attention_xla(
            q,
            kv["k"],
            kv["v"],
            batch.page_table,
            batch.context_lens,
            batch.query_start,
            batch.positions,
            scale=scale,
            layer=layer,
        ), out_rows)

    # -- reductions over the vocabulary -----------------------------------------------------------
    def log_softmax(self, logits: jax.Array) -> jax.Array:
        if self.invariant:
            return log_softmax(logits)
        return jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
