"""Engine metrics: Prometheus series for `/metrics`, and raw samples only when asked for.

Why: Prometheus histograms answer "how is the server doing" in constant memory (fixed buckets),
which is what a server that runs for weeks needs; a benchmark needs the exact per-request TTFT /
inter-token latencies to compute p50/p99 itself, so it opts in with `keep_raw=True` (one float
per generated token, never freed: fine for a benchmark's minutes, not for a server). Each engine
owns its own `CollectorRegistry`, so several engines in one process never collide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jdet.compile_cache import stats

_LAT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5, 10, 20, 40)
_TOK = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass
class RawStats:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    queue: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)


class EngineMetrics:
    def __init__(self, keep_raw: bool = False) -> None:
        r = self.registry = CollectorRegistry()
        self.raw = RawStats() if keep_raw else None
        p = "jdet_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "TTFT", registry=r, buckets=_LAT)
        self.itl = Histogram(
            p + "inter_token_latency_seconds", "Inter-token latency", registry=r, buckets=_LAT
        )
        self.queue = Histogram(
            p + "queue_time_seconds", "Arrival to first schedule", registry=r, buckets=_LAT
        )
        self.e2e = Histogram(
            p + "e2e_request_latency_seconds", "Arrival to finish", registry=r, buckets=_LAT
        )
        self.step_tokens = Histogram(p + "step_tokens", "Tokens per step", registry=r, buckets=_TOK)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Generated tokens", registry=r)
        self.preemptions = Counter(p + "preemptions", "Recompute preemptions", registry=r)
        self.prefix_queries = Counter(p + "prefix_cache_queries", "Tokens looked up", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hits", "Tokens served from cache", registry=r)
        self.finished = Counter(
            p + "requests_finished", "Finished requests", ["reason"], registry=r
        )
        self.kv_pages_used = Gauge(p + "kv_pages_in_use", "KV pages held by sequences", registry=r)
        self.kv_pages_total = Gauge(p + "kv_pages_total", "KV pages in the pool", registry=r)
        self.running = Gauge(p + "num_requests_running", "Running sequences", registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Waiting sequences", registry=r)
        self.warm = Gauge(p + "warm", "1 once every step shape is compiled", registry=r)
        self.warmup_seconds = Gauge(p + "warmup_seconds", "Start-up compile time", registry=r)
        r.register(_CompileCollector())
        self._seen_preemptions = 0  # the scheduler's and page manager's totals counted so far
        self._seen_prefix = (0, 0)

    def refresh(self, page_manager: Any, scheduler: Any) -> None:
        """Bring the gauges and counters up to date with the engine's page manager and
        scheduler (counters advance by what their totals grew since the last refresh)."""
        pm = page_manager
        self.kv_pages_used.set(pm.num_used)
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        if scheduler.num_preemptions > self._seen_preemptions:
            self.preemptions.inc(scheduler.num_preemptions - self._seen_preemptions)
            self._seen_preemptions = scheduler.num_preemptions
        q, h = pm.prefix_queries, pm.prefix_hits
        self.prefix_queries.inc(q - self._seen_prefix[0])
        self.prefix_hits.inc(h - self._seen_prefix[1])
        self._seen_prefix = (q, h)

    def observe(self, name: str, value: float) -> None:
        getattr(self, name).observe(value)
        if self.raw is not None:
            getattr(self.raw, name).append(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _CompileCollector:
    """XLA compilations of this process (jdet/compile_cache.py), read at scrape time: after
    warm-up they must not move; a rise means some request met a shape outside the set."""

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        from prometheus_client.core import CounterMetricFamily  # a server's /metrics only

        s = stats()
        yield CounterMetricFamily(
            "jdet_compilations", "XLA compilations (persistent-cache loads included)", s.compiles
        )
        yield CounterMetricFamily("jdet_compile_seconds", "Seconds spent compiling", s.seconds)
        yield CounterMetricFamily(
            "jdet_compile_cache_hits", "Executables loaded from the persistent cache", s.cache_hits
        )


class SpecCollector:
    """Prometheus collector for `/metrics` (read at scrape time): drafts proposed and accepted,
    verify rows, the acceptance rate and the mean tokens a verify emits."""

    def __init__(self, speculator: Any) -> None:  # serving.speculative.speculator.Speculator
        self.spec = speculator

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        from prometheus_client.core import (  # a server's /metrics only
            CounterMetricFamily,
            GaugeMetricFamily,
        )

        st = self.spec.stats()
        yield CounterMetricFamily(
            "jdet_spec_draft_tokens", "Draft tokens verified", st["draft_tokens"]
        )
        yield CounterMetricFamily(
            "jdet_spec_accepted_tokens", "Draft tokens accepted", st["accepted_tokens"]
        )
        yield CounterMetricFamily("jdet_spec_verifies", "Sequence verifies", st["verifies"])
        yield CounterMetricFamily(
            "jdet_spec_rejected_tokens",
            "Verifies that ended on a draft the target did not draw (alpha's denominator is "
            "accepted + rejected)",
            st["rejected_tokens"],
        )
        yield GaugeMetricFamily(
            "jdet_spec_acceptance_rate", "Accepted / verified draft tokens", st["acceptance_rate"]
        )
        yield GaugeMetricFamily(
            "jdet_spec_mean_accepted_length",
            "Mean tokens emitted per verify (accepted drafts + the target's own)",
            st["mean_accepted_length"],
        )
