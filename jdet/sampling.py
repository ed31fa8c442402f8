"""Sampling on device: greedy, temperature, top-k, top-p, and log-probs — batch-invariant.

Why each piece is safe:
- randomness: each row's key is fold_in(fold_in(key0, seed), position), so a row's draw depends on
  (request seed, token position) only — never on its batch slot, the batch size or the step;
- log-probs come from `ops.log_softmax` (a fixed-order vocabulary reduction in invariant modes)
  of the raw logits, which is exactly what `score()` returns;
- top-k/top-p use sorts and `top_k` (selections, exact) and a cumulative sum built by
  `lax.associative_scan` — a fixed tree of elementwise adds whose shape depends on V only;
- the draw is Gumbel-max: argmax(logits / T + g), an exact selection;
- the per-request logits transforms (`LogitsInputs`: allowed-token bitmask, logit bias,
  repetition/frequency/presence penalties, min-p) are elementwise, gathers/scatters into the row's
  own logits and a row max: no value crosses rows, so a row's bits do not depend on the batch.

Order (vLLM's): bitmask (structured output, allowed_token_ids, bad_words, min_tokens) -> logit
bias -> repetition penalty (prompt + generated tokens: positive logits divided, negative
multiplied) -> frequency and presence penalties (generated tokens) -> temperature -> min-p ->
top-k -> top-p -> draw. Greedy is the argmax of the processed logits.

Reported log-probs (`SampleOut.logprobs`, `top_logprobs`) are those of the RAW model distribution
(log_softmax of the unprocessed logits), whatever the transforms: it is what `score()` and the
trainer compute, and it is vLLM's default too (`logprobs_mode="raw_logprobs"`). A token the
transforms made likely may therefore carry a low reported log-prob; that is by design.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jdet.ops import Ops
from jdet.plan import backend
from pallas_kernels import xla_fixed

NUM_TOP = 20  # top log-probs computed per sampled row (static); requests may ask for fewer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LogitsInputs:
    """Per-row logits transforms, in fixed-width arrays (their shapes follow the step's bucket,
    so they add no compiled shape). Padding entries are id -1; a neutral row transforms nothing.

    U (penalty width) is the step's Pmax * page_size, which bounds every row's token count and so
    its number of distinct tokens; NB = MAX_LOGIT_BIAS; W = ceil(V / 32).
    """

    min_p: jax.Array  # f32[N]; 0 = off
    presence: jax.Array  # f32[N]; 0 = off
    frequency: jax.Array  # f32[N]; 0 = off
    repetition: jax.Array  # f32[N]; 1 = off
    pen_ids: jax.Array  # i32[N, U]: distinct tokens of prompt + generated (-1: padding)
    pen_counts: jax.Array  # i32[N, U]: times each occurs among the generated tokens
    bias_ids: jax.Array  # i32[N, NB]: logit_bias token ids (-1: padding)
    bias_vals: jax.Array  # f32[N, NB]
    mask: jax.Array  # i32[N, W]: allowed-token bitmask, bit t % 32 of word t // 32 (-1: all)


MAX_LOGIT_BIAS = 300  # logit_bias entries per request (more are refused at the boundary)


def _static(default: object) -> dataclasses.Field:
    """A field that is part of the pytree's structure, not a leaf: a jit cache key."""
    return dataclasses.field(default=default, metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingInputs:
    """A step's sampling rows, and two static flags that pick the sampler's variant.

    Why the flags: on a GPU the top-k/top-p filter cannot be skipped at run time for free
    (`_top_k_top_p`), and the top-`NUM_TOP` log-probs are a `top_k` over the vocabulary; a step
    whose rows ask for neither pays for both (a few per cent of an 8B batch-1 decode step on an
    H100; benchmarks/sampler_bench.py). So the caller says, statically, whether any row of the
    step filters (`filter_topk_topp`) and how many top log-probs the step returns
    (`top_logprobs`: 0 or NUM_TOP, two buckets so few executables compile; serving/
    sampler_variants.py picks them per step and warm-up compiles each). A row's token and
    log-prob are the same bits in every variant that serves it: a row that does not filter
    keeps its logits whether the filter ran for other rows or not (a select, or a cond that
    returns them), and the chosen token's log-prob is read from the same log_softmax
    (tests/jdet/test_sampler_variants.py). The defaults are the full sampler.

    A third flag, `draw`, and `logits=None` make the smallest step, for steps whose rows are all
    greedy without transforms (serving/engine/sampler_variants.py GREEDY: `jdet generate`'s
    default): XLA then compiles no Gumbel draw, no threefry keys and no transform conditionals, ~1/4
    less compile time for the embedded model's step on a CPU (benchmarks/sampler_compile.py). A
    greedy row's token is the argmax of the same logits either way, its log-prob read from the same
    log_softmax."""

    temperature: jax.Array  # f32[N]; 0 = greedy
    top_k: jax.Array  # i32[N]; 0 = off
    top_p: jax.Array  # f32[N]; 1 = off
    seed: jax.Array  # u32[N]
    position: jax.Array  # i32[N]: position the sampled token will occupy
    logits: LogitsInputs | None = None  # per-request transforms; None: none in this step
    # False: no row filters (every top_k is 0 and every top_p 1); the filter is not built, so a
    # row that asks would not be filtered: the caller's promise (serving/engine/sampler_variants.py)
    filter_topk_topp: bool = _static(True)
    # top log-probs per row in SampleOut: NUM_TOP, or 0 (top_ids/top_logprobs are [N, 0])
    top_logprobs: int = _static(NUM_TOP)
    # False: every row is greedy (temperature 0); the Gumbel draw and the rows' random keys are
    # not built, so a row with temperature > 0 would get its argmax: the caller's promise
    draw: bool = _static(True)

    def __post_init__(self) -> None:
        for name in ("filter_topk_topp", "draw"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SamplingInputs.{name} must be a bool, got "
                                f"{getattr(self, name)!r}")  # fmt: skip
        if self.top_logprobs not in (0, NUM_TOP) or isinstance(self.top_logprobs, bool):
            raise ValueError(
                f"SamplingInputs.top_logprobs must be 0 or NUM_TOP ({NUM_TOP}), got "
                f"{self.top_logprobs!r}: the step computes either no top log-probs or "
                f"{NUM_TOP} (a request's fewer are cut on the host)"
            )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOut:
    tokens: jax.Array  # i32[N]
    logprobs: jax.Array  # f32[N]
    top_ids: jax.Array  # i32[N, NUM_TOP], or [N, 0] (SamplingInputs.top_logprobs = 0)
    top_logprobs: jax.Array  # f32[N, NUM_TOP], or [N, 0]


def row_keys(seed: jax.Array, position: jax.Array) -> jax.Array:
    base = jax.random.PRNGKey(0)
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(
        seed.astype(jnp.uint32), position.astype(jnp.uint32)
    )


def _descending(x: jax.Array) -> jax.Array:
    """Rows sorted largest first: `-jnp.sort(-x)` on a GPU; on a CPU `xla_fixed.
    sort_descending`, the same values sorted as int32 keys, several times faster there (a step
    whose rows filter pays it every step)."""
    if backend().gpu:
        return -jnp.sort(-x, axis=-1)
    return xla_fixed.sort_descending(x)


def _cumulative(probs: jax.Array) -> jax.Array:
    """Inclusive cumulative sums over V: `lax.associative_scan`'s fixed tree on a GPU; on a CPU
    `xla_fixed.prefix_sum`, blocked running sums in a fixed order, since the scan's ~40 fusions
    were a third of the sampler's compile there (pallas_kernels/xla_fixed.py says why). Either
    order depends on V alone, so a row's cumulative mass does not follow the batch."""
    if backend().gpu:
        return jax.lax.associative_scan(jnp.add, probs, axis=-1)
    return xla_fixed.prefix_sum(probs)


def _filter_top_k_top_p(
    scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, ops: Ops
) -> jax.Array:
    N, V = scaled.shape
    srt = _descending(scaled)  # exact
    k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
    kth = jnp.take_along_axis(srt, (k - 1)[:, None], axis=-1)
    keep_k = scaled >= kth
    # top-p on the top-k-filtered distribution (vLLM's order).
    srt_masked = jnp.where(jnp.arange(V)[None, :] < k[:, None], srt, -jnp.inf)
    probs = jnp.exp(ops.log_softmax(srt_masked))
    cum = _cumulative(probs)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    cut_idx = jnp.sum((cum - probs) < top_p[:, None], axis=-1) - 1
    cut_idx = jnp.clip(cut_idx, 0, V - 1)
    thresh = jnp.take_along_axis(srt_masked, cut_idx[:, None], axis=-1)
    keep_p = jnp.where((top_p < 1.0)[:, None], scaled >= thresh, True)
    return jnp.where(keep_k & keep_p, scaled, -jnp.inf)


def apply_mask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """-inf where the row's bitmask bit is 0 (bit t % 32 of int32 word t // 32, as llguidance
    and xgrammar write it)."""
    N, V = logits.shape
    bits = (mask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    bits = bits.reshape(N, -1)[:, :V]
    return jnp.where(bits != 0, logits, -jnp.inf)


def _unique_columns(ids: jax.Array, V: int) -> jax.Array:
    """Scatter columns for a row's distinct `ids` (-1: padding): padding j goes to V + j, out of
    bounds (dropped) and distinct, so the scatter's indices are unique, as it declares (XLA may
    then skip what it does for repeated indices; the same values are written either way)."""
    return jnp.where(ids >= 0, ids, V + jnp.arange(ids.shape[-1], dtype=ids.dtype))


def apply_bias(logits: jax.Array, ids: jax.Array, vals: jax.Array) -> jax.Array:
    """logits[r, ids[r, j]] += vals[r, j] (ids distinct within a row: one exact add each)."""
    N, V = logits.shape
    rows = jnp.arange(N)[:, None]
    cols = _unique_columns(ids, V)
    return logits.at[rows, cols].add(vals, mode="drop", unique_indices=True)


def apply_penalties(logits: jax.Array, x: LogitsInputs) -> jax.Array:
    """Repetition (every listed token: positive logits / r, others * r), then frequency and
    presence (logit -= frequency * count + presence * (count > 0), generated tokens only)."""
    N, V = logits.shape
    valid = x.pen_ids >= 0
    g = jnp.take_along_axis(logits, jnp.where(valid, x.pen_ids, 0), axis=-1)
    r = x.repetition[:, None]
    g = jnp.where(g > 0, g / r, g * r)
    cnt = x.pen_counts.astype(jnp.float32)
    g = g - x.frequency[:, None] * cnt - x.presence[:, None] * (cnt > 0).astype(jnp.float32)
    rows = jnp.arange(N)[:, None]
    cols = _unique_columns(x.pen_ids, V)
    return logits.at[rows, cols].set(g, mode="drop", unique_indices=True)


def _when(pred: jax.Array, fn, x: jax.Array) -> jax.Array:
    """fn(x) if pred else x; the untaken branch costs nothing on device."""
    return jax.lax.cond(pred, fn, lambda y: y, x)


def _top_k_top_p(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, ops: Ops) -> jax.Array:
    """The top-k/top-p filter, skipped when no row of the step asks for it — off a GPU only.

    On a GPU the skip would be a `lax.cond` whose branch holds a sort (a cub custom call XLA
    cannot capture in a CUDA graph), so XLA runs it as a host-side conditional: the host thread
    copies the predicate back and so waits for the whole forward before it can launch the sampler
    — every step would be synchronous. There the filter runs for every step (one sort of the
    [N, V] logits: the FULL sampler's cost in BENCHMARKS.md, Defaults and memory) and rows that
    do not ask keep their logits through a select: the same bits either way. A step none of whose
    rows filters does not build it at all (`SamplingInputs.filter_topk_topp`, static)."""
    if not backend().gpu:
        needs_filter = jnp.any((top_k > 0) | (top_p < 1.0))
        return jax.lax.cond(
            needs_filter,
            lambda s: _filter_top_k_top_p(s, top_k, top_p, ops),
            lambda s: s,
            scaled,
        )
    rows = ((top_k > 0) | (top_p < 1.0))[:, None]
    return jnp.where(rows, _filter_top_k_top_p(scaled, top_k, top_p, ops), scaled)


def process_logits(logits: jax.Array, x: LogitsInputs) -> jax.Array:
    """The transforms before temperature (module docstring: order), each skipped when no row of
    the step uses it."""
    logits = _when(jnp.any(x.mask != -1), lambda y: apply_mask(y, x.mask), logits)
    logits = _when(
        jnp.any(x.bias_ids >= 0), lambda y: apply_bias(y, x.bias_ids, x.bias_vals), logits
    )
    return _when(jnp.any(x.pen_ids >= 0), lambda y: apply_penalties(y, x), logits)


def apply_min_p(scaled: jax.Array, min_p: jax.Array) -> jax.Array:
    """Keep tokens with p >= min_p * p_max of the temperature-scaled distribution, i.e.
    scaled >= max(scaled) + log(min_p) (a row max: an exact selection, no sum)."""
    top = jnp.max(scaled, axis=-1, keepdims=True)
    thresh = top + jnp.log(jnp.where(min_p > 0, min_p, 1.0))[:, None]
    return jnp.where((min_p[:, None] <= 0) | (scaled >= thresh), scaled, -jnp.inf)


def _draw_unless_greedy(draw, scaled: jax.Array, greedy: jax.Array, temperature: jax.Array):
    """draw(scaled), skipped off a GPU when every row is greedy (its result is then unused).

    Why: the Gumbel noise is V random numbers per row (threefry) plus two logs, a large share of
    a CPU decode step of the embedded model, whose rows are all greedy in the common case. Rows
    that sample get the same draw either way. On a GPU the skip would be a host-side
    conditional, as for the top-k/top-p filter (`_top_k_top_p`), so it always draws there."""
    if backend().gpu:
        return draw(scaled)
    return jax.lax.cond(jnp.any(temperature > 0), draw, lambda s: greedy, scaled)


def _sampled(logits: jax.Array, greedy: jax.Array, inp: SamplingInputs, ops: Ops) -> jax.Array:
    """The rows' tokens: a Gumbel-max draw from the processed logits (temperature, min-p,
    top-k/top-p) where temperature > 0, the argmax `greedy` elsewhere."""
    x = inp.logits
    temp = jnp.where(inp.temperature > 0, inp.temperature, 1.0)
    scaled = logits / temp[:, None]
    if x is not None:
        scaled = _when(jnp.any(x.min_p > 0), lambda s: apply_min_p(s, x.min_p), scaled)
    if inp.filter_topk_topp:  # static: False when no row of the step filters
        scaled = _top_k_top_p(scaled, inp.top_k, inp.top_p, ops)
    V = logits.shape[-1]

    def draw(s: jax.Array) -> jax.Array:
        # the keys inside the draw: a CPU's all-greedy step skips them with it
        keys = row_keys(inp.seed, inp.position)
        u = jax.vmap(lambda k: jax.random.uniform(k, (V,), jnp.float32, 1e-20, 1.0))(keys)
        gumbel = -jnp.log(-jnp.log(u))
        return jnp.argmax(s + gumbel, axis=-1).astype(jnp.int32)

    drawn = _draw_unless_greedy(draw, scaled, greedy, inp.temperature)
    return jnp.where(inp.temperature > 0, drawn, greedy)


def sample(logits: jax.Array, inp: SamplingInputs, ops: Ops) -> SampleOut:
    """Draw one token per row of f32 logits [N, V]."""
    logits = logits.astype(jnp.float32)
    logp = ops.log_softmax(logits)  # raw: what is reported (module docstring)
    x = inp.logits
    if x is not None:
        logits = process_logits(logits, x)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    V = logits.shape[-1]
    # inp.draw is static: False when every row of the step is greedy (no draw is built then)
    tokens = _sampled(logits, greedy, inp, ops) if inp.draw else greedy
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    if inp.top_logprobs:  # static: 0 when no row of the step reports top log-probs
        top_lp, top_ids = jax.lax.top_k(logp, min(inp.top_logprobs, V))
    else:
        top_lp = jnp.zeros((logp.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logp.shape[0], 0), jnp.int32)
    return SampleOut(tokens, chosen, top_ids.astype(jnp.int32), top_lp)


def token_logprobs(logits: jax.Array, targets: jax.Array, ops: Ops) -> jax.Array:
    """log p(target) per row under the raw model distribution (what `sample` reports)."""
    logp = ops.log_softmax(logits.astype(jnp.float32))
    return jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
