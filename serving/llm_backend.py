"""What `jdet.LLM` calls: offline `generate` and teacher-forced `score` on an `Engine`.

Why here: the offline API and the server share one engine (scheduler, prefix cache, buckets), so
an offline batch is just many requests added at once and stepped to completion.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from serving.block_manager import cdiv
from serving.engine import Engine
from serving.sampling_options import SamplingOptions
from serving.sequence import Sequence as Seq

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
    from jdet.sampling_params import CompletionOutput, RequestOutput

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
        from tqdm.auto import tqdm

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

    Runs the same shape set, the same kernels and the same KV cache as generation; the score
    function's shapes are compiled on its first use (`Engine.warmup("score")`). Many sequences
    share each step (packed up to `max_num_batched_tokens` tokens and `max_num_seqs` sequences,
    long ones chunked), as a trainer's batch would: in the invariant modes the result is bitwise
    the sampler's log-probs however the sequences are packed.
    """
    from jdet.batch import build_batch

    if engine.has_unfinished():
        raise RuntimeError("score() needs an idle engine (the server is using this one)")
    bm, runner, B = engine.block_manager, engine.runner, engine.page_size
    fn = runner.score_step()
    budget = engine.max_num_batched_tokens
    max_seqs = runner.shapes.max_seqs  # a step's sequences, as for generation
    seqs = [[int(t) for t in toks] for toks in token_ids]
    for b, toks in enumerate(seqs):
        if len(toks) > engine.max_model_len:
            raise ValueError(
                f"sequence {b} has {len(toks)} tokens but max_model_len is {engine.max_model_len}"
            )
    out = [np.zeros(max(len(t) - 1, 0), np.float32) for t in seqs]
    todo = [b for b, t in enumerate(seqs) if len(t) > 1]
    while todo:
        # a group of sequences whose pages fit at once (at least one)
        group: list[tuple[int, Seq]] = []
        for b in todo:
            seq = Seq(f"score-{b}", 0, seqs[b], SamplingOptions(), seed=0)
            if not bm.grow(seq, len(seqs[b])):
                if not group:
                    raise RuntimeError(
                        f"sequence {b} needs {cdiv(len(seqs[b]), B)} KV pages; too few free"
                    )
                break
            group.append((b, seq))
        todo = todo[len(group) :]
        try:
            # the last token has no target: feed tokens 0..n-2, packed into budget-sized steps
            work = [(b, 0, len(seqs[b]) - 1) for b, _ in group]
            pages = {b: list(seq.block_table) for b, seq in group}
            while work:
                step, used, rest = [], 0, []
                for b, start, end in work:
                    n = min(end - start, budget - used) if len(step) < max_seqs else 0
                    if n > 0:
                        step.append((b, start, n))
                        used += n
                    if start + n < end:
                        rest.append((b, start + n, end))
                work = rest
                items = [(seqs[b][st : st + n], st, pages[b]) for b, st, n in step]
                Pm = max(len(p) for _, _, p in items)
                Tp, Sp, Pp = runner.shapes.fit(used, len(step), Pm)  # the warmed-up set
                batch, _ = build_batch(items, B, logits="all", pad_tokens=Tp, pad_seqs=Sp,
                                       pad_pages=Pp)  # fmt: skip
                rows = np.zeros(Tp, np.int32)
                rows[:used] = batch.logits_rows
                batch.logits_rows = rows
                targets = np.zeros(Tp, np.int32)
                r = 0
                for b, st, n in step:
                    targets[r : r + n] = seqs[b][st + 1 : st + n + 1]
                    r += n
                runner.kv, res = fn(runner.params, runner.kv, batch, targets)
                res = np.asarray(res)
                r = 0
                for b, st, n in step:
                    out[b][st : st + n] = res[r : r + n]
                    r += n
        finally:
            for _, seq in group:
                bm.release(seq)
    return out
