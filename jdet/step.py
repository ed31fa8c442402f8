"""The jitted step functions the engine and the offline loop call (cache donated).

One compile per shape (T, S, Pmax, N) and sampler variant (SamplingInputs' static flags: the
top-k/top-p filter and the top log-probs built or not); the engine pads every step to one of a
bounded set of shapes, runs one of two variants (serving/engine/sampler_variants.py) and compiles
them all before it serves (serving/engine/shapes.py `ShapeSet`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax

from jdet.batch import StepBatch
from jdet.config import ModelConfig
from jdet.kv_cache import init_kv_cache  # noqa: F401  (re-exported: the contract names it here)
from jdet.model import forward
from jdet.ops import Ops
from jdet.plan import backend
from jdet.sampling import SampleOut, SamplingInputs, sample, token_logprobs


def step_body(cfg: ModelConfig, ops: Ops, gather_vocab: Callable | None = None) -> Callable:
    """THE step: (params, kv, batch, sampling) -> (kv, SampleOut). The unsharded step jits it;
    the TP step (sharding/tp.py) runs it per device under `shard_map`, with TP Ops (the row-
    parallel combine) and `gather_vocab`, which assembles each device's vocab columns."""

    def body(
        params: dict, kv: dict, batch: StepBatch, sampling: SamplingInputs
    ) -> tuple[dict, SampleOut]:
        kv, logits = _logits(params, cfg, kv, batch, ops, gather_vocab)
        return kv, sample(logits, sampling, ops)

    return body


def score_body(cfg: ModelConfig, ops: Ops, gather_vocab: Callable | None = None) -> Callable:
    """(params, kv, batch, targets i32[N]) -> (kv, f32[N]): log p(targets) at logits_rows, with
    step_body's logits and sharding."""

    def body(
        params: dict, kv: dict, batch: StepBatch, targets: jax.Array
    ) -> tuple[dict, jax.Array]:
        kv, logits = _logits(params, cfg, kv, batch, ops, gather_vocab)
        return kv, token_logprobs(logits, targets, ops)

    return body


def logits_body(cfg: ModelConfig, ops: Ops, gather_vocab: Callable | None = None) -> Callable:
    """step_body without the sampler: (params, kv, batch) -> (kv, f32 logits [N, V]). An
    engine runs it and the sampler as two executables (serving/engine/host_inputs.py
    `SplitStep`)."""

    def body(params: dict, kv: dict, batch: StepBatch) -> tuple[dict, jax.Array]:
        return _logits(params, cfg, kv, batch, ops, gather_vocab)

    return body


def _logits(params, cfg, kv, batch, ops, gather_vocab):
    kv, logits = forward(params, cfg, kv, batch, ops)  # unsharded [N, V]; under TP [N, V_pad/tp]
    if gather_vocab is not None:  # a copy (exact); the padded columns are sliced off
        logits = gather_vocab(logits)[:, : cfg.vocab_size]
    return kv, logits

NONE_GPU_XLA_OPTIONS = {"xla_gpu_enable_triton_gemm": False}
# Every GPU step without XLA's rematerialization pass. Why: XLA sizes a program's memory with the
# donated KV pool counted twice (as input and as output: "may-alias"), so a pool that fills the
# device always looks too large, and the pass then spends seconds per compile failing to shrink
# it (more than half of an 8B step's compile, for the same program and memory: "Can't reduce
# memory use below ..."; BENCHMARKS.md, start-up). The engine sizes the pool from the step's own
# peak (serving/engine/memory.py), so there is nothing for the pass to rescue.
GPU_XLA_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}
OPTIONS_ENV = "JDET_NONE_XLA_OPTIONS"


# On a CPU the step runs on one thread: XLA's intra-op parallelism (its dots and partitioned loops
# split over a thread pool) costs more than it gives for the small steps a CPU serves, and much
# more on a shared machine (a CI worker per core), where the threads wait for cores; same bits
# (the dots' shapes fix their arithmetic; checked on generate + score).
CPU_XLA_OPTIONS = {"xla_cpu_multi_thread_eigen": False}
CPU_OPTIONS_ENV = "JDET_CPU_XLA_OPTIONS"

