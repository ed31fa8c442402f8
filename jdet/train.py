"""Differentiable log-probs whose values are the sampler's bits: the trainer's side of on-policy RL.

Why: RL samples with the engine and trains on log p(token) of the same tokens. Unless the trainer's
log-probs equal the sampler's *bitwise*, "on-policy" training is off-policy by an amount nobody
measures (seeds 000 and 002 end on this). `LLM.score()` gives the sampler's bits but no gradient;
`logprobs` gives both:

- forward VALUES: the engine's own jitted score function with the engine's reduction plan
  (jdet/plan.py `Plan`) — where `Plan.sharded` (every "tp" engine, and any tp > 1) the sharded
  runtime (`sharding.tp.make_tp_score`) on the plan's padded weights (`Plan.prepare_params`, which
  shapes the down_proj tree); in "batch" mode at tp = 1 the unsharded `jdet.step.make_score_fn`.
  The same Plan the engine builds, so the values equal `score()` and the sampler's log-probs
  bitwise (tests/jdet/test_train.py holds it to that).
- GRADIENT: the VJP of the plain-XLA ("none") forward at the same inputs (`jax.custom_vjp`). It is
  the same mathematical function, so the gradient is right to float rounding, and the Pallas
  kernels need no backward of their own. Only the forward bits must match the sampler: they are
  what the importance ratio and the KL between sampler and trainer are made of.

Layout: `out[b, i - 1] = log p(tokens[b, i] | tokens[b, :i])` for i >= 1, as `LLM.score` returns
per sequence. Sequences of different lengths are right-padded with a `mask`: a token's log-prob
depends only on the tokens before it (causal attention, batch-invariant kernels), so padding after a
sequence changes none of its bits; padded positions come back as 0 with zero gradient.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.batch import StepBatch, pow2_bucket
from jdet.config import ModelConfig
from jdet.kv_cache import init_kv_cache
from jdet.model import forward
from jdet.ops import Ops, check_mode
from jdet.plan import Plan
from jdet.sampling import token_logprobs
from jdet.step import make_score_fn
from jdet.tp_layout import check_heads, check_tp_size, kv_heads_in_cache
from pallas_kernels.paged_attention import _pad_rows, paged_attention_xla
from sharding.mesh import make_tp_mesh
from sharding.tp import make_tp_score

MODES = ("tp", "batch", "none")


def _flat_batch(tokens: jax.Array, page_size: int) -> tuple[StepBatch, jax.Array, int]:
    """tokens[B, T] -> one step over all B*(T-1) input tokens, every row a logits row.

    Sequence b takes rows b*n .. b*n+n-1 (n = T-1) and pages b*pps .. (b+1)*pps-1 in order. The
    rows are padded to a power of two >= 16, as the engine pads a step: on a CPU, XLA's
    elementwise code (vectorised loops and their remainders, fusion) can round a row differently
    when the row count is not such a bucket, so the trainer runs the engine's kind of shape.
    Returns (batch, targets[rows], number of pages); rows past B*n are padding.
    """
    B, T = tokens.shape
    n = T - 1
    rows = pow2_bucket(B * n, 16)
    pad = rows - B * n
    pps = -(-n // page_size)
    pos = jnp.arange(n, dtype=jnp.int32)
    seq = jnp.arange(B, dtype=jnp.int32)
    slots = (seq[:, None] * pps + pos[None, :] // page_size) * page_size + pos[None, :] % page_size
    batch = StepBatch(
        token_ids=jnp.pad(tokens[:, :-1].reshape(-1).astype(jnp.int32), (0, pad)),
        positions=jnp.pad(jnp.tile(pos, B), (0, pad)),
        slot_mapping=jnp.pad(slots.reshape(-1), (0, pad), constant_values=-1),
        query_start=jnp.arange(B + 1, dtype=jnp.int32) * n,
        context_lens=jnp.full((B,), n, jnp.int32),
        page_table=jnp.arange(B * pps, dtype=jnp.int32).reshape(B, pps),
        logits_rows=jnp.pad(jnp.arange(B * n, dtype=jnp.int32), (0, pad)),
    )
    targets = jnp.pad(tokens[:, 1:].reshape(-1).astype(jnp.int32), (0, pad))
    return batch, targets, B * pps


def _kv(cfg: ModelConfig, num_kv_heads: int, num_pages: int, page_size: int, dtype: Any) -> dict:
    return init_kv_cache(cfg, num_pages, page_size, dtype, num_kv_heads=num_kv_heads)


def _dtype(params: dict) -> Any:
    # the engine's KV cache takes the model's dtype (serving/engine/model_runner.py: kv_dtype)
    return jax.tree_util.tree_leaves(params)[0].dtype


def _engine_values(cfg: ModelConfig, invariance: str, tp: int, page_size: int) -> Callable:
    """(params, tokens) -> f32[B, T-1] by the plan the engine runs for (invariance, tp).

    The engine's own choice (jdet/plan.py `Plan.sharded`): "tp" mode runs the sharded runtime
    even at tp = 1 on padded weights, "batch" at tp = 1 the unsharded step. tests/jdet/test_train.py
    compares with `LLM.score` in each case.
    """
    plan = Plan(cfg, invariance, tp)
    if plan.sharded:
        score = make_tp_score(cfg, invariance, make_tp_mesh(tp))
        kv_heads = kv_heads_in_cache(cfg, tp)
    else:
        score = make_score_fn(cfg, plan.ops())
        kv_heads = cfg.num_kv_heads
    prepare = plan.prepare_params

    def values(params: dict, tokens: jax.Array) -> jax.Array:
        batch, targets, pages = _flat_batch(tokens, page_size)
        kv = _kv(cfg, kv_heads, pages, page_size, _dtype(params))
        _, lp = score(prepare(params), kv, batch, targets)
        B, T = tokens.shape
        return lp[: B * (T - 1)].reshape(B, T - 1)

    return values


# Rows of the experts' layout per `lax.ragged_dot` in the gradient's forward (`_XlaOps`). Why:
# XLA's GPU backend computes ragged_dot densely over every group, so one call over all P slots
# holds f32 [P, groups, width] (its gradient by the input [P, groups, K]): 65 GiB for 8 sequences
# of 943 tokens at Qwen3-30B-A3B's 128 experts. In chunks of this many slots it holds at most
# 2048 x groups x width (2 GiB there); the arithmetic is the same, the memory bounded.
RAGGED_ROWS = 2048


def ragged_dot_chunked(x: jax.Array, w: jax.Array, tiles: Any, out_dtype: Any, per_src: int = 1,
                       layer: Any = None, chunk: int = RAGGED_ROWS) -> jax.Array:  # fmt: skip
    """`grouped_matmul.grouped_matmul_xla` (XLA's ragged_dot over the sorted layout, row order
    out, differentiable) over `chunk` slots at a time (`RAGGED_ROWS` says why): each chunk's
    group sizes are its share of every group's slots."""
    from pallas_kernels.grouped_layout import gather_rows, scatter_rows

    if layer is not None:
        w = jax.lax.dynamic_index_in_dim(w, layer, keepdims=False)
    xs = gather_rows(x, tiles, per_src)
    dtype = jnp.promote_types(x.dtype, w.dtype)
    p = xs.shape[0]
    c = min(chunk, p)
    n = -(-p // c)
    xs = jnp.pad(xs.astype(dtype), ((0, n * c - p), (0, 0))).reshape(n, c, -1)
    ends = jnp.cumsum(tiles.group_sizes)
    starts = ends - tiles.group_sizes

    def one(args: tuple) -> jax.Array:
        xc, i = args
        sizes = jnp.clip(ends - i * c, 0, c) - jnp.clip(starts - i * c, 0, c)
        return jax.lax.ragged_dot(xc, w.astype(dtype), sizes, preferred_element_type=jnp.float32)

    out = jax.lax.map(one, (xs, jnp.arange(n, dtype=jnp.int32))).reshape(n * c, -1)[:p]
    return scatter_rows(out.astype(out_dtype), tiles)


def _ragged_remat(x: jax.Array, w: jax.Array, tiles: Any, out_dtype: Any, per_src: int = 1,
                  layer: Any = None) -> jax.Array:  # fmt: skip
    """`ragged_dot_chunked`, recomputed in the backward pass: its residuals are then x and the
    whole stack w (a constant of the layer loop), where they were each layer's w[layer] (as
    arrays: 27 GiB of expert weights again for 24 Qwen3-30B-A3B layers) and the gathered rows."""

    def run(x: jax.Array, w: jax.Array, tiles: Any, layer: Any) -> jax.Array:
        return ragged_dot_chunked(x, w, tiles, out_dtype, per_src, layer)

    return jax.checkpoint(run, prevent_cse=False)(x, w, tiles, layer)


class _XlaOps(Ops):
    """The "none" ops with XLA's gather attention and `ragged_dot` experts on every platform: on
    a GPU the "none" mode's attention and grouped matmuls are Pallas kernels (jdet/ops.py),
    which have no autodiff rule; these do. The attention recomputes its blocks in the backward
    pass and the experts run in chunks of rows, so the gradient's memory stays linear in the
    tokens and bounded per expert layer (`paged_attention_xla`'s `remat`, `RAGGED_ROWS`)."""

    @property
    def ragged_experts(self) -> bool:
        return True

    def grouped_gate_up(self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, tiles: Any,
                        per_src: int, live: int | None = None, layer: Any = None):  # fmt: skip
        return tuple(_ragged_remat(x, w, tiles, x.dtype, per_src, layer)
                     for w in (w_gate, w_up))  # fmt: skip

    def grouped_row_matmul(self, x: jax.Array, w: jax.Array, tiles: Any, live: int | None = None,
                           layer: Any = None) -> jax.Array:  # fmt: skip
        return _ragged_remat(x, w, tiles, x.dtype, 1, layer)

    def attention_meta(self, batch: Any, kv: dict, q_heads: int) -> None:
        return None

    def attention(self, q: jax.Array, kv: dict, layer: jax.Array, batch: Any, scale: float,
                  meta: Any = None, out_rows: int | None = None):  # fmt: skip

        out = paged_attention_xla(q, kv["k"], kv["v"], batch.page_table, batch.context_lens,
                                  batch.query_start, batch.positions, scale=scale,
                                  layer=layer, remat=True)  # fmt: skip
        return _pad_rows(out, out_rows)


def _xla_values(cfg: ModelConfig, page_size: int) -> Callable:
    """(params, tokens) -> f32[B, T-1] by the plain-XLA ("none") forward: differentiable."""
    ops = _XlaOps("none")

    def values(params: dict, tokens: jax.Array) -> jax.Array:
        batch, targets, pages = _flat_batch(tokens, page_size)
        kv = _kv(cfg, cfg.num_kv_heads, pages, page_size, _dtype(params))
        _, logits = forward(params, cfg, kv, batch, ops)
        B, T = tokens.shape
        return token_logprobs(logits, targets, ops)[: B * (T - 1)].reshape(B, T - 1)

    return values


@functools.cache
def _logprobs_fn(cfg: ModelConfig, invariance: str, tp: int, page_size: int) -> Callable:
    """The jitted (params, tokens) -> f32[B, T-1] for one plan; cached so repeated calls (a
    training loop) reuse the compiled function."""
    xla = _xla_values(cfg, page_size)
    if invariance == "none":
        return jax.jit(xla)  # XLA's forward and its own gradient: nothing to match
    engine = _engine_values(cfg, invariance, tp, page_size)

    @jax.custom_vjp
    def f(params: dict, tokens: jax.Array) -> jax.Array:
        return engine(params, tokens)

    def f_fwd(params: dict, tokens: jax.Array) -> tuple[jax.Array, tuple]:
        return engine(params, tokens), (params, tokens)

    def f_bwd(res: tuple, g: jax.Array) -> tuple[Any, None]:
        params, tokens = res
        _, vjp = jax.vjp(lambda p: xla(p, tokens), params)
        return vjp(g)[0], None  # tokens are integers: no cotangent

    f.defvjp(f_fwd, f_bwd)
    return jax.jit(f)


def _concrete(x: Any) -> np.ndarray | None:
    """x as numpy when it is a concrete value (not a tracer), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _check(cfg: ModelConfig, tokens: Any, mask: Any, invariance: str, tp: int) -> None:
    check_mode(invariance)
    if invariance != "none":
        check_tp_size(tp, len(jax.local_devices()))
        check_heads(cfg, tp)
    elif tp != 1:
        raise ValueError(
            'invariance="none" runs the plain XLA forward on one device; use tp=1 (its bits '
            "match nothing, at any TP size)"
        )
    shape = getattr(tokens, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] < 2:
        raise ValueError(
            f"tokens must be an integer array [B, T] with T >= 2 (a log-prob needs a preceding "
            f"token); got shape {shape}. Right-pad sequences of different lengths and pass mask"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    t = _concrete(tokens)
    if t is not None and t.size and (t.min() < 0 or t.max() >= cfg.vocab_size):
        bad = t[(t < 0) | (t >= cfg.vocab_size)][0]
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {cfg.vocab_size})")
    if mask is None:
        return
    if getattr(mask, "shape", None) != tuple(shape):
        raise ValueError(f"mask must have the shape of tokens {tuple(shape)}, got {mask.shape}")
    m = _concrete(mask)
    if m is not None and (np.diff(m.astype(np.int8), axis=1) > 0).any():
        b = int(np.nonzero((np.diff(m.astype(np.int8), axis=1) > 0).any(axis=1))[0][0])
        raise ValueError(
            f"mask row {b} has a real token after a padded one; only right padding is "
            "supported (real tokens first, then padding), since a left pad would shift positions"
        )


def logprobs(
    params: dict,
    tokens: Any,
    *,
    cfg: ModelConfig,
    invariance: str = "tp",
    mask: Any = None,
    tp: int = 1,
    page_size: int = 16,
) -> jax.Array:
    """Differentiable teacher-forced log-probs f32[B, T-1]: `out[b, i-1] = log p(tokens[b, i] |
    tokens[b, :i])`, bitwise the values of `jdet.LLM(model, tp=tp, invariance=invariance,
    page_size=page_size).score(...)` and of the sampler's reported log-probs.

    params: the model's params pytree as loaded (`jdet.load(...).params`, unpadded; the plan's
        padding is applied inside, as the engine applies it). Gradients come back in that layout.
    tokens: int[B, T]. mask: optional bool/int [B, T], 1 for real tokens, right padding only;
        masked targets give 0 and no gradient.
    invariance: "tp" (default) or "batch": the forward is the engine's; the gradient is the XLA
        forward's. "none": the plain XLA forward and its gradient (the non-invariant baseline).
    tp: tensor-parallel size of the forward (shard_map over the first `tp` devices).
    page_size: the engine's page size (`LLM(page_size=...)`); it sets the attention kernel's
        KV block, so it must match the sampler's for the bits to.
    """
    _check(cfg, tokens, mask, invariance, tp)
    lp = _logprobs_fn(cfg, invariance, tp, page_size)(params, jnp.asarray(tokens))
    if mask is None:
        return lp
    return jnp.where(jnp.asarray(mask)[:, 1:].astype(bool), lp, 0.0)


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Token-id lists of different lengths -> (tokens i32[B, T], mask bool[B, T]), right-padded,
    for `logprobs(..., mask=mask)`."""
    if not seqs:
        raise ValueError("right_pad needs at least one sequence")
    T = max(len(s) for s in seqs)
    tokens = np.full((len(seqs), T), pad_id, np.int32)
    mask = np.zeros((len(seqs), T), bool)
    for b, s in enumerate(seqs):
        tokens[b, : len(s)] = s
        mask[b, : len(s)] = True
    return tokens, mask


__all__ = ["logprobs", "right_pad", "MODES"]
