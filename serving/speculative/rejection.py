"""Speculative decoding's rejection mode (verify="rejection"): the verify step.

`rejection_sample` accepts draft d with probability min(1, p(d)/q(d)), else draws from
norm(max(0, p - q)); p is the target's processed distribution (`target_probs`: temperature,
top-k, top-p; greedy one-hot), randomness keyed by (seed, position) on streams of its own.
`rejection_step` is the target's forward on its runtime plus that rule; `RejectionStep` puts it
in the runner's place. The why and the tests are in serving/speculative/speculator.py and
docs/speculative.md.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.model import forward
from jdet.ops import Ops
from jdet.sampling import _filter_top_k_top_p, row_keys, sample
from sharding.mesh import tp_size
from sharding.tp import _gather_vocab, _wrap, make_tp_ops


def _pytree(cls: type) -> type:
    return jax.tree_util.register_dataclass(dataclasses.dataclass(cls))


@_pytree
class SpecSampling:
    """A rejection-mode step's sampling inputs: the usual ones, plus per sampled row the draft
    token the row judges (-1: none) and, for a model draft, the draft's distribution q there
    (None for n-gram drafts: q is one-hot at the draft token)."""

    inputs: Any  # SamplingInputs [S]
    draft: Any  # i32[S]
    q: Any = None  # f32[S, V] or None


@_pytree
class SpecSampleOut:
    """SampleOut's fields (the rows' own samples: the bonus token) plus, per row, the rejection
    rule's outcome for its draft and the processed distribution (`probs`, drafts only)."""

    tokens: Any
    logprobs: Any
    top_ids: Any
    top_logprobs: Any
    accept: Any  # bool[S]: u < p(d) / q(d), u keyed by (seed, position, 1)
    resid: Any  # i32[S]: a draw from norm(max(0, p - q)), Gumbel keyed by (seed, position, 2)
    resid_lp: Any  # f32[S]: raw log-prob of `resid`
    draft_lp: Any  # f32[S]: raw log-prob of the draft token
    probs: Any = None  # f32[S, V]: p, the processed distribution (when asked: a draft's q)


def target_probs(logits: Any, inp: Any, ops: Any) -> Any:
    """p per row: the distribution `jdet.sampling.sample` draws from (temperature, top-k, top-p;
    greedy rows one-hot at the argmax). Rows with logits transforms are never drafted."""
    temp = jnp.where(inp.temperature > 0, inp.temperature, 1.0)
    scaled = _filter_top_k_top_p(logits / temp[:, None], inp.top_k, inp.top_p, ops)
    p = jnp.exp(ops.log_softmax(scaled))
    greedy = jnp.argmax(logits, axis=-1)
    onehot = jnp.arange(logits.shape[-1])[None, :] == greedy[:, None]
    return jnp.where((inp.temperature > 0)[:, None], p, onehot.astype(p.dtype))


def rejection_sample(logits: Any, s: SpecSampling, ops: Any, want_probs: bool) -> SpecSampleOut:
    """The seed's rule per row: accept draft d with probability min(1, p(d) / q(d)), else draw
    from norm(max(0, p - q)); randomness keyed by (seed, position) on streams of its own."""
    logits = logits.astype(jnp.float32)
    out = sample(logits, s.inputs, ops)
    inp = s.inputs
    N, V = logits.shape
    logp = ops.log_softmax(logits)
    p = target_probs(logits, inp, ops)
    d = jnp.maximum(s.draft, 0)
    onehot = (jnp.arange(V)[None, :] == d[:, None]).astype(jnp.float32)
    q = onehot if s.q is None else s.q.astype(jnp.float32)
    pd = jnp.take_along_axis(p, d[:, None], axis=-1)[:, 0]
    qd = jnp.take_along_axis(q, d[:, None], axis=-1)[:, 0]
    keys = row_keys(inp.seed, inp.position)
    u = jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, 1), ()))(keys)
    accept = (u * qd < pd) & (s.draft >= 0)
    resid = jnp.maximum(p - q, 0.0)
    g = jax.vmap(lambda k: jax.random.gumbel(jax.random.fold_in(k, 2), (V,)))(keys)
    score = jnp.where(resid > 0, jnp.log(jnp.where(resid > 0, resid, 1.0)) + g, -jnp.inf)
    rtok = jnp.argmax(score, axis=-1).astype(jnp.int32)
    take = lambda t: jnp.take_along_axis(logp, t[:, None], axis=-1)[:, 0]  # noqa: E731
    return SpecSampleOut(
        out.tokens, out.logprobs, out.top_ids, out.top_logprobs, accept, rtok, take(rtok),
        take(d), p if want_probs else None,
    )  # fmt: skip


_REJ_FNS: dict = {}


def rejection_step(cfg: Any, invariance: str, mesh: Any, want_probs: bool) -> Callable:
    """step(params, kv, batch, SpecSampling) -> (kv, SpecSampleOut): the target's forward (its
    runtime: `mesh` for the sharded one, else one device) and `rejection_sample`."""
    key = (cfg, invariance, mesh, want_probs)
    if key in _REJ_FNS:
        return _REJ_FNS[key]
    if mesh is None:
        ops, gather = Ops(invariance=invariance), None
    else:
        ops, gather = make_tp_ops(invariance, tp_size(mesh)), _gather_vocab

    def body(params: dict, kv: dict, batch: Any, s: SpecSampling) -> tuple:
        kv, logits = forward(params, cfg, kv, batch, ops)
        if gather is not None:
            logits = gather(logits)[:, : cfg.vocab_size]
        return kv, rejection_sample(logits, s, ops, want_probs)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params: dict, kv: dict, batch: Any, s: SpecSampling) -> tuple:
        if mesh is None:
            return body(params, kv, batch, s)
        return _wrap(cfg, mesh, params, kv, body, 1)(params, kv, batch, s)

    _REJ_FNS[key] = step
    return step


class RejectionStep:
    """The runner's step in rejection mode: takes plain SamplingInputs too (warm-up, steps with
    no verify), as rows without a draft (and q = 0 rows for a model draft's engine)."""

    def __init__(self, fn: Callable, vocab_size: int, with_q: bool) -> None:
        self.fn, self.V, self.with_q = fn, vocab_size, with_q

    def __call__(self, params: dict, kv: dict, batch: Any, sampling: Any) -> tuple:
        if not isinstance(sampling, SpecSampling):
            S = sampling.temperature.shape[0]
            q = np.zeros((S, self.V), np.float32) if self.with_q else None
            sampling = SpecSampling(sampling, np.full(S, -1, np.int32), q)
        return self.fn(params, kv, batch, sampling)


def mesh_of(runner: Any) -> Any:
    """The runner's mesh (sharded runtime), or None (one device)."""
    return getattr(runner.token_sharding, "mesh", None)
