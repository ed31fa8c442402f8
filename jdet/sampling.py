"""Sampling on device: greedy, temperature, top-k, top-p, and log-probs — batch-invariant.

Why each piece is safe:
- randomness: each row's key is fold_in(fold_in(key0, seed), position), so a row's draw depends on
  (request seed, token position) only — never on its batch slot, the batch size or the step;
- log-probs come from `ops.log_softmax` (a fixed-order vocabulary reduction in invariant modes)
  of the raw logits, which is exactly what `score()` returns;
- top-k/top-p use sorts and `top_k` (selections, exact) and a cumulative sum built by
  `lax.associative_scan` — a fixed tree of elementwise adds whose shape depends on V only;
- the draw is Gumbel-max: argmax(logits / T + g), an exact selection.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jdet.ops import Ops

NUM_TOP = 20  # top log-probs computed per sampled row (static); requests may ask for fewer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    temperature: jax.Array  # f32[N]; 0 = greedy
    top_k: jax.Array  # i32[N]; 0 = off
    top_p: jax.Array  # f32[N]; 1 = off
    seed: jax.Array  # u32[N]
    position: jax.Array  # i32[N]: position the sampled token will occupy


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOut:
    tokens: jax.Array  # i32[N]
    logprobs: jax.Array  # f32[N]
    top_ids: jax.Array  # i32[N, NUM_TOP]
    top_logprobs: jax.Array  # f32[N, NUM_TOP]


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    base = jax.random.PRNGKey(0)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(
        seed.astype(jnp.uint32), position.astype(jnp.uint32)
    )


def _filter_top_k_top_p(
    scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, ops: Ops
) -> jax.Array:
    N, V = scaled.shape
    srt = -jnp.sort(-scaled, axis=-1)  # descending, exact
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    keep_k = scaled >= kth
    # top-p on the top-k-filtered distribution (vLLM's order).
    srt_masked = jnp.where(jnp.arange(V)[None, :] < k[:, None], srt, -jnp.inf)
    probs = jnp.exp(ops.log_softmax(srt_masked))
    cum = jax.lax.associative_scan(jnp.add, probs, axis=-1)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    cut_idx = jnp.sum((cum - probs) < top_p[:, None], axis=-1) - 1
    cut_idx = jnp.clip(cut_idx, 0, V - 1)
    thresh = jnp.take_along_axis(srt_masked, cut_idx[:, None], axis=-1)
    keep_p = jnp.where((top_p < 1.0)[:, None], scaled >= thresh, True)
    return jnp.where(keep_k & keep_p, scaled, -jnp.inf)


def sample(logits: jax.Array, inp: SamplingInputs, ops: Ops) -> SampleOut:
    """Draw one token per row of f32 logits [N, V]."""
    logits = logits.astype(jnp.float32)
    logp = ops.log_softmax(logits)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    temp = jnp.where(inp.temperature > 0, inp.temperature, 1.0)
    scaled = logits / temp[:, None]
    needs_filter = jnp.any((inp.top_k > 0) | (inp.top_p < 1.0))
    scaled = jax.lax.cond(
        needs_filter,
        lambda s: _filter_top_k_top_p(s, inp.top_k, inp.top_p, ops),
        lambda s: s,
        scaled,
    )
    keys = row_keys(inp.seed, inp.position)
    V = logits.shape[-1]
    u = jax.vmap(lambda k: jax.random.uniform(k, (V,), jnp.float32, 1e-20, 1.0))(keys)
    gumbel = -jnp.log(-jnp.log(u))
    drawn = jnp.argmax(scaled + gumbel, axis=-1).astype(jnp.int32)
    tokens = jnp.where(inp.temperature > 0, drawn, greedy)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logp, min(NUM_TOP, V))
    return SampleOut(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def token_logprobs(logits: jax.Array, targets: jax.Array, ops: Ops) -> jax.Array:
    """log p(target) per row under the raw model distribution (what `sample` reports)."""
    logp = ops.log_softmax(logits.astype(jnp.float32))
    return jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
