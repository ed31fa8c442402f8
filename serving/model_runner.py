"""Scheduled sequences -> one padded `StepBatch` + `SamplingInputs` -> the jitted step.

Why buckets: every distinct (T, S, N, Pmax) compiles the step once, so the token count T is padded
to a power of two from `min_tokens` up to `max_num_batched_tokens`, the sequence count S (= N, one
logits row per sequence) to a power of two up to `max_num_seqs`, and the page-table width Pmax to a
power of two up to the pages of `max_model_len`. Padding never changes a real row's bits: the
kernels' reduction plans do not depend on T or S (DESIGN §1).

Why `dispatch` and `fetch` are separate: JAX dispatch is asynchronous, so the engine dispatches
step n, does the host work of step n-1 (detokenisation, stop strings, streaming) while the device
runs, and only then blocks on step n's tokens. The KV cache is donated, so it is updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from serving.block_manager import cdiv
from serving.sequence import Sequence


def pow2_bucket(n: int, minimum: int, maximum: int) -> int:
    """Smallest power of two >= max(n, minimum), capped at `maximum` (itself a valid bucket)."""
    b = max(1, minimum)
    while b < n:
        b *= 2
    return min(b, maximum) if n <= maximum else n


def default_num_pages(
    cfg: Any,
    page_size: int,
    dtype: Any,
    *,
    max_model_len: int,
    max_num_seqs: int,
    memory_fraction: float = 0.85,
) -> int:
    """Pages that fit in the free device memory (GPU), or enough for a full batch (CPU)."""
    from jdet.kv_cache import kv_bytes_per_token

    page_bytes = kv_bytes_per_token(cfg, dtype) * page_size
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        stats = {}
    limit = stats.get("bytes_limit")
    if limit:
        free = int(limit * memory_fraction) - int(stats.get("bytes_in_use", 0))
        # The paged-attention kernel addresses each of k and v as one flat page pool with 32-bit
        # element offsets (Triton): keep L * K * P * B * E below 2**31.
        per_page = cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim
        cap = (2**31 - 1) // per_page
        return max(cdiv(max_model_len, page_size), min(free // page_bytes, cap))
    return min(cdiv(max_model_len, page_size) * max_num_seqs, 4096)


_STEP_FNS: dict[tuple[Any, str, str], Callable] = {}


def cached_step_fn(cfg: Any, invariance: str, kind: str = "step") -> Callable:
    """One jitted step (or score) function per (config, mode), shared by every engine in the
    process, so a second engine on the same model reuses the compiled buckets."""
    key = (cfg, invariance, kind)
    if key not in _STEP_FNS:
        from jdet.ops import Ops
        from jdet.step import make_score_fn, make_step_fn

        make = make_step_fn if kind == "step" else make_score_fn
        _STEP_FNS[key] = make(cfg, Ops(invariance=invariance))
    return _STEP_FNS[key]


class ModelRunner:
    """Holds the KV cache and the jitted step; builds batches. Knows nothing about scheduling."""

    def __init__(
        self,
        model: Any,
        *,
        invariance: str,
        num_pages: int,
        page_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        min_tokens_bucket: int = 16,
        min_seqs_bucket: int = 8,
        min_pages_bucket: int = 4,
        kv_dtype: Any = None,
        step_fn: Callable | None = None,
        tp: int = 1,
        sharded: bool | None = None,
    ) -> None:
        from jdet.kv_cache import init_kv_cache

        self.cfg = model.cfg
        self.params = model.params
        self.page_size = page_size
        self.max_tokens_bucket = max_num_batched_tokens
        self.max_seqs_bucket = max_num_seqs
        self.max_pages = cdiv(max_model_len, page_size)
        self.min_tokens_bucket = min(min_tokens_bucket, max_num_batched_tokens)
        self.min_seqs_bucket = min(min_seqs_bucket, max_num_seqs)
        self.min_pages_bucket = min(min_pages_bucket, self.max_pages)
        self.kv_dtype = kv_dtype or model.dtype
        self.score_fn = None
        if sharded is None:
            # "tp" mode runs on the sharded runtime even at tp=1 (padded FFN/vocab, the same tree),
            # so TP=1 and TP=N servers give the same bits.
            sharded = tp > 1 or invariance == "tp"
        if sharded and step_fn is None:
            # tensor parallel: weights padded and placed on a mesh of `tp` devices, the KV cache
            # split over kv heads, step/score under shard_map (sharding/tp.py)
            from sharding.tp import make_tp_runtime

            rt = make_tp_runtime(model.params, self.cfg, tp, invariance)
            self.params = rt.params
            self.kv = rt.init_kv(num_pages, page_size, self.kv_dtype)
            self.step_fn, self.score_fn = rt.step, rt.score
        else:
            self.kv = init_kv_cache(self.cfg, num_pages, page_size, self.kv_dtype)
            self.step_fn = step_fn or cached_step_fn(self.cfg, invariance)
        self.invariance = invariance
        self.shapes_seen: set[tuple[int, int, int]] = set()

    def score_step(self) -> Callable:
        """The teacher-forced score function matching this runner's step."""
        return self.score_fn or cached_step_fn(self.cfg, self.invariance, "score")

    # ------------------------------------------------------------------ host side
    def prepare(self, plan: list[tuple[Sequence, int]]) -> tuple[Any, Any]:
        """The padded numpy StepBatch and SamplingInputs for `plan` (one logits row per seq)."""
        from jdet.batch import StepBatch
        from jdet.step import SamplingInputs

        B = self.page_size
        T = sum(n for _, n in plan)
        S = len(plan)
        Tp = pow2_bucket(T, self.min_tokens_bucket, self.max_tokens_bucket)
        Sp = pow2_bucket(S, self.min_seqs_bucket, self.max_seqs_bucket)
        Pp = pow2_bucket(
            max(len(s.block_table) for s, _ in plan), self.min_pages_bucket, self.max_pages
        )
        self.shapes_seen.add((Tp, Sp, Pp))
        tok = np.zeros(Tp, np.int32)
        pos = np.zeros(Tp, np.int32)
        slot = np.full(Tp, -1, np.int32)
        qs = np.zeros(Sp + 1, np.int32)
        cl = np.zeros(Sp, np.int32)
        pt = np.zeros((Sp, Pp), np.int32)
        rows = np.zeros(Sp, np.int32)
        temp = np.zeros(Sp, np.float32)
        top_k = np.zeros(Sp, np.int32)
        top_p = np.ones(Sp, np.float32)
        seed = np.zeros(Sp, np.uint32)
        spos = np.zeros(Sp, np.int32)
        t0 = 0
        for s, (seq, n) in enumerate(plan):
            start = seq.num_computed_tokens
            p = np.arange(start, start + n, dtype=np.int32)
            pages = np.asarray(seq.block_table, np.int32)
            tok[t0 : t0 + n] = seq.token_ids[start : start + n]
            pos[t0 : t0 + n] = p
            slot[t0 : t0 + n] = pages[p // B] * B + p % B
            qs[s + 1] = t0 + n
            cl[s] = start + n
            pt[s, : len(pages)] = pages
            rows[s] = t0 + n - 1
            o = seq.options
            temp[s], top_k[s], top_p[s] = o.temperature, o.top_k, o.top_p
            seed[s] = seq.seed
            spos[s] = start + n  # the position the sampled token will occupy
            t0 += n
        qs[S + 1 :] = t0
        batch = StepBatch(tok, pos, slot, qs, cl, pt, rows)
        sampling = SamplingInputs(
            temperature=temp, top_k=top_k, top_p=top_p, seed=seed, position=spos
        )
        return batch, sampling

    def token_buckets(self) -> list[int]:
        out, b = [], self.min_tokens_bucket
        while b < self.max_tokens_bucket:
            out.append(b)
            b *= 2
        return out + [self.max_tokens_bucket]

    def warmup(self) -> int:
        """Compile the step for every token bucket at the largest S and Pmax buckets (the shapes a
        busy server uses; with `min_seqs_bucket == max_num_seqs` and `min_pages_bucket` at the
        maximum these are the only shapes). Writes junk K/V into free pages: call it before any
        request. Returns the number of shapes compiled."""
        from jdet.batch import StepBatch
        from jdet.step import SamplingInputs

        B, Sp, Pp = self.page_size, self.max_seqs_bucket, self.max_pages
        for Tp in self.token_buckets():
            n = min(Tp, Pp * B)  # tokens per sequence; sequences share pages 0.. (junk writes)
            S = min(Sp, -(-Tp // n))
            tok = np.arange(Tp, dtype=np.int32) % self.cfg.vocab_size
            pos = np.arange(Tp, dtype=np.int32) % n
            slot = pos.copy()
            qs = np.full(Sp + 1, Tp, np.int32)
            qs[: S + 1] = np.minimum(np.arange(S + 1) * n, Tp)
            cl = np.zeros(Sp, np.int32)
            cl[:S] = np.diff(qs[: S + 1])
            pt = np.tile(np.arange(Pp, dtype=np.int32), (Sp, 1))
            rows = np.zeros(Sp, np.int32)
            rows[:S] = qs[1 : S + 1] - 1
            z = np.zeros(Sp, np.float32)
            sampling = SamplingInputs(
                temperature=z + 1,
                top_k=np.zeros(Sp, np.int32),
                top_p=z + 0.9,
                seed=np.zeros(Sp, np.uint32),
                position=cl.copy(),
            )
            out = self.dispatch(StepBatch(tok, pos, slot, qs, cl, pt, rows), sampling)
            jax.block_until_ready(out.tokens)
            self.shapes_seen.add((Tp, Sp, Pp))
        return len(self.token_buckets())

    # ------------------------------------------------------------------ device side
    def dispatch(self, batch: Any, sampling: Any) -> Any:
        """Launch the step (returns at once: JAX dispatch is asynchronous)."""
        self.kv, out = self.step_fn(self.params, self.kv, batch, sampling)
        return out

    @staticmethod
    def fetch(out: Any, num_rows: int, want_top: bool) -> dict[str, np.ndarray]:
        """Block on a dispatched step and bring its first `num_rows` samples to the host."""
        names = ["tokens", "logprobs"] + (["top_ids", "top_logprobs"] if want_top else [])
        got = jax.device_get([getattr(out, k) for k in names])
        return {k: np.asarray(v)[:num_rows] for k, v in zip(names, got, strict=True)}
