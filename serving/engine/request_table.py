"""The engine's requests: the live ones by id, the sequences with tokens not yet reported, and
what happens to a request as a whole (admitted, aborted, failed alone, ended by a failed step,
reported).

Why a table of its own: the engine's loop (engine.py) moves sequences through steps; this holds
what the callers see, per request. It changes a sequence's state only through the scheduler it
is given (`finish`), so the scheduler and the page accounting stay the one truth about pages.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from serving.engine.outputs import RequestUpdate, detokenize, observe_latency, request_update
from serving.sampling_options import InvalidRequest
from serving.sequence import Request, Sequence

log = logging.getLogger("jdet.engine")


def finish(
    scheduler: Any, seq: Sequence, reason: str, stop_reason: str | int | None = None
) -> None:
    """End `seq` now: its pages return to the pool (the scheduler's `finish`); it records why."""
    scheduler.finish(seq)
    seq.finish_reason = reason
    seq.stop_reason = stop_reason


class RequestTable:
    """Requests by id (`by_id`) and the sequences with news for their callers (`pending`)."""

    def __init__(self, scheduler: Any, metrics: Any, tokenizer: Any) -> None:
        self.scheduler, self.metrics, self.tokenizer = scheduler, metrics, tokenizer
        self.by_id: dict[str, Request] = {}
        self.pending: dict[Sequence, None] = {}  # sequences with tokens not yet reported

    def check_id(self, request_id: str) -> None:
        if not isinstance(request_id, str) or request_id in self.by_id:
            raise InvalidRequest("request_id", f"request_id {request_id!r} is already in use")

    def add(self, req: Request) -> None:
        """Admit `req`: its sequences wait for the scheduler."""
        self.by_id[req.request_id] = req
        for s in req.seqs:
            self.scheduler.add(s)
        self.metrics.prompt_tokens.inc(len(req.prompt_token_ids))

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is; its pages return at once. False if unknown/finished."""
        req = self.by_id.pop(request_id, None)
        if req is None:
            return False
        for s in req.seqs:
            if not s.is_finished:
                finish(self.scheduler, s, "abort")
            self.pending.pop(s, None)
        self.metrics.finished.labels("abort").inc()
        return True

    def fail(self, request_id: str, error: str) -> None:
        """End one request because of an error of its own: its samples finish with reason
        "error", their pages are freed now, and the next report carries the final output."""
        req = self.by_id.get(request_id)
        if req is None:
            return
        req.error = error[:2000]
        for s in req.seqs:
            if not s.is_finished:
                finish(self.scheduler, s, "error")
            self.pending[s] = None

    def end_all(self) -> None:
        """End every request with reason "error" and report none of them (a failed step: its
        caller is told by the exception)."""
        for rid in list(self.by_id):
            for s in self.by_id.pop(rid).seqs:
                if not s.is_finished:
                    self.scheduler.finish(s)
                    s.finish_reason = "error"
            self.metrics.finished.labels("error").inc()
        self.pending.clear()

    def report(self) -> list[RequestUpdate]:
        """Detokenise the pending sequences, apply stop strings (a stop string ends its sequence
        through the scheduler), and build one output per request they belong to; a finished
        request leaves the table. A request whose text fails to detokenise ends alone."""
        touched: dict[str, None] = {}
        now = time.perf_counter()
        for seq in list(self.pending):
            req = self.by_id.get(seq.request_id)
            if req is None:
                continue
            try:
                if req.error is None:
                    detokenize(seq, self.tokenizer, self.scheduler.finish)
            except Exception as e:  # noqa: BLE001 - one request's text cannot hurt the others
                log.warning("request %s failed in detokenisation: %r", seq.request_id, e)
                self.fail(seq.request_id, f"detokenisation failed: {e}")
            observe_latency(seq, now, self.metrics)
            touched[seq.request_id] = None
        self.pending.clear()
        outputs = []
        for rid in touched:
            out = request_update(self.by_id[rid], now, self.metrics)
            if out.finished:
                del self.by_id[rid]
            outputs.append(out)
        return outputs
