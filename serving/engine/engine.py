"""The engine: add_request / step / abort over the scheduler, page manager and model runner.

One `step()`:
  1. schedule (stall-free: decodes first, then prefill chunks within the token budget);
  2. build the padded batch and dispatch the jitted step (asynchronous);
  3. while the device runs: detokenise, check stop strings and build the streaming outputs of the
     *previous* step (vLLM's "async output processing");
  4. block on this step's tokens; append them; finish on EOS / stop token / max_tokens /
     max_model_len right away (token-level, so no step is wasted on those).
A sequence that a stop *string* finishes in (3) was already part of step n; its extra token is
dropped, never reported. Outputs therefore trail the device by one step.

Nothing here can change a token's bits: which step, batch or chunk a token is computed in does
not matter (DESIGN §1); sampling randomness is keyed by (seed, position).

Fault isolation: no request can hurt another. Input is checked at `add_request` against the
bounds of the step's arrays (`SamplingOptions.check`, `check_prompt_ids`). If building the batch
or detokenising still raises, the engine finds the request it belongs to, ends only that request
with `finish_reason="error"` (pages freed) and steps the others on; since a row's bits do not
depend on the batch, they are unchanged. An error that belongs to no one request (the device step
itself) is logged with its traceback, every request is ended with the error, the KV pool and page
accounting are reset and checked (`recover`), and `EngineStepError` is raised to the caller.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from jdet import compile_cache as cc
from jdet.plan import Plan
from jdet.settings import EngineConfig, resolve_async
from jdet.spec_config import SpeculativeConfig
from serving.engine.faults import EngineStepError, FaultIsolation
from serving.engine.memory import check_utilization, device_limit, size_pool
from serving.engine.metrics import EngineMetrics, SpecCollector
from serving.engine.model_runner import ModelRunner
from serving.engine.outputs import Reporting, RequestUpdate
from serving.engine.page_manager import PageManager
from serving.engine.scheduler import Scheduler
from serving.engine.scoring import Scoring, split_scores
from serving.engine.shapes import kv_pool, model_len_limit
from serving.sampling_options import InvalidRequest, SamplingOptions, check_prompt_ids
from serving.sequence import Request, Sequence, Status, derive_seed
from serving.speculative.speculator import Speculator, num_rows

log = logging.getLogger("jdet.engine")

class Engine(FaultIsolation, Reporting, Scoring):
    """Continuous batching over one model replica. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        model: Any,
        config: Any = None,
        *,
        step_fn: Any = None,
        sharded: bool | None = None,
        watermark: float = 0.01,
        keep_raw_metrics: bool = False,
        speculative: Any = None,
        **settings: Any,
    ) -> None:
        """`config`: the engine's settings, a `jdet.settings.EngineConfig` passed whole (fields,
        defaults and help text there; `dtype` is the loader's, unused here); keyword `settings`
        replace single fields of it (`Engine(model, max_num_seqs=8)`). `speculative`: a
        `jdet.SpeculativeConfig` (or dict) for speculative decoding
        (serving/speculative/speculator.py). `step_fn`, `sharded`, `watermark`, `keep_raw_metrics`:
        for tests and benchmarks."""
        self.config = config = dataclasses.replace(config or EngineConfig(), **settings)
        invariance, tp, page_size = config.invariance, config.tp, config.page_size
        max_num_batched_tokens, max_num_seqs = config.max_num_batched_tokens, config.max_num_seqs
        max_model_len, num_pages = config.max_model_len, config.num_pages
        compile_cache, async_scheduling = config.compile_cache, config.async_scheduling

        self.compile_cache_dir = cc.enable(compile_cache)
        cc.install_counter()

        # the reduction plan, validated here once: kernels, padding, TP runtime, fingerprint
        self.plan = Plan(model.cfg, invariance, tp)
        self.invariance = self.plan.invariance
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.model = model
        self.cfg = model.cfg
        self.tokenizer = model.tokenizer
        util = check_utilization(config.gpu_memory_utilization)
        # On a device with a memory limit the pool is sized after the weights are placed, from
        # the compiled step's own peak (serving/engine/memory.py); elsewhere it has a fixed default.
        sized = num_pages is None and device_limit() is not None
        if sized:
            self.max_model_len = model_len_limit(self.cfg, max_model_len)
        else:
            self.max_model_len, num_pages = kv_pool(
                self.cfg, model.dtype, page_size=page_size, max_model_len=max_model_len,
                num_pages=num_pages, max_num_seqs=max_num_seqs,
            )  # fmt: skip
        self.page_size = page_size
        self.tp = tp
        self.speculative = SpeculativeConfig.from_any(speculative)
        self.runner = ModelRunner(
            model,
            invariance=invariance,
            num_pages=num_pages,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            min_tokens_bucket=config.min_tokens_bucket,
            min_seqs_bucket=config.min_seqs_bucket,
            min_pages_bucket=config.min_pages_bucket,
            step_fn=step_fn,
            tp=tp,
            sharded=sharded,
            rows_per_seq=1 + (self.speculative.num_tokens if self.speculative else 0),
        )
        self.memory_budget = None  # memory.py Budget where the pool was sized from it
        if sized:  # the pool is allocated here, once the weights are placed
            num_pages, self.max_model_len, self.memory_budget = size_pool(
                self.runner, util, self.max_model_len, may_shrink=max_model_len is None,
                step_tokens=max_num_batched_tokens, exec_dir=cc.exec_dir(),
            )  # fmt: skip
        self.speculator = None  # speculative decoding: drafts + acceptance
        if self.speculative is not None:
            self.speculator = Speculator(self.speculative, max_model_len=self.max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.page_manager = PageManager(
            num_pages, page_size, enable_prefix_caching=config.enable_prefix_caching,
            watermark=watermark,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.page_manager,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=config.scheduling,
            verify_tokens=self.speculator.verify_tokens if self.speculator else None,
        )
        if self.speculator is not None:  # a model draft runs on the target's runner
            self.speculator.attach(self.runner, self.invariance)
        self.metrics = EngineMetrics(keep_raw=keep_raw_metrics)
        self.metrics.kv_pages_total.set(num_pages)
        if self.speculator is not None:  # acceptance in /metrics
            self.metrics.registry.register(SpecCollector(self.speculator))
        self.eos_token_ids = set(self.cfg.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None:
            if getattr(self.tokenizer, "eos_token_id", None) is not None:
                self.eos_token_ids = {int(self.tokenizer.eos_token_id)}
        self.requests: dict[str, Request] = {}
        self._pending: dict[Sequence, None] = {}  # sequences with tokens not yet reported
        self.num_steps = 0
        self.warm: set[str] = set()  # the kinds ("step", "score") whose shapes are compiled
        self.async_scheduling = resolve_async(async_scheduling)
        self._inflight: tuple[list, Any] | None = None  # a step dispatched ahead, not yet fetched
        self.num_steps_ahead = 0  # steps dispatched before their input tokens reached the host
        self.num_mixed_steps = 0  # steps that ran score requests beside sampling ones
        # Test hook for fault injection: called with each scheduled sequence while the step's
        # batch is built; whatever it raises is treated as that sequence's fault.
        self.fault_injector: Callable[[Sequence], None] | None = None

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: Any = None,
        arrival_time: float | None = None,
    ) -> int:
        """Queue a request (validated here too: the offline API calls this directly).

        Returns the request's seed: the given one, or the one drawn now, so that the output can
        be reproduced by resending the request with that seed.
        """
        opts = SamplingOptions.from_any(params)
        self._validate(request_id, prompt_token_ids, opts)
        seed = int(opts.seed) if opts.seed is not None else secrets.randbits(32)
        now = time.perf_counter() if arrival_time is None else arrival_time
        prompt = [int(t) for t in prompt_token_ids]
        seqs = [
            Sequence(request_id, i, prompt, opts, seed=derive_seed(seed, i), arrival_time=now)
            for i in range(opts.n)
        ]
        self.requests[request_id] = Request(request_id, prompt, seed, seqs, now)
        for s in seqs:
            self.scheduler.add(s)
        self.metrics.prompt_tokens.inc(len(prompt))
        return seed

    def _validate(self, request_id: str, prompt: list[int], o: SamplingOptions) -> None:
        """The shared boundary check (serving/sampling_options.py) plus what the engine knows."""
        if not isinstance(request_id, str) or request_id in self.requests:
            raise InvalidRequest("request_id", f"request_id {request_id!r} is already in use")
        check_prompt_ids(
            prompt, vocab_size=self.cfg.vocab_size, max_model_len=self.max_model_len, field="prompt"
        )
        o.check(self.cfg.vocab_size)
        self.runner.logits_rows.check(o)  # structured output, bad_words (need the tokenizer)
        if o.stop and self.tokenizer is None:
            raise InvalidRequest("stop", "stop strings need a tokenizer")

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its pages return at once. False if unknown/finished."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if not s.is_finished:
                self.scheduler.finish(s)
                s.finish_reason = "abort"
            self._pending.pop(s, None)
        self.metrics.finished.labels("abort").inc()
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestUpdate]:
        """One engine iteration; returns outputs for requests that made visible progress.

        With `async_scheduling`, a step whose sequences all sample and are all the running ones
        (steady decode) dispatches the next decode step before its own tokens reach the host:
        the next step's input tokens are this step's device output (`_dispatch_ahead`)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            plan, out = inflight  # dispatched by the previous call, from device-side tokens
        else:
            if self.speculator is not None:  # drafts before the budget is shared
                self.speculator.propose(self.scheduler.running)
            plan, out = self.scheduler.schedule(), None
            if self.speculator is not None:  # a model draft drafts for the verifies planned
                self.speculator.fill(plan)
            now = time.perf_counter()
            for seq, _ in plan:
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
                    self.metrics.observe("queue", now - seq.arrival_time)
        scoring: list[tuple[Sequence, int]] = []  # this step's score requests (scoring.py)
        try:
            if plan and out is None:
                plan, (prepared, score_in) = self._prepare(plan)
                plan, scoring = split_scores(plan)
                scored = self._dispatch_score(score_in)
                self.num_mixed_steps += bool(plan and scoring)
                if plan:
                    out = self.runner.dispatch(*prepared)
                    if self.speculator is not None:  # a draft model's cache follows
                        self.speculator.mirror(prepared)
            # sampled rows per entry, fixed now (`_report` may end a sequence meanwhile)
            nrows = [num_rows(s, n) for s, n in plan] if self.speculator else [1] * len(plan)
            if plan and self.async_scheduling:  # speculating: only without drafts
                self._inflight = self._dispatch_ahead(plan, out)
            outputs = self._report()  # overlaps with the device
            if plan:
                want_top = any(s.options.logprobs for s, _ in plan)
                res = self.runner.fetch(out, sum(nrows), want_top)
                if self.speculator is not None and self.speculator.rejection:
                    res.update(self.speculator.fetch_extra(out, sum(nrows)))
                self._apply(plan, res, nrows)
            if scoring:
                self._apply_scores(scoring, scored)
            if self._inflight is not None and not any(
                s.status is Status.RUNNING for s, _ in self._inflight[0]
            ):
                self._inflight = None  # every row of it finished meanwhile: nothing to fetch
            if not self.scheduler.has_work():
                outputs += self._report()
        except Exception as e:
            self._inflight = None
            log.exception("engine step failed and no single request explains it")
            self.recover(f"engine step failed: {type(e).__name__}: {e}")
            raise EngineStepError(f"engine step failed: {type(e).__name__}: {e}") from e
        self._update_gauges(plan + scoring)
        return outputs

    def _dispatch_ahead(self, plan: list[tuple[Sequence, int]], out: Any) -> Any:
        """Dispatch the decode step after `plan` (still on the device) with `out.tokens` as its
        input tokens, or return None when the host must see this step first: a sequence that
        does not sample, a waiting or unscheduled sequence, a sequence certain to end
        (max_tokens / max_model_len), too few pages, or another shape. Positions, slots and
        sampling inputs are known on the host; a sequence that this step ends (EOS, stop token,
        stop string) wastes its row of the next step, whose output is then dropped — its pages
        are still its own while both steps run, since the device runs them in order."""
        sched = self.scheduler
        if sched.waiting or len(plan) != len(sched.running):
            return None
        if self.speculator is not None and not self.speculator.can_run_ahead(plan):
            return None  # a verify's successor depends on how many drafts it accepts
        for seq, n in plan:
            o = seq.options
            if seq.status is not Status.RUNNING or n != seq.num_uncomputed:
                return None
            if seq.num_tokens + 2 > self.max_model_len or (
                o.max_tokens is not None and seq.num_output_tokens + 2 > o.max_tokens
            ):
                return None
        if self.fault_injector is not None:  # tests: a batch build that raises goes the ordinary
            try:  # way, whose `_prepare` ends the faulty request alone
                for seq, _ in plan:
                    self.fault_injector(seq)
            except Exception:  # noqa: BLE001 - whose fault it was is found there
                return None
        if not all(self.page_manager.grow(seq, n + 1) for seq, n in plan):
            return None
        nxt = [(seq, 1) for seq, _ in plan]
        prepared = self.runner.prepare_ahead(nxt, out.tokens)
        if prepared is None:
            return None
        self.num_steps_ahead += 1
        if self.speculator is not None:  # rejection mode's inputs; a draft model's cache follows
            prepared = self.speculator.ahead(nxt, prepared)
        return nxt, self.runner.dispatch(*prepared)

    def _apply(self, plan: list[tuple[Sequence, int]], res: dict, nrows: list[int]) -> None:
        rows: Any = range(len(plan))  # each plan entry's sampled row
        if self.speculator is not None:
            plan, rows = self.speculator.accept_drafts(plan, res, nrows, self._append, self._ends)
        self.scheduler.advance(plan)
        for i, (seq, _) in zip(rows, plan, strict=True):
            if seq.status is not Status.RUNNING or seq.num_uncomputed > 0:
                continue  # finished meanwhile, or a prefill chunk that samples nothing
            tok = self._append(seq, res, i)
            o = seq.options
            if tok in o.stop_token_ids or (not o.ignore_eos and tok in self.eos_token_ids):
                self._finish(seq, "stop", tok if tok in o.stop_token_ids else None)
            elif (o.max_tokens is not None and seq.num_output_tokens >= o.max_tokens) or (
                seq.num_tokens >= self.max_model_len
            ):
                self._finish(seq, "length")

    def _append(self, seq: Sequence, res: dict, i: int) -> int:
        """Append the token sampled in row `i` (and its log-probs) to `seq`."""
        tok = int(res["tokens"][i])
        seq.token_ids.append(tok)
        seq.logprobs.append(float(res["logprobs"][i]))
        k = seq.options.logprobs
        if k:
            ids, lps = res["top_ids"][i, :k], res["top_logprobs"][i, :k]
            seq.top_logprobs.append([(int(a), float(b)) for a, b in zip(ids, lps, strict=True)])
        self._pending[seq] = None
        self.metrics.generation_tokens.inc()
        return tok

    def _ends(self, seq: Sequence, tok: int, m: int) -> bool:
        """Whether `tok`, as the m-th token appended to `seq` now, finishes it (`_apply`)."""
        o = seq.options
        return (
            tok in o.stop_token_ids
            or (not o.ignore_eos and tok in self.eos_token_ids)
            or (o.max_tokens is not None and seq.num_output_tokens + m >= o.max_tokens)
            or seq.num_tokens + m >= self.max_model_len
        )

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _update_gauges(self, plan: list[tuple[Sequence, int]]) -> None:
        self.num_steps += 1
        if plan:
            self.metrics.observe("step_tokens", sum(n for _, n in plan))
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Bring the Prometheus gauges and counters up to date with the engine state."""
        self.metrics.refresh(self.page_manager, self.scheduler)

    # ------------------------------------------------------------------ convenience
    def warmup(self, kind: str = "step", progress: bool = False, should_stop: Any = None) -> float:
        """Compile `kind` ("step", or "score" for `score()`) for every shape of the engine's shape
        set now, so no request ever waits for a compile; seconds taken (0 if already warm).
        Writes no K/V, so it is safe at any time; `should_stop()` may cut it short."""
        if kind not in ("step", "score"):
            raise ValueError(f"warmup kind must be 'step' or 'score', got {kind!r}")
        if kind in self.warm:
            return 0.0
        dt = self.runner.warmup(kind, progress=progress, should_stop=should_stop)
        if kind == "step" and self.speculator is not None:  # the draft's passes too
            t0 = time.perf_counter()
            self.speculator.warmup()
            dt += time.perf_counter() - t0
        if should_stop is None or not should_stop():
            self.warm.add(kind)
        return dt

    def run(self) -> list[RequestUpdate]:
        """Step until every request finished; return the final output of each (arrival order)."""
        order = list(self.requests)
        final: dict[str, RequestUpdate] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r] for r in order if r in final]
