"""Scheduled sequences -> one padded `StepBatch` + `SamplingInputs` -> the jitted step.

The runner holds the device side: the weights, the KV pool and the jitted step and score
functions. A step's inputs are built on the host by step_inputs.py, one function per kind. It
runs only the shapes of its `ShapeSet` (serving/engine/shapes.py: why a bounded set, what padding
costs, why it never changes a real row's bits), all compiled by `warmup()` before it serves.

Why `dispatch` and `fetch` are separate: JAX dispatch is asynchronous, so the engine dispatches
step n, does the host work of step n-1 (detokenisation, stop strings, streaming) while the device
runs, and only then blocks on step n's tokens. The KV cache is donated, so it is updated in place.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from jdet import compile_cache, exec_cache
from jdet.kv_cache import kv_shape, make_halves, storage_dtype
from jdet.ops import Ops
from jdet.plan import Plan
from jdet.step import make_score_fn, make_step_fn
from jdet.tp_layout import kv_heads_in_cache
from serving.constrained.logits_rows import LogitsRows
from serving.engine import host_inputs as hi
from serving.engine import sampler_variants, step_inputs
from serving.engine.host_inputs import SplitScore
from serving.engine.page_manager import cdiv
from serving.engine.shapes import ShapeSet
from serving.engine.warmup import warmup, warmup_batch
from serving.sequence import Sequence
from sharding.mesh import TP_AXIS
from sharding.tp import make_tp_runtime


def cached_step_fn(cfg: Any, invariance: str, kind: str = "step") -> Callable:
    """The unsharded jitted step (or score) of (config, mode). jdet/step.py caches one per
    (config, Ops), the one step cache: every engine in the process shares it, so a second
    engine on the same model reuses the compiled buckets."""
    make = make_step_fn if kind == "step" else make_score_fn
    return make(cfg, Ops(invariance=invariance))


class ModelRunner:
    """Holds the weights, the KV cache and the jitted step; its `prepare*` methods build a step's
    inputs (step_inputs.py). Knows nothing about scheduling."""

    def __init__(
        self,
        model: Any,
        config: Any,
        *,
        kv_dtype: Any = None,
        step_fn: Callable | None = None,
        sharded: bool | None = None,
        rows_per_seq: int = 1,
    ) -> None:
        """`config`: the engine's `EngineConfig`, whole, with `max_model_len` and `num_pages`
        resolved (`num_pages` None: the engine sizes the pool first, `allocate_kv`). What is not
        config: the model (weights, model config), `rows_per_seq`: sampled rows one sequence may
        take in a step (K + 1 with speculative decoding, serving/speculative/speculator.py: the S
        bucket allows max_num_seqs of that many); `kv_dtype`, `step_fn`, `sharded`: for tests
        and benchmarks."""
        invariance, tp, page_size = config.invariance, config.tp, config.page_size
        num_pages, max_model_len = config.num_pages, config.max_model_len
        min_tokens_bucket, min_pages_bucket = config.min_tokens_bucket, config.min_pages_bucket
        self.config = config
        self.cfg = model.cfg
        self.params = model.params
        self.page_size = page_size
        self.max_pages = cdiv(max_model_len, page_size)
        self.shapes = ShapeSet.build(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs * rows_per_seq,
            max_pages=self.max_pages,
            min_tokens_bucket=min_tokens_bucket,
            min_seqs_bucket=config.min_seqs_bucket,
            min_pages_bucket=min_pages_bucket,
            stall_free_budget=config.stall_free_budget,
        )
        self._min_tokens_bucket, self._min_pages_bucket = min_tokens_bucket, min_pages_bucket
        self.kv_dtype = kv_dtype or model.dtype
        self.score_fn = None
        self._score_cached = False  # score_fn behind the executable cache yet (score_step)
        self._split_score: tuple[Callable, Callable] | None = None  # a CPU's (forward, logprobs)
        if sharded is None:  # the plan decides (jdet/plan.py `Plan.sharded`)
            sharded = Plan(self.cfg, invariance, tp).sharded
        if sharded and step_fn is None:
            # tensor parallel: weights padded and placed on a mesh of `tp` devices, the KV cache
            # split over kv heads, step/score under shard_map (sharding/tp.py)
            rt = make_tp_runtime(model.params, self.cfg, tp, invariance,
                                 donate=config.donate_weights)  # fmt: skip
            replicated = jax.sharding.NamedSharding(rt.mesh, jax.sharding.PartitionSpec())
            self.params = rt.params
            self._init_kv = lambda n: rt.init_kv(n, page_size, self.kv_dtype)
            self._kv_sharding = jax.sharding.NamedSharding(rt.mesh, PartitionSpec(None, TP_AXIS))
            self.kv_devices = tp
            self.step_fn, self.score_fn = rt.step, rt.score
            # where a step's sampled tokens live (replicated over the mesh): see dispatch
            self.token_sharding = NamedSharding(rt.mesh, PartitionSpec())
        else:
            replicated = None
            self.token_sharding = SingleDeviceSharding(jax.devices()[0])
            # committed to the device, as every step's returned cache is: an uncommitted first
            # cache is another argument sharding, so the first step shape compiled twice
            self._init_kv = lambda n: make_halves(
                lambda: jax.device_put(
                    jnp.zeros(kv_shape(self.cfg, n, page_size), storage_dtype(self.kv_dtype)),
                    self.token_sharding,
                )
            )
            self._kv_sharding = self.token_sharding
            self.kv_devices = 1
            self.step_fn = step_fn or cached_step_fn(self.cfg, invariance)
        self.kv: dict | None = None
        if num_pages is not None:  # None: the engine sizes the pool first (`allocate_kv`)
            self.allocate_kv(num_pages)
        self._mesh = rt.mesh if sharded and step_fn is None else None
        # host token ids -> the device, placed as token_sharding (see place_tokens)
        self._put_tokens = jax.jit(lambda t: t, out_shardings=self.token_sharding)
        # per-request logits transforms and structured output (serving/constrained/logits_rows.py)
        self.logits_rows = LogitsRows(model, self.cfg.vocab_size, replicated)
        self.invariance = invariance
        self.shapes_seen: set[tuple[int, int, int]] = set()
        self.ahead_cache: tuple | None = None  # (key, rows) of the last decode plan
        # the sampler variants steps may run (sampler_variants.py `engine_variants`); warm-up
        # compiles exactly these
        self.variants = sampler_variants.engine_variants(config.sampler_variants)
        self.tp = tp
        split = hi.split_step_here(config.step_programs)  # checked even where step_fn is given
        if step_fn is None:  # jdet's own step: warm-up may load it from the executable cache
            # its small host arrays travel in one copy (serving/engine/host_inputs.py says why)
            if split:  # the forward, then the sampler (host_inputs.py says why)
                forward, sampler, logprobs = hi.split_step_fn(self.cfg, invariance, self._mesh)
                self.step_fn = hi.SplitStep(
                    self._exec_cached(forward, "forward"),
                    self._exec_cached(sampler, "sampler", params_first=False),
                    self.cfg.vocab_size, self.token_sharding,
                )  # fmt: skip
                if invariance != "none":
                    # score(): the same forward, then the sampler's log-softmax (`SplitScore`).
                    # Not "none": XLA's threaded program fuses its score differently, so its
                    # bits would move (the embedded model's score hash did); it keeps its own
                    self._split_score = (forward, logprobs)
            else:
                run = hi.packed_step_fn(self.step_fn, invariance)
                self.step_fn = hi.PackedStep(self._exec_cached(run, "step"))

    def allocate_kv(self, num_pages: int) -> None:
        """Create the zeroed KV pool of `num_pages` pages (any earlier pool is freed first, so
        the two never coexist)."""
        self.kv = None
        self.kv = self._init_kv(num_pages)
        self.num_pages = num_pages

    def abstract_kv(self, num_pages: int) -> dict:
        """The pool of `num_pages` pages as shapes and placements only (nothing allocated):
        what a compile for memory analysis takes (serving/engine/memory.py)."""
        heads = self.cfg.num_kv_heads
        if self._mesh is not None:
            heads = kv_heads_in_cache(self.cfg, self.tp)
        shape = (self.cfg.num_layers, heads, num_pages, self.page_size, self.cfg.head_dim)
        dt = storage_dtype(self.kv_dtype)
        return {n: jax.ShapeDtypeStruct(shape, dt, sharding=self._kv_sharding) for n in "kv"}

    def set_max_model_len(self, max_model_len: int) -> None:
        """Shrink the longest sequence (a pool smaller than one sequence of the model's own
        length): the page-table buckets follow."""
        self.max_pages = cdiv(max_model_len, self.page_size)
        s = self.shapes
        self.shapes = ShapeSet.build(
            max_num_batched_tokens=s.tokens[-1], max_num_seqs=s.max_seqs,
            max_pages=self.max_pages, min_tokens_bucket=self._min_tokens_bucket,
            min_seqs_bucket=s.min_seqs, min_pages_bucket=self._min_pages_bucket,
            stall_free_budget=s.stall,
        )  # fmt: skip

    def score_step(self) -> Callable:
        """The teacher-forced score function matching this runner's step: on a CPU in "tp" and
        "batch" the step's own forward, then the sampler's log-softmax
        (serving/engine/host_inputs.py `SplitScore`)."""
        if not self._score_cached:
            if self._split_score is not None:
                forward, logprobs = self._split_score
                # jdet's executable cache keys it as the score; a shape it shares with a warmed
                # step compiles once (XLA's persistent cache serves the second, whose entry a
                # CPU then does not write: jdet/exec_cache.py `warm`)
                fn = SplitScore(self._exec_cached(forward, "score"), logprobs, self.place_tokens)
            else:
                fn = self._exec_cached(
                    self.score_fn or cached_step_fn(self.cfg, self.invariance, "score"), "score"
                )
            self.score_fn, self._score_cached = fn, True
        return self.score_fn

    def _exec_cached(self, fn: Callable, kind: str, params_first: bool = True) -> Callable:
        """`fn` behind jdet's executable cache (jdet/exec_cache.py; off with the compile cache):
        warm-up loads each shape's executable from disk instead of tracing it, and so does each
        shape's first call with the config's `exec_cache_on_call`."""
        static: dict[str, Any] = {"cfg": repr(self.cfg), "invariance": self.invariance}
        if self._mesh is not None:
            name = f"sharding.tp.make_tp_{kind}"
            devices = list(self._mesh.devices.flat)
            static.update(tp=self.tp, mesh=[list(self._mesh.axis_names), dict(self._mesh.shape)])
        else:
            name = f"jdet.step.make_{kind}_fn"
            devices = [jax.devices()[0]]
            static["ops"] = repr(Ops(invariance=self.invariance))
        return exec_cache.wrap(
            fn, name=name, static=static, devices=devices, directory=compile_cache.exec_dir(),
            params_first=params_first, load_on_call=self.config.exec_cache_on_call,
        )  # fmt: skip

    # ------------------------------------------------------------------ host side
    def prepare(self, plan: list[tuple[Sequence, int]]) -> tuple[Any, Any]:
        """The padded StepBatch and SamplingInputs of `plan`, sequences that sample
        (step_inputs.py `sample_inputs`)."""
        return step_inputs.sample_inputs(self, plan)

    def neutral_logits(self, variant: sampler_variants.Variant, Sp: int, Pp: int) -> Any:
        """SamplingInputs.logits of a step none of whose rows has transforms: the cached
        neutral LogitsInputs, or None in a variant without transforms (GREEDY)."""
        return self.logits_rows.neutral(Sp, Pp * self.page_size) if variant.transforms else None

    def prepare_score(self, plan: list[tuple[Sequence, int]]) -> tuple[Any, np.ndarray]:
        """The padded StepBatch and targets [T] of score requests (step_inputs.py
        `score_inputs`)."""
        return step_inputs.score_inputs(self, plan)

    def dispatch_score(self, batch: Any, targets: np.ndarray) -> Any:
        """Launch the score function on a `prepare_score` batch (asynchronous, like `dispatch`):
        its result is the f32 [T] log-probs of the targets."""
        self.kv, out = self.score_step()(self.params, self.kv, batch, targets)
        return out

    def as_step(self, batch: Any) -> tuple[Any, Any]:
        """A `prepare_score` batch as a step's inputs, for a separate draft model's cache
        (step_inputs.py `score_as_step`)."""
        return step_inputs.score_as_step(self, batch)

    def prepare_ahead(self, plan: list[tuple[Sequence, int]], tokens: Any) -> tuple | None:
        """The decode step after the one in flight, its input tokens that step's samples on
        the device; None when the host must see them first (step_inputs.py `ahead_inputs`)."""
        return step_inputs.ahead_inputs(self, plan, tokens)

    def pad_tokens(self, n: int, t: int) -> Callable:
        """A device function padding n token ids to t with zeros (what the host pads with),
        placed like a step's input tokens (`place_tokens`): one executable of the step serves
        tokens from the host and from the device either way."""
        return _pad_fn(n, t, self.token_sharding)

    def warmup_batch(
        self, shape: tuple[int, int, int], kind: str = "step",
        variant: sampler_variants.Variant = sampler_variants.FULL,
    ) -> tuple[Any, Any]:  # fmt: skip
        """A junk batch of `shape` that writes no K/V (serving/engine/warmup.py `warmup_batch`)."""
        return warmup_batch(self, shape, kind, variant)

    def warmup(self, kind: str = "step", progress: bool = True, should_stop: Any = None) -> float:
        """Compile (or load) `kind` for every shape of the set (serving/engine/warmup.py `warmup`);
        returns the seconds."""
        return warmup(self, kind, progress, should_stop)

    # ------------------------------------------------------------------ device side
    def dispatch(self, batch: Any, sampling: Any) -> Any:
        """Launch the step (returns at once: JAX dispatch is asynchronous).

        Host token ids go to the device placed like a step's sampled tokens, which an ahead
        step (`prepare_ahead`) takes as its input: one placement, so one executable per shape
        whichever way the tokens came (a host array and a device array would be two)."""
        self.kv, out = self.step_fn(self.params, self.kv, self.place_tokens(batch), sampling)
        return out

    def place_tokens(self, batch: Any) -> Any:
        """`batch` with host token ids on the device, placed like a step's sampled tokens.
        Through a jitted identity with that output placement: the same committed array as
        jax.device_put gives (one executable of the step serves both), in a fraction of
        jax.device_put's host time (benchmarks/host_bench.py)."""
        if isinstance(batch.token_ids, np.ndarray):
            batch = dataclasses.replace(batch, token_ids=self._put_tokens(batch.token_ids))
        return batch

    @staticmethod
    def fetch(out: Any, num_rows: int, want_top: bool) -> dict[str, np.ndarray]:
        """Block on a dispatched step and bring its first `num_rows` samples to the host."""
        if want_top and out.top_ids.shape[-1] == 0:  # serving/engine/sampler_variants.py: never
            raise RuntimeError("the step ran the sampler variant without top log-probs, but a "
                               "sequence of it asked for them")  # fmt: skip
        names = ["tokens", "logprobs"] + (["top_ids", "top_logprobs"] if want_top else [])
        arrays = [getattr(out, k) for k in names]
        # What jax.device_get does (start every copy, then wait for each), without its per-leaf
        # tree and dtype dispatch, a share of the host's decode step on a CPU (host_bench).
        for a in arrays:
            a.copy_to_host_async()
        return {k: np.asarray(a)[:num_rows] for k, a in zip(names, arrays, strict=True)}


@functools.cache  # one per (n, t, placement) in the process: every engine shares its compile
def _pad_fn(n: int, t: int, sharding: Any) -> Callable:
    return jax.jit(lambda x: jnp.pad(x, (0, t - n)), out_shardings=sharding)
