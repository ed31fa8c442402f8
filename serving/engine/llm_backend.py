"""What `jdet.LLM` calls: offline `generate` and teacher-forced `score` on an `Engine`.

Why here: the offline API and the server share one engine (scheduler, prefix cache, buckets), so
an offline batch is just many requests added at once and stepped to completion.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from jdet.sampling_params import CompletionOutput, RequestOutput
from serving.engine.engine import Engine

_IDS = itertools.count()


def generate(
    engine: Engine,
    prompts_token_ids: Sequence[Sequence[int]],
    sampling_params_list: Sequence[Any],
    *,
    prompts: Sequence[str | None] | None = None,
    use_tqdm: bool | None = None,
) -> list[Any]:
    """Run every prompt to completion; outputs in prompt order as `jdet.RequestOutput`s.

    `sampling_params_list[i]` is any object with SamplingParams' attribute names. A progress bar
    shows for batches of 64+ prompts unless `use_tqdm=False`.
    """
    if engine.has_unfinished():
        raise RuntimeError("generate() needs an idle engine (the server is using this one)")
    if len(sampling_params_list) != len(prompts_token_ids):
        raise ValueError(
            f"{len(prompts_token_ids)} prompts but {len(sampling_params_list)} sampling params"
        )
    rids = [f"llm-{next(_IDS)}" for _ in prompts_token_ids]
    for rid, ids, sp in zip(rids, prompts_token_ids, sampling_params_list, strict=True):
        engine.add_request(rid, list(ids), sp)
    bar = None
    if use_tqdm or (use_tqdm is None and len(rids) >= 64):
        bar = tqdm(total=len(rids), desc="generate", unit="req")
    final: dict[str, Any] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    results = []
    for i, rid in enumerate(rids):
        o = final[rid]
        comps = [
            CompletionOutput(
                c.index,
                list(c.token_ids),
                np.asarray(c.logprobs, np.float32),
                c.text,
                c.finish_reason,
                [dict(t) for t in c.top_logprobs] if c.top_logprobs is not None else None,
                c.seed,
            )
            for c in o.outputs
        ]
        prompt = prompts[i] if prompts is not None else None
        results.append(RequestOutput(prompt, list(prompts_token_ids[i]), comps))
    return results


def stream(engine: Engine, prompt_token_ids: Sequence[int], sampling_params: Any) -> Iterator[str]:
    """Yield the text deltas of one completion (sample 0) as the engine produces them; stop
    strings are already applied (text that could begin a stop string is held back)."""
    if engine.has_unfinished():
        raise RuntimeError("stream() needs an idle engine (the server is using this one)")
    rid = f"llm-{next(_IDS)}"
    engine.add_request(rid, list(prompt_token_ids), sampling_params)
    try:
        while engine.has_unfinished():
            for o in engine.step():
                delta = o.outputs[0].delta_text
                if delta:
                    yield delta
    finally:
        engine.abort(rid)  # a consumer that stops early frees the pages


def score(engine: Engine, token_ids: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """Teacher-forced log-probs: out[b][i - 1] = log p(tokens[i] | tokens[:i]) for i >= 1.

    One score request per sequence (serving/engine/scoring.py), scheduled like any request: packed
    up to `stall_free_budget` tokens and `max_num_seqs` sequences a step, long ones chunked,
    preempted and recomputed when pages run short, on the same shape set, kernels and KV cache as
    generation (the score function's shapes are compiled on first use, `Engine.warmup("score")`).
    In the invariant modes the result is bitwise the sampler's log-probs however it is packed.
    """
    if engine.has_unfinished():
        raise RuntimeError("score() needs an idle engine (the server is using this one)")
    seqs = [[int(t) for t in toks] for toks in token_ids]
    for b, toks in enumerate(seqs):
        if len(toks) > engine.max_model_len:
            raise ValueError(
                f"sequence {b} has {len(toks)} tokens but max_model_len is {engine.max_model_len}"
            )
    out = [np.zeros(max(len(t) - 1, 0), np.float32) for t in seqs]
    rids = {}
    try:
        for b, toks in enumerate(seqs):
            if len(toks) > 1:  # one token has nothing to score
                rid = f"score-{next(_IDS)}"
                engine.add_score(rid, toks)
                rids[rid] = b
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    if o.error is not None:
                        raise RuntimeError(f"score of sequence {rids[o.request_id]}: {o.error}")
                    out[rids[o.request_id]][:] = o.scores
    finally:
        for rid in rids:
            engine.abort(rid)  # an error or interrupt leaves the engine idle, its pages free
    return out