# No XLA option that changes a step's bits may be set here: score functions run under their
# caller's options (jdet.train nests them), so the sampler and score() would part. XLA's legacy CPU
# emitters (`xla_cpu_use_fusion_emitters=False`, faster compiles) are such an option: steps
# compiled with them gave log-probs that left an engine's after ~23 tokens of a 128-token greedy
# run. LLVM's optimization level (`xla_backend_optimization_level`, XLA's default 3) is another:
# with the step at 0 and jdet.train's forward nested at 3, train left the sampler's log-probs
# (tests/jdet/test_train.py), and speculative rejection's program at 0 beside a step at 3 failed
# the rejection tests. GPU_XLA_OPTIONS below removes a pass that changes only memory, never a
# value.


def _parse_options(env: str) -> dict:
    out: dict = {}
    for item in filter(None, env.split(",")):
        k, v = item.split("=")
        out[k.strip()] = {"true": True, "false": False}.get(v.strip().lower(), v.strip())
    return out


def xla_options(ops: Ops) -> dict:
    """XLA compiler options of the step: on a CPU `CPU_XLA_OPTIONS` in the invariant modes (one
    thread; `$JDET_CPU_XLA_OPTIONS` "key=value,..." or "" overrides it; "none" keeps XLA's
    defaults, threaded dots whose rounding may follow the batch, which its negative controls
    rely on), on a GPU `GPU_XLA_OPTIONS` (no rematerialization pass) and in the "none" mode
    XLA's Triton GEMMs off:

    Why the latter: the layers run under a `lax.scan` over stacked weights, so each projection's
    weight is a dynamic slice of the stack. XLA feeds a dynamic slice to a custom call (our
    Pallas kernels, cuBLAS) in place ("dynamic slice fusion"), but its Triton GEMM fusions —
    which it picks for small-M dots — take only whole buffers, so it copied every weight of
    every layer before using it: the "none" decode step read each weight twice and wrote it once
    (in a profile, the copies were about half of the step). With Triton GEMMs off
    the dots go to cuBLAS, which reads the slice in place. `$JDET_NONE_XLA_OPTIONS`
    ("key=value,...", or "" for XLA's defaults) overrides it, for benchmarks."""
    here = backend()
    if here.cpu:
        if not ops.invariant:  # "none" stays XLA's default (threaded): the baseline as it is
            return {}
        env = os.environ.get(CPU_OPTIONS_ENV)
        return dict(CPU_XLA_OPTIONS) if env is None else _parse_options(env)
    if not here.gpu:
        return {}
    if ops.invariant:
        return dict(GPU_XLA_OPTIONS)
    env = os.environ.get(OPTIONS_ENV)
    return {**GPU_XLA_OPTIONS, **(NONE_GPU_XLA_OPTIONS if env is None else _parse_options(env))}


def jit_step(ops: Ops, *, nested: bool = False) -> Callable:
    """jax.jit with the cache (argument 1) donated and `xla_options(ops)`: every step and score
    function, unsharded (here) or under shard_map (sharding/tp.py). `nested`: the function is
    also called inside another jit (score, from jdet.train), where JAX refuses compiler options,
    so it gets none on a CPU (on a GPU its options are empty in the modes jdet.train nests).
    The jitted function carries its options as `jdet_xla_options` (the executable cache's key)."""
    opts = xla_options(ops)
    if nested:  # jdet.train nests the invariant modes' score, which then take their caller's
        opts = {} if backend().cpu else {
            k: v for k, v in opts.items() if k not in GPU_XLA_OPTIONS}  # fmt: skip

    def jit(fn: Callable) -> Callable:
        jitted = jax.jit(fn, donate_argnums=(1,), **({"compiler_options": opts} if opts else {}))
        jitted.jdet_xla_options = opts  # jdet's executable cache keys by it (exec_cache.py)
        return jitted

    return jit


@functools.cache
def make_step_fn(cfg: ModelConfig, ops: Ops) -> Callable:
    """Cached per (cfg, ops): every LLM/engine over the same model shares one compile cache."""

    @jit_step(ops)
    def step(
        params: dict, kv: dict, batch: StepBatch, sampling: SamplingInputs
    ) -> tuple[dict, SampleOut]:
        return step_body(cfg, ops)(params, kv, batch, sampling)

    return step


@functools.cache
def make_score_fn(cfg: ModelConfig, ops: Ops) -> Callable:
    """score(params, kv, batch, targets i32[N]) -> (kv, f32[N]): log p(targets) at logits_rows."""

    @jit_step(ops, nested=True)
    def score(
        params: dict, kv: dict, batch: StepBatch, targets: jax.Array
    ) -> tuple[dict, jax.Array]:
        return score_body(cfg, ops)(params, kv, batch, targets)

    return score
