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
not matter (README.md); sampling randomness is keyed by (seed, position).

One unit: the engine owns its scheduler, page manager and model runner, its request table and its
metrics; what it delegates are plain functions or objects with their own interfaces, given what
they need: the request table (request_table.py: requests by id, what is not yet reported),
admission's checks (admission.py), fault isolation (faults.py), score requests (scoring.py),
speculative decoding (serving/speculative/ `Speculator`). None of them reads the engine itself.

Validation happens once, at admission (admission.py says why the engine's): `add_request` runs
`Admission.check_request` unless the caller already did (`checked=True`: the server does, in a
worker thread). Fault isolation: a request that still makes its batch fail ends alone
(faults.py); the device step failing ends every request, the engine resets (`recover`) and
raises `EngineStepError`.
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
from jdet.settings import EngineConfig, resolve_async, with_step_tokens
from jdet.spec_config import SpeculativeConfig
from serving.engine import faults
from serving.engine.admission import Admission
from serving.engine.faults import EngineStepError
from serving.engine.memory import runner_with_pool
from serving.engine.metrics import EngineMetrics, SpecCollector
from serving.engine.model_runner import ModelRunner
from serving.engine.outputs import RequestUpdate
from serving.engine.page_manager import PageManager
from serving.engine.request_table import RequestTable, finish
from serving.engine.scheduler import Scheduler
from serving.engine.scoring import record_scores, score_request, split_scores
from serving.sampling_options import SamplingOptions
from serving.sequence import Request, Sequence, Status, eos_token_ids
from serving.speculative.speculator import Speculator, num_rows

log = logging.getLogger("jdet.engine")


class Engine:
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
        config = dataclasses.replace(config or EngineConfig(), **settings)
        self.config = config = with_step_tokens(config)  # unset: the backend's default
        self.compile_cache_dir = cc.enable(config.compile_cache)
        cc.install_counter()
        # the reduction plan, validated here once: kernels, padding, TP runtime, fingerprint
        self.plan = Plan(model.cfg, config.invariance, config.tp)
        self.invariance = self.plan.invariance
        if min(config.max_num_batched_tokens, config.stall_free_budget, config.max_num_seqs) < 1:
            raise ValueError("max_num_batched_tokens, stall_free_budget, max_num_seqs must be >= 1")
        page_size = config.page_size
        if page_size < 1 or page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        self.model, self.cfg, self.tokenizer = model, model.cfg, model.tokenizer
        self.page_size, self.tp = page_size, config.tp
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.speculative = SpeculativeConfig.from_any(speculative)
        rows = 1 + (self.speculative.num_tokens if self.speculative else 0)
        # the runner gets the config whole, with the pool and length resolved (memory.py)
        self.runner, num_pages, self.max_model_len, self.memory_budget = runner_with_pool(
            model, config, lambda c: ModelRunner(model, c, step_fn=step_fn, sharded=sharded,
                                                 rows_per_seq=rows),
        )  # fmt: skip
        self.speculator = None  # speculative decoding: drafts + acceptance
        if self.speculative is not None:
            self.speculator = Speculator(self.speculative, max_model_len=self.max_model_len)
        self.page_manager = PageManager(
            num_pages, page_size, enable_prefix_caching=config.enable_prefix_caching,
            watermark=watermark,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.page_manager,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            policy=config.scheduling,
            verify_tokens=self.speculator.verify_tokens if self.speculator else None,
            stall_free_budget=config.stall_free_budget,
            token_buckets=self.runner.shapes.tokens,
        )
        if self.speculator is not None:  # a model draft runs on the target's runner
            self.speculator.attach(self.runner, self.invariance)
        self.metrics = EngineMetrics(keep_raw=keep_raw_metrics)
        self.metrics.kv_pages_total.set(num_pages)
        if self.speculator is not None:  # acceptance in /metrics
            self.metrics.registry.register(SpecCollector(self.speculator))
        self.eos_token_ids = set(eos_token_ids(model))
        self.table = RequestTable(self.scheduler, self.metrics, self.tokenizer)
        self.requests: dict[str, Request] = self.table.by_id  # the live requests, by id
        self.admission = Admission(self.cfg.vocab_size, self.max_model_len, self.tokenizer,
                                   self.runner.logits_rows)  # fmt: skip
        self.num_steps = 0
        self.warm: set[str] = set()  # the kinds ("step", "score") whose shapes are compiled
        self.async_scheduling = resolve_async(config.async_scheduling)
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
        *,
        checked: bool = False,
    ) -> int:
        """Queue a request, checked by `admission` unless `checked` (the caller checked it).

        Returns the request's seed: the given one, or the one drawn now, so that the output can
        be reproduced by resending the request with that seed.
        """
        self.table.check_id(request_id)
        if checked:
            opts = SamplingOptions.from_any(params)
        else:
            opts = self.admission.check_request(prompt_token_ids, params)
        seed = int(opts.seed) if opts.seed is not None else secrets.randbits(32)
        now = time.perf_counter() if arrival_time is None else arrival_time
        self.table.add(Request.sampling(request_id, prompt_token_ids, opts, seed, now))
        return seed

    def add_score(
        self, request_id: str, token_ids: list[int], arrival_time: float | None = None
    ) -> None:
        """Queue a score request of `token_ids` (at least 2 tokens, at most max_model_len); its
        final output carries `scores` (len(token_ids) - 1 log-probs; scoring.py)."""
        self.table.check_id(request_id)
        now = time.perf_counter() if arrival_time is None else arrival_time
        self.table.add(score_request(request_id, token_ids, vocab_size=self.cfg.vocab_size,
                                     max_model_len=self.max_model_len, now=now))  # fmt: skip

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its pages return at once. False if unknown/finished."""
        return self.table.abort(request_id)

    def fail_request(self, request_id: str, error: str) -> None:
        """End one request because of an error of its own (request_table.py `fail`)."""
        self.table.fail(request_id, error)

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
                plan, (prepared, score_in) = faults.isolate(plan, self._inputs, self.fail_request)
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
        # speculating, a verify's successor depends on how many drafts it accepts
        also = self.speculator.can_run_ahead if self.speculator is not None else None
        if not self.scheduler.steady(plan, self.max_model_len, also):
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
            ends = lambda seq, tok, m: self._end(seq, tok, m) is not None  # noqa: E731
            plan, rows = self.speculator.accept_drafts(plan, res, nrows, self._append, ends)
        self.scheduler.advance(plan)
        for i, (seq, _) in zip(rows, plan, strict=True):
            if seq.status is not Status.RUNNING or seq.num_uncomputed > 0:
                continue  # finished meanwhile, or a prefill chunk that samples nothing
            tok = self._append(seq, res, i)
            end = self._end(seq, tok)
            if end is not None:
                finish(self.scheduler, seq, *end)

    def _append(self, seq: Sequence, res: dict, i: int) -> int:
        """Append the token sampled in row `i` (and its log-probs) to `seq`."""
        tok = int(res["tokens"][i])
        seq.token_ids.append(tok)
        seq.logprobs.append(float(res["logprobs"][i]))
        k = seq.options.logprobs
        if k:
            ids, lps = res["top_ids"][i, :k], res["top_logprobs"][i, :k]
            seq.top_logprobs.append([(int(a), float(b)) for a, b in zip(ids, lps, strict=True)])
        self.table.pending[seq] = None
        self.metrics.generation_tokens.inc()
        return tok

    def _end(self, seq: Sequence, tok: int, m: int = 0) -> tuple[str, int | None] | None:
        """(finish reason, stop reason) if `tok`, with m more tokens appended to `seq` than it
        holds now, finishes it: EOS or a stop token ("stop"), max_tokens or max_model_len
        ("length"); else None. Token-level, so no step is wasted on them."""
        o = seq.options
        if tok in o.stop_token_ids or (not o.ignore_eos and tok in self.eos_token_ids):
            return "stop", tok if tok in o.stop_token_ids else None
        if (o.max_tokens is not None and seq.num_output_tokens + m >= o.max_tokens) or (
            seq.num_tokens + m >= self.max_model_len
        ):
            return "length", None
        return None

    # ------------------------------------------------------------------ collaborators
    def _inputs(self, plan: list[tuple[Sequence, int]]) -> tuple[Any, Any]:
        """(the sampling rows' inputs, the score rows' inputs) of `plan`; None where the step has
        none. faults.isolate calls it, and again per sequence to find whose data raised."""
        if self.fault_injector is not None:
            for seq, _ in plan:
                self.fault_injector(seq)
        sampling, scoring = split_scores(plan)
        prepared = self.runner.prepare(sampling) if sampling else None
        if prepared is not None and self.speculator is not None:  # rejection mode
            prepared = self.speculator.verify_inputs(sampling, prepared)
        return prepared, self.runner.prepare_score(scoring) if scoring else None

    def _dispatch_score(self, prepared: tuple[Any, Any] | None) -> Any:
        """Launch this step's score rows (None: none); a separate draft model's cache follows
        them as it follows every step (serving/speculative/draft_model.py `mirror`)."""
        if prepared is None:
            return None
        out = self.runner.dispatch_score(*prepared)
        if self.speculator is not None:
            self.speculator.mirror(self.runner.as_step(prepared[0]))
        return out

    def _apply_scores(self, plan: list[tuple[Sequence, int]], out: Any) -> None:
        """Record a step's score rows, account their K/V, and finish the score requests whose
        rows are all scored."""
        record_scores(plan, out)
        self.scheduler.advance(plan)
        for seq, _ in plan:
            if seq.status is Status.RUNNING and seq.num_uncomputed == 0:
                finish(self.scheduler, seq, "stop")
                self.table.pending[seq] = None

    def _report(self) -> list[RequestUpdate]:
        """What this step shows its callers (request_table.py `report`)."""
        return self.table.report()

    def recover(self, error: str) -> None:
        """After an unattributable failure: end every request with `error` (no output for them
        follows: the caller is told by the exception), drop the prefix cache (a failed step may
        have left junk K/V), re-create the KV pool if the failed step consumed the donated one,
        and check the page accounting. Raises EngineBroken if the accounting is not clean."""
        self.table.end_all()
        self.page_manager.hash_to_page.clear()
        self.page_manager.page_to_hash.clear()
        self.runner.kv = faults.restore_kv(self.runner.kv)
        faults.check_clean(self.page_manager, self.scheduler, error)
        self.refresh_gauges()

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
