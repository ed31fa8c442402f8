"""The engine: add_request / step / abort over the scheduler, block manager and model runner.

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

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.block_manager import BlockManager
from serving.metrics import EngineMetrics
from serving.model_runner import ModelRunner, default_num_pages
from serving.sampling_options import InvalidRequest, SamplingOptions, check_prompt_ids
from serving.scheduler import Scheduler
from serving.sequence import Sequence, Status, derive_seed
from serving.speculative import num_rows

log = logging.getLogger("jdet.engine")



def resolve_async(value: bool | str) -> bool:
    """EngineConfig.async_scheduling: "auto" (default) is on where the device runs the step
    asynchronously to the host (a GPU: the engine step then costs the device step + 0.2 ms
    instead of + 2.1 ms, BENCHMARKS.md issue 11 run 4), off on a CPU, where the device is the host
    and dispatching ahead only adds work. True/"on" and False/"off" force it; same bits either
    way (tests/serving/test_async.py)."""
    if value in (True, "on"):
        return True
    if value in (False, "off"):
        return False
    if value == "auto":
        from pallas_kernels import _platform

        return _platform.platform() == "gpu"
    raise ValueError(f"async_scheduling={value!r}: use 'auto', 'on' or 'off' (or a bool)")

class EngineStepError(RuntimeError):
    """A step failed for a reason no single request explains; every request was ended with the
    error and the engine was reset to a clean, empty state (it can serve new requests)."""


class EngineBroken(RuntimeError):
    """Recovery after a failed step found inconsistent page accounting: the engine must not be
    used again (the server exits non-zero on this)."""


@dataclass
class CompletionOutput:
    """One sample's state. `text`, `token_ids`, `logprobs` are cumulative (what was reported so
    far); `delta_*` are what is new since the previous output of this request."""

    index: int
    seed: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]] | None
    finish_reason: str | None
    stop_reason: str | int | None
    delta_text: str = ""
    delta_start: int = 0  # delta tokens are token_ids[delta_start:]

    @property
    def delta_token_ids(self) -> list[int]:
        return self.token_ids[self.delta_start :]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    seed: int  # the request's seed (chosen at admission when the request gave none)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (max over samples)
    num_preemptions: int = 0  # recompute preemptions its samples went through
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the engine ended this request (finish_reason "error")


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    seed: int
    seqs: list[Sequence]
    arrival_time: float
    error: str | None = None


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
        `jdet.SpeculativeConfig` (or dict) for speculative decoding (serving/speculative.py).
        `step_fn`, `sharded`, `watermark`, `keep_raw_metrics`: for tests and benchmarks."""
        import dataclasses

        from jdet import compile_cache as cc
        from jdet.plan import Plan
        from jdet.settings import EngineConfig
        from jdet.spec_config import SpeculativeConfig

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
        limit = self.cfg.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings "
                f"({limit}); lower it"
            )
        self.max_model_len = max_model_len or limit
        if num_pages is None:
            num_pages = default_num_pages(
                self.cfg,
                page_size,
                model.dtype,
                max_model_len=self.max_model_len,
                max_num_seqs=max_num_seqs,
            )
            if max_model_len is None:
                self.max_model_len = min(self.max_model_len, num_pages * page_size)
        if num_pages * page_size < self.max_model_len:
            raise ValueError(
                f"num_pages={num_pages} x page_size={page_size} = {num_pages * page_size} KV slots "
                f"cannot hold one sequence of max_model_len={self.max_model_len}; raise num_pages "
                f"or lower max_model_len"
            )
        self.page_size = page_size
        self.tp = tp
        self.speculative = SpeculativeConfig.from_any(speculative)
        self.speculator = None  # speculative decoding (issue 13): drafts + acceptance
        if self.speculative is not None:
            from serving.speculative import Speculator

            self.speculator = Speculator(self.speculative, max_model_len=self.max_model_len)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = BlockManager(
            num_pages, page_size, enable_prefix_caching=config.enable_prefix_caching,
            watermark=watermark,
        )  # fmt: skip
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=config.scheduling,
        )
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
        if self.speculator is not None:  # a model draft runs on the target's runner
            self.speculator.attach(self.runner, self.invariance)
        self.metrics = EngineMetrics(keep_raw=keep_raw_metrics)
        self.metrics.kv_pages_total.set(num_pages)
        if self.speculator is not None:  # acceptance in /metrics (issue 13)
            from serving.speculative import SpecCollector

            self.metrics.registry.register(SpecCollector(self.speculator))
        self.eos_token_ids = set(self.cfg.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None:
            if getattr(self.tokenizer, "eos_token_id", None) is not None:
                self.eos_token_ids = {int(self.tokenizer.eos_token_id)}
        self.requests: dict[str, _Request] = {}
        self._pending: dict[Sequence, None] = {}  # sequences with tokens not yet reported
        self.num_steps = 0
        self.warm: set[str] = set()  # the kinds ("step", "score") whose shapes are compiled
        self.async_scheduling = resolve_async(async_scheduling)
        self._inflight: tuple[list, Any] | None = None  # a step dispatched ahead, not yet fetched
        self.num_steps_ahead = 0  # steps dispatched before their input tokens reached the host
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0)
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
        self.requests[request_id] = _Request(request_id, prompt, seed, seqs, now)
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
    def step(self) -> list[RequestOutput]:
        """One engine iteration; returns outputs for requests that made visible progress.

        With `async_scheduling`, a step whose sequences all sample and are all the running ones
        (steady decode) dispatches the next decode step before its own tokens reach the host:
        the next step's input tokens are this step's device output (`_dispatch_ahead`)."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            plan, out = inflight  # dispatched by the previous call, from device-side tokens
        else:
            if self.speculator is not None:  # issue 13: drafts before the budget is shared
                self.speculator.propose(self.scheduler.running)
            plan, out = self.scheduler.schedule(), None
            if self.speculator is not None:  # a model draft drafts for the verifies planned
                self.speculator.fill(plan)
            now = time.perf_counter()
            for seq, _ in plan:
                if seq.first_scheduled_time is None:
                    seq.first_scheduled_time = now
                    self.metrics.observe("queue", now - seq.arrival_time)
        try:
            if plan and out is None:
                plan, prepared = self._prepare(plan)
                if plan:
                    out = self.runner.dispatch(*prepared)
                    if self.speculator is not None:  # a draft model's cache follows
                        self.speculator.mirror(prepared)
            # sampled rows per entry, fixed now (`_report` may end a sequence meanwhile)
            nrows = [num_rows(s, n) for s, n in plan] if self.speculator else [1] * len(plan)
            if plan and self.async_scheduling and self.speculator is None:
                self._inflight = self._dispatch_ahead(plan, out)
            outputs = self._report()  # overlaps with the device
            if plan:
                want_top = any(s.options.logprobs for s, _ in plan)
                res = self.runner.fetch(out, sum(nrows), want_top)
                if self.speculator is not None and self.speculator.rejection:
                    res.update(self.speculator.fetch_extra(out, sum(nrows)))
                self._apply(plan, res, nrows)
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
        self._update_gauges(plan)
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
        for seq, n in plan:
            o = seq.options
            if seq.status is not Status.RUNNING or n != seq.num_uncomputed:
                return None
            if seq.num_tokens + 2 > self.max_model_len or (
                o.max_tokens is not None and seq.num_output_tokens + 2 > o.max_tokens
            ):
                return None
        if not all(self.block_manager.grow(seq, n + 1) for seq, n in plan):
            return None
        nxt = [(seq, 1) for seq, _ in plan]
        prepared = self.runner.prepare_ahead(nxt, out.tokens)
        if prepared is None:
            return None
        self.num_steps_ahead += 1
        return nxt, self.runner.dispatch(*prepared)

    # ------------------------------------------------------------------ fault isolation
    def _prepare(self, plan: list[tuple[Sequence, int]]) -> tuple[list, Any]:
        """Build the step's arrays; a sequence whose data makes this raise ends its request
        with an error, and the batch is rebuilt without it (the others' bits do not change)."""
        while plan:
            try:
                return plan, self._prepare_rows(plan)
            except Exception as e:  # noqa: BLE001 - find whose fault it was
                bad = {seq.request_id for seq, n in plan if self._faulty([(seq, n)])}
                if not bad:
                    raise
                for rid in bad:
                    log.warning("request %s failed while its batch was built: %r", rid, e)
                    self.fail_request(rid, f"{type(e).__name__}: {e}")
                plan = [(s, n) for s, n in plan if s.request_id not in bad]
        return plan, None

    def _prepare_rows(self, plan: list[tuple[Sequence, int]]) -> Any:
        if self.fault_injector is not None:
            for seq, _ in plan:
                self.fault_injector(seq)
        prepared = self.runner.prepare(plan)
        if self.speculator is not None:  # rejection mode: each verify row's draft (issue 13)
            prepared = self.speculator.verify_inputs(plan, prepared)
        return prepared

    def _faulty(self, item: list[tuple[Sequence, int]]) -> bool:
        try:
            self._prepare_rows(item)
        except Exception:  # noqa: BLE001 - this is the question asked
            return True
        return False

    def fail_request(self, request_id: str, error: str) -> None:
        """End one request because of an error of its own: its samples finish with reason
        "error", their pages are freed now, and the next step reports the final output."""
        req = self.requests.get(request_id)
        if req is None:
            return
        req.error = error[:2000]
        for s in req.seqs:
            if not s.is_finished:
                self._finish(s, "error")
            self._pending[s] = None

    def recover(self, error: str) -> None:
        """After an unattributable failure: end every request with `error` (no output for them
        follows: the caller is told by the exception), drop the prefix cache (a failed step may
        have left junk K/V), re-create the KV cache if the failed step consumed the donated one,
        and check the page accounting. Raises EngineBroken if the accounting is not clean."""
        for rid in list(self.requests):
            req = self.requests.pop(rid)
            for s in req.seqs:
                if not s.is_finished:
                    self.scheduler.finish(s)
                    s.finish_reason = "error"
            self.metrics.finished.labels("error").inc()
        self._pending.clear()
        bm = self.block_manager
        bm.hash_to_page.clear()
        bm.page_to_hash.clear()
        import jax
        import jax.numpy as jnp

        leaves = jax.tree_util.tree_leaves(self.runner.kv)
        if any(x.is_deleted() for x in leaves):
            self.runner.kv = jax.tree_util.tree_map(
                lambda x: jnp.zeros(x.shape, x.dtype, device=x.sharding), self.runner.kv
            )
        try:
            bm.check([])
            assert not self.scheduler.has_work(), "the scheduler still holds sequences"
        except AssertionError as e:
            raise EngineBroken(f"page accounting is inconsistent after {error}: {e}") from e
        self.refresh_gauges()

    def _apply(self, plan: list[tuple[Sequence, int]], res: dict, nrows: list[int]) -> None:
        rows: Any = range(len(plan))  # each plan entry's sampled row
        if self.speculator is not None:
            plan, rows = self._accept_drafts(plan, res, nrows)
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

    def _accept_drafts(
        self, plan: list[tuple[Sequence, int]], res: dict, nrows: list[int]
    ) -> tuple[list, list]:
        """Speculative decoding (serving/speculative.py): for each verify in `plan`, append the
        accepted drafts now (before `advance`, so that pages they fill hash the right tokens).
        Returns the plan with each verify cut to its computed tokens (x and the accepted
        drafts) and each entry's row holding its next token (for a verify, the target's own)."""
        out, rows, r0 = [], [], 0
        for (seq, n), r in zip(plan, nrows, strict=True):  # r: the rows `prepare` gave it
            last = r0 + r - 1
            if r > 1 and seq.status is Status.RUNNING:
                drafts = seq.draft_token_ids[: r - 1]
                if self.speculator.rejection:  # rows emit accepted drafts / residual draws
                    self.speculator.rewrite(res, r0, drafts)
                toks = [int(t) for t in res["tokens"][r0 : r0 + r]]
                m = self.speculator.num_emitted(
                    seq, drafts, toks, lambda t, j, s=seq: self._ends(s, t, j)
                )
                for i in range(r0, r0 + m - 1):
                    self._append(seq, res, i)
                n, last = m, r0 + m - 1
            seq.draft_token_ids = []
            out.append((seq, n))
            rows.append(last)
            r0 += r
        return out, rows

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _report(self) -> list[RequestOutput]:
        """Detokenise pending sequences, apply stop strings, and build the per-request outputs."""
        touched: dict[str, None] = {}
        now = time.perf_counter()
        for seq in list(self._pending):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            try:
                if req.error is None:
                    self._detokenize(seq)
            except Exception as e:  # noqa: BLE001 - one request's text cannot hurt the others
                log.warning("request %s failed in detokenisation: %r", seq.request_id, e)
                self.fail_request(seq.request_id, f"detokenisation failed: {e}")
            if seq.first_token_time is None:
                seq.first_token_time = now
                self.metrics.observe("ttft", now - seq.arrival_time)
            else:
                new = seq.num_output_tokens - seq.emitted_tokens
                if new > 0:
                    gap = (now - seq.last_token_time) / new
                    for _ in range(new):
                        self.metrics.observe("itl", gap)
            seq.last_token_time = now
            touched[seq.request_id] = None
        self._pending.clear()
        outputs = []
        for rid in touched:
            req = self.requests[rid]
            comps = [self._completion(s) for s in req.seqs]
            finished = all(s.is_finished for s in req.seqs)
            out = RequestOutput(
                rid,
                req.prompt_token_ids,
                comps,
                finished,
                req.seed,
                num_cached_tokens=max(s.num_cached_tokens for s in req.seqs),
                num_preemptions=sum(s.num_preemptions for s in req.seqs),
                error=req.error,
            )
            if finished:
                del self.requests[rid]
                e2e = now - req.arrival_time
                self.metrics.observe("e2e", e2e)
                for s in req.seqs:
                    self.metrics.finished.labels(s.finish_reason or "length").inc()
                first = [s.first_token_time for s in req.seqs if s.first_token_time]
                out.metrics = {"e2e": e2e, "ttft": min(first) - req.arrival_time if first else e2e}
            outputs.append(out)
        return outputs

    def _detokenize(self, seq: Sequence) -> None:
        """Incremental detokenisation (new text only once it is no longer a partial character),
        then stop strings, matched on the text across token boundaries. One token at a time, so
        a speculative step's several tokens give the text, and the stop, of as many steps: a stop
        string ends the sequence at the token that completes it; later tokens are dropped."""
        tok = self.tokenizer
        if tok is None:
            return
        skip = {"skip_special_tokens": seq.options.skip_special_tokens}
        ids, last = seq.token_ids, seq.num_tokens
        for end in range(min(seq.detok_end + 1, last), last + 1):
            seq.detok_end = end
            if seq.read_offset < end:
                prefix = tok.decode(ids[seq.prefix_offset : seq.read_offset], **skip)
                full = tok.decode(ids[seq.prefix_offset : end], **skip)
                if len(full) > len(prefix) and not full.endswith("\ufffd"):
                    seq.text += full[len(prefix) :]
                    seq.prefix_offset, seq.read_offset = seq.read_offset, end
                elif seq.is_finished and end == last:  # flush what is left, even a partial char
                    seq.text += full[len(prefix) :]
                    seq.read_offset = end
            if seq.options.stop and not isinstance(seq.stop_reason, str):
                longest = max(len(s) for s in seq.options.stop)
                start = max(0, seq.emitted_chars - longest + 1)
                hits = [(seq.text.find(s, start), s) for s in seq.options.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    seq.text = seq.text[:i]
                    if not seq.is_finished:
                        self.scheduler.finish(seq)
                    seq.finish_reason, seq.stop_reason = "stop", s
                    if end < last:  # tokens past the stop (a speculative run): dropped
                        keep = end - seq.num_prompt_tokens
                        del seq.token_ids[end:], seq.logprobs[keep:], seq.top_logprobs[keep:]
                    return

    def _completion(self, seq: Sequence) -> CompletionOutput:
        if seq.is_finished or not seq.options.stop:
            visible = len(seq.text)
        else:  # hold back text that could be the start of a stop string
            hold = max(len(s) for s in seq.options.stop) - 1
            visible = max(seq.emitted_chars, len(seq.text) - hold)
        delta_text = seq.text[seq.emitted_chars : visible]
        start = seq.emitted_tokens
        seq.emitted_chars, seq.emitted_tokens = visible, seq.num_output_tokens
        out_ids = seq.output_token_ids
        return CompletionOutput(
            index=seq.index,
            seed=seq.seed,
            text=seq.text[:visible],
            token_ids=out_ids,
            logprobs=seq.logprobs,
            top_logprobs=seq.top_logprobs if seq.options.logprobs else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            delta_text=delta_text,
            delta_start=start,
        )

    def _update_gauges(self, plan: list[tuple[Sequence, int]]) -> None:
        self.num_steps += 1
        if plan:
            self.metrics.observe("step_tokens", sum(n for _, n in plan))
        self.refresh_gauges()

    def refresh_gauges(self) -> None:
        """Bring the Prometheus gauges and counters up to date with the engine state."""
        m, bm = self.metrics, self.block_manager
        m.kv_pages_used.set(bm.num_used)
        m.running.set(len(self.scheduler.running))
        m.waiting.set(len(self.scheduler.waiting))
        if self.scheduler.num_preemptions > self._seen_preemptions:
            m.preemptions.inc(self.scheduler.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = self.scheduler.num_preemptions
        q, h = bm.prefix_queries, bm.prefix_hits
        m.prefix_queries.inc(q - self._seen_prefix[0])
        m.prefix_hits.inc(h - self._seen_prefix[1])
        self._seen_prefix = (q, h)

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

    def run(self) -> list[RequestOutput]:
        """Step until every request finished; return the final output of each (arrival order)."""
        order = list(self.requests)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r] for r in order if r in final]
