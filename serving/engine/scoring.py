"""Score requests: teacher-forced log-probs as a request kind of the engine's one scheduler.

Why a request kind and not a loop of its own: a score request then gets what every request gets
(the token budget, chunked prefill, preemption, the page pool and its accounting, the prefix
cache) and shares steps with sampling requests, so a server can score and generate at once.

A score request of tokens t_0..t_{n-1} is one prefill-only sequence of t_0..t_{n-2}
(`Sequence.targets` = t_1..t_{n-1}) whose row i gives scores[i] = log p(t_{i+1} | t_0..t_i); it
samples nothing and finishes (reason "stop") once every row is scored. The scheduler treats it as
a prompt; in a step, its rows go to the score function (jdet/step.py `make_score_fn`: log-probs
on every token row) and the sampling rows to the step function: one schedule, one budget, one
page pool, two device calls (sampling and scoring compile to two functions of the same forward).
Since no row's bits depend on the batch (README.md), a score is bitwise the sampler's log-probs
of the same tokens however it is chunked, batched or preempted.

Why a mixed step (`Engine.num_mixed_steps` counts them) is two device calls, not one executable: one
would be a third function kind, a forward over both batches merged with the LM head on every score
row and the sampled rows, returning samples and log-probs. Its bits would be the same in the
invariant modes, but (1) the engine compiles every shape of every kind before it serves
(serving/engine/shapes.py); a merged kind is a third shape set, whose logits rows follow the T
bucket, compiled by every engine that may score or else mid-serving (the stall warm-up exists to
avoid); (2) in "none" a row's matmuls follow the batch, so a sampling row's bits would then depend
on whether a score request shared its step; (3) the step's other consumers (dispatch-ahead, the
speculative verify, a draft model's `mirror`) take the step function's batch as it is. The cost of
two calls is a second pass over the weights in a mixed step (a decode-bound step reads them twice);
no measurement yet says it is worth a third kind.

Prefix cache: a row's log-prob needs that row's logits, so a score request reads cached pages
only for rows it has already scored (the recompute after a preemption, serving/engine/scheduler.py);
its computed pages are published like any prompt's, so a later request with that prefix hits.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from serving.sampling_options import InvalidRequest, SamplingOptions, check_prompt_ids
from serving.sequence import Request, Sequence, Status


def score_request(
    request_id: str, token_ids: list[int], *, vocab_size: int, max_model_len: int, now: float
) -> Request:
    """The engine request that scores `token_ids` (checked here: at least 2 tokens, each in the
    vocabulary, at most max_model_len): one prefill-only sequence of all tokens but the last,
    whose targets are all tokens but the first."""
    if not isinstance(token_ids, list | tuple) or len(token_ids) < 2:
        raise InvalidRequest(
            "token_ids", "a score request needs at least 2 tokens (the first has no log-prob)"
        )
    V, L = vocab_size, max_model_len
    check_prompt_ids(list(token_ids[:-1]), vocab_size=V, max_model_len=L, field="token_ids")
    check_prompt_ids(list(token_ids[-1:]), vocab_size=V, max_model_len=L, field="token_ids")
    toks = [int(t) for t in token_ids]
    seq = Sequence(request_id, 0, toks[:-1], SamplingOptions(), seed=0, arrival_time=now,
                   targets=toks[1:])  # fmt: skip
    return Request(request_id, toks, 0, [seq], now)


def record_scores(plan: list[tuple[Sequence, int]], out: Any) -> None:
    """Write a step's score rows (`out`, in `plan` order, as the runner's `prepare_score` laid
    them out) into their sequences' `scores`."""
    res = np.asarray(out)
    r = 0
    for seq, n in plan:
        if seq.status is Status.RUNNING:
            start = seq.num_computed_tokens
            seq.scores[start : start + n] = res[r : r + n].tolist()
            seq.num_scored = max(seq.num_scored, start + n)
        r += n


def split_scores(plan: list[tuple[Sequence, int]]) -> tuple[list, list]:
    """(the sampling entries, the score entries) of a step's plan, each in plan order."""
    return [(s, n) for s, n in plan if not s.is_score], [(s, n) for s, n in plan if s.is_score]

