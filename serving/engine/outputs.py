"""What the engine reports: one `RequestUpdate` per request that made progress in a step, one
`CompletionUpdate` per sample, and the text behind them (incremental detokenisation and stop
strings, matched token by token across token boundaries).

Why "Update": these are the engine's streaming states (cumulative text and tokens plus the delta
since the last report, the seed, timings); the offline API turns a request's final update into
the public `jdet.RequestOutput` (jdet/sampling_params.py; serving/engine/llm_backend.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from serving.sequence import Request, Sequence

log = logging.getLogger("jdet.engine")


@dataclass
class CompletionUpdate:
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
class RequestUpdate:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionUpdate]
    finished: bool
    seed: int  # the request's seed (chosen at admission when the request gave none)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (max over samples)
    num_preemptions: int = 0  # recompute preemptions its samples went through
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the engine ended this request (finish_reason "error")
    # a score request's log-probs (serving/engine/scoring.py): scores[i - 1] = log p(t_i | t_<i)
    scores: list[float] | None = None


def detokenize(seq: Sequence, tok: Any, finish: Callable[[Sequence], None]) -> None:
    """Incremental detokenisation (new text only once it is no longer a partial character),
    then stop strings, matched on the text across token boundaries. One token at a time, so
    a speculative step's several tokens give the text, and the stop, of as many steps: a stop
    string ends the sequence at the token that completes it (`finish(seq)`: the scheduler's);
    later tokens are dropped. `tok` None (a model without a tokenizer): no text.

    Why not `tokenizers.decoders.DecodeStream` (the same prefix/read-offset algorithm in Rust):
    it has `step` only, so the partial character a sequence may end on (max_tokens reached mid
    UTF-8 sequence) would be lost where this flushes it (as "\ufffd", like transformers' decode);
    and it decodes with the Rust backend alone, while a tokenizer that jdet/tokenizer.py leaves to
    transformers may post-process its decode (clean_up_tokenization_spaces on non-BPE models),
    which `tok.decode` here keeps."""
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
                    finish(seq)
                seq.finish_reason, seq.stop_reason = "stop", s
                if end < last:  # tokens past the stop (a speculative run): dropped
                    keep = end - seq.num_prompt_tokens
                    del seq.token_ids[end:], seq.logprobs[keep:], seq.top_logprobs[keep:]
                return


def completion_update(seq: Sequence) -> CompletionUpdate:
    """`seq`'s output so far; marks what it returns as emitted (the next output's deltas start
    there). Text that could be the start of a stop string is held back until it is not."""
    if seq.is_finished or not seq.options.stop:
        visible = len(seq.text)
    else:  # hold back text that could be the start of a stop string
        hold = max(len(s) for s in seq.options.stop) - 1
        visible = max(seq.emitted_chars, len(seq.text) - hold)
    delta_text = seq.text[seq.emitted_chars : visible]
    start = seq.emitted_tokens
    seq.emitted_chars, seq.emitted_tokens = visible, seq.num_output_tokens
    out_ids = seq.output_token_ids
    return CompletionUpdate(
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


def observe_latency(seq: Sequence, now: float, metrics: Any) -> None:
    """A reported sequence's latencies: its time to first token, then the inter-token gap of each
    token since its last report (a step that gave it several tokens splits its gap)."""
    if seq.first_token_time is None:
        seq.first_token_time = now
        metrics.observe("ttft", now - seq.arrival_time)
    else:
        new = seq.num_output_tokens - seq.emitted_tokens
        if new > 0:
            gap = (now - seq.last_token_time) / new
            for _ in range(new):
                metrics.observe("itl", gap)
    seq.last_token_time = now


def request_update(req: Request, now: float, metrics: Any) -> RequestUpdate:
    """The output of one engine request now. When every sample has finished, its end-to-end
    latency and finish reasons are counted in `metrics` and its e2e / TTFT returned in
    `RequestUpdate.metrics`."""
    comps = [completion_update(s) for s in req.seqs]
    finished = all(s.is_finished for s in req.seqs)
    out = RequestUpdate(
        req.request_id,
        req.prompt_token_ids,
        comps,
        finished,
        req.seed,
        num_cached_tokens=max(s.num_cached_tokens for s in req.seqs),
        num_preemptions=sum(s.num_preemptions for s in req.seqs),
        error=req.error,
    )
    if finished:
        if req.seqs[0].is_score and req.error is None:
            out.scores = list(req.seqs[0].scores)
        e2e = now - req.arrival_time
        metrics.observe("e2e", e2e)
        for s in req.seqs:
            metrics.finished.labels(s.finish_reason or "length").inc()
        first = [s.first_token_time for s in req.seqs if s.first_token_time]
        out.metrics = {"e2e": e2e, "ttft": min(first) - req.arrival_time if first else e2e}
    return out
