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
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from serving.block_manager import BlockManager, cdiv
from serving.metrics import EngineMetrics
from serving.model_runner import ModelRunner, default_num_pages
from serving.scheduler import Scheduler
from serving.sequence import NUM_TOP, SamplingOptions, Sequence, Status, derive_seed


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


@dataclass
class _Request:
    request_id: str
    prompt_token_ids: list[int]
    seed: int
    seqs: list[Sequence]
    arrival_time: float


class Engine:
    """Continuous batching over one model replica. Not thread-safe: drive it from one thread."""

    def __init__(
        self,
        model: Any,
        *,
        invariance: str = "tp",
        tp: int = 1,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        page_size: int = 16,
        num_pages: int | None = None,
        enable_prefix_caching: bool = True,
        scheduling: str = "stall_free",
        watermark: float = 0.01,
        min_tokens_bucket: int = 16,
        min_seqs_bucket: int = 8,
        min_pages_bucket: int = 4,
        step_fn: Any = None,
        sharded: bool | None = None,
        keep_raw_metrics: bool = True,
    ) -> None:
        from jdet.ops import check_mode

        self.invariance = check_mode(invariance)
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
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = BlockManager(
            num_pages, page_size, enable_prefix_caching=enable_prefix_caching, watermark=watermark
        )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            policy=scheduling,
        )
        self.runner = ModelRunner(
            model,
            invariance=invariance,
            num_pages=num_pages,
            page_size=page_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=self.max_model_len,
            min_tokens_bucket=min_tokens_bucket,
            min_seqs_bucket=min_seqs_bucket,
            min_pages_bucket=min_pages_bucket,
            step_fn=step_fn,
            tp=tp,
            sharded=sharded,
        )
        self.metrics = EngineMetrics(keep_raw=keep_raw_metrics)
        self.metrics.kv_pages_total.set(num_pages)
        self.eos_token_ids = set(self.cfg.eos_token_ids)
        if not self.eos_token_ids and self.tokenizer is not None:
            if getattr(self.tokenizer, "eos_token_id", None) is not None:
                self.eos_token_ids = {int(self.tokenizer.eos_token_id)}
        self.requests: dict[str, _Request] = {}
        self._pending: dict[Sequence, None] = {}  # sequences with tokens not yet reported
        self.num_steps = 0
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0)

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
        seed = opts.seed if opts.seed is not None else secrets.randbits(32)
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
        V = self.cfg.vocab_size
        problems = [
            (request_id in self.requests, f"request_id {request_id!r} is already in use"),
            (len(prompt) == 0, "prompt is empty"),
            (
                any(not 0 <= int(t) < V for t in prompt),
                f"prompt has a token id outside the vocabulary [0, {V})",
            ),
            (
                len(prompt) >= self.max_model_len,
                f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                "shorten it or raise max_model_len",
            ),
            (o.n < 1, f"n must be >= 1, got {o.n}"),
            (o.temperature < 0, f"temperature must be >= 0, got {o.temperature}"),
            (not 0 < o.top_p <= 1, f"top_p must be in (0, 1], got {o.top_p}"),
            (o.top_k < 0, f"top_k must be >= 0, got {o.top_k}"),
            (
                o.max_tokens is not None and o.max_tokens < 1,
                f"max_tokens must be >= 1, got {o.max_tokens}",
            ),
            (
                o.logprobs is not None and not 0 <= o.logprobs <= NUM_TOP,
                f"logprobs must be in [0, {NUM_TOP}], got {o.logprobs}",
            ),
            (bool(o.stop) and self.tokenizer is None, "stop strings need a tokenizer"),
            (any(not s for s in o.stop), "stop strings must be non-empty"),
        ]
        for bad, msg in problems:
            if bad:
                raise ValueError(msg)

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
        """One engine iteration; returns outputs for requests that made visible progress."""
        plan = self.scheduler.schedule()
        now = time.perf_counter()
        for seq, _ in plan:
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
                self.metrics.observe("queue", now - seq.arrival_time)
        out = None
        if plan:
            batch, sampling = self.runner.prepare(plan)
            out = self.runner.dispatch(batch, sampling)
        outputs = self._report()  # overlaps with the device
        if plan:
            want_top = any(s.options.logprobs for s, _ in plan)
            res = self.runner.fetch(out, len(plan), want_top)
            self._apply(plan, res)
            if not self.scheduler.has_work():
                outputs += self._report()
        self._update_gauges(plan)
        return outputs

    def _apply(self, plan: list[tuple[Sequence, int]], res: dict) -> None:
        self.scheduler.advance(plan)
        for i, (seq, _) in enumerate(plan):
            if seq.status is not Status.RUNNING or seq.num_uncomputed > 0:
                continue  # finished meanwhile, or a prefill chunk that samples nothing
            tok = int(res["tokens"][i])
            seq.token_ids.append(tok)
            seq.logprobs.append(float(res["logprobs"][i]))
            k = seq.options.logprobs
            if k:
                ids, lps = res["top_ids"][i, :k], res["top_logprobs"][i, :k]
                seq.top_logprobs.append([(int(a), float(b)) for a, b in zip(ids, lps, strict=True)])
            o = seq.options
            if tok in o.stop_token_ids or (not o.ignore_eos and tok in self.eos_token_ids):
                self._finish(seq, "stop", tok if tok in o.stop_token_ids else None)
            elif (o.max_tokens is not None and seq.num_output_tokens >= o.max_tokens) or (
                seq.num_tokens >= self.max_model_len
            ):
                self._finish(seq, "length")
            self._pending[seq] = None
            self.metrics.generation_tokens.inc()

    def _finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    def _report(self) -> list[RequestOutput]:
        """Detokenise pending sequences, apply stop strings, and build the per-request outputs."""
        touched: dict[str, None] = {}
        now = time.perf_counter()
        for seq in self._pending:
            if seq.request_id not in self.requests:
                continue
            self._detokenize(seq)
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
        then stop strings, matched on the text across token boundaries."""
        tok = self.tokenizer
        if tok is None:
            return
        skip = seq.options.skip_special_tokens
        ids, end = seq.token_ids, seq.num_tokens
        if seq.read_offset < end:
            prefix = tok.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
            full = tok.decode(ids[seq.prefix_offset : end], skip_special_tokens=skip)
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                seq.text += full[len(prefix) :]
                seq.prefix_offset, seq.read_offset = seq.read_offset, end
            elif seq.is_finished:  # flush what is left, even a lone partial character
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
    def warmup(self) -> float:
        """Compile the step for every token bucket now (seconds taken); only on an idle engine
        that has served nothing yet, since it writes junk K/V into free pages."""
        if self.requests or self.block_manager.hash_to_page:
            raise RuntimeError("warmup() must run before the engine serves any request")
        t0 = time.perf_counter()
        self.runner.warmup()
        return time.perf_counter() - t0

    def run(self) -> list[RequestOutput]:
        """Step until every request finished; return the final output of each (arrival order)."""
        order = list(self.requests)
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    final[o.request_id] = o
        return [final[r] for r in order if r in final]

    def pages_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.page_size)
