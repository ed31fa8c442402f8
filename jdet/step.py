"""The jitted step functions the engine and the offline loop call (cache donated).

One compile per shape (T, S, Pmax, N); the engine pads every step to one of a bounded set of
shapes and compiles them all before it serves (serving/model_runner.py `ShapeSet`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from jdet.batch import StepBatch
from jdet.config import ModelConfig
from jdet.kv_cache import init_kv_cache  # noqa: F401  (re-exported: the contract names it here)
from jdet.model import forward
from jdet.ops import Ops
from jdet.sampling import SampleOut, SamplingInputs, sample, token_logprobs


@functools.cache
def make_step_fn(cfg: ModelConfig, ops: Ops) -> Callable:
    """Cached per (cfg, ops): every LLM/engine over the same model shares one compile cache."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(
        params: dict, kv: dict, batch: StepBatch, sampling: SamplingInputs
    ) -> tuple[dict, SampleOut]:
        kv, logits = forward(params, cfg, kv, batch, ops)
        return kv, sample(logits, sampling, ops)

    return step


@functools.cache
def make_score_fn(cfg: ModelConfig, ops: Ops) -> Callable:
    """score(params, kv, batch, targets i32[N]) -> (kv, f32[N]): log p(targets) at logits_rows."""

    @functools.partial(jax.jit, donate_argnums=(1,))
    def score(
        params: dict, kv: dict, batch: StepBatch, targets: jax.Array
    ) -> tuple[dict, jax.Array]:
        kv, logits = forward(params, cfg, kv, batch, ops)
        return kv, token_logprobs(logits, targets, ops)

    return score
