"""A step's inputs, one small function per kind, as the engine's steps need them:

  sample_inputs   sequences that sample: prefill chunks, decodes, speculative verifies (k + 1
                  sampled rows for k drafts); a plain decode step goes to decode_inputs
  decode_inputs   one token and one sampled row per sequence (the synchronous decode step):
                  `decode_batch`'s layout and the plan's kept sampling rows (ahead_rows)
  ahead_inputs    the decode step after the one in flight, its input tokens that step's samples
                  on the device (async scheduling)
  score_inputs    score requests' rows and their targets (serving/engine/scoring.py)
  score_as_step   a score batch as a step's inputs, for a separate draft model's cache

Each pads to a shape of the runner's `ShapeSet` (serving/engine/shapes.py) and lays the batch out
through jdet/batch.py (`build_batch`, `decode_batch`, the one batch builder). They read the
runner's shapes, page size, sampler variants and logits rows (serving/constrained/
logits_rows.py), and keep its `ahead_cache`; the runner's `prepare`, `prepare_ahead`,
`prepare_score` and `as_step` call them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jdet.batch import build_batch, decode_batch
from jdet.step import SamplingInputs
from serving.engine import sampler_variants
from serving.sequence import Sequence, num_rows, step_tokens


def sample_inputs(runner: Any, plan: list[tuple[Sequence, int]]) -> tuple[Any, Any]:
    """The padded numpy StepBatch and SamplingInputs for `plan` (sequences that sample): one
    sampled row per sequence, k + 1 for a speculative verify of k drafts
    (serving/speculative/speculator.py)."""
    T = sum(n for _, n in plan)
    R = [num_rows(seq, n) for seq, n in plan]  # sampled rows: k + 1 for a verify
    Tp, Sp, Pp = runner.shapes.fit(T, sum(R), max(len(s.page_table) for s, _ in plan))
    runner.shapes_seen.add((Tp, Sp, Pp))
    if T == len(plan) and sum(R) == T:  # one token, one sampled row each: a decode step
        fast = decode_inputs(runner, plan, Tp, Sp, Pp)
        if fast is not None:
            return fast
    items = [(step_tokens(s, n), s.num_computed_tokens, s.page_table) for s, n in plan]
    batch, _ = build_batch(items, runner.page_size, logits=R, pad_tokens=Tp, pad_seqs=Sp,
                           pad_pages=Pp, pad_rows=Sp)  # fmt: skip
    temp = np.zeros(Sp, np.float32)
    top_k = np.zeros(Sp, np.int32)
    top_p = np.ones(Sp, np.float32)
    seed = np.zeros(Sp, np.uint32)
    spos = np.zeros(Sp, np.int32)
    r0 = 0
    first_row = []
    for s, (seq, n) in enumerate(plan):
        end = seq.num_computed_tokens + n
        r = slice(r0, r0 + R[s])  # the sequence's last R[s] tokens are sampled
        first_row.append(r0)
        o = seq.options
        temp[r], top_k[r], top_p[r] = o.temperature, o.top_k, o.top_p
        seed[r] = seq.seed
        spos[r] = np.arange(end - R[s], end) + 1  # where each sample goes
        r0 += R[s]
    want_top = any(s.options.logprobs for s, _ in plan)
    transforms = any(s.options.needs_logits_inputs for s, _ in plan)
    variant = sampler_variants.step_variant(temp, top_k, top_p, want_top, transforms,
                                            runner.variants)  # its sampler  # fmt: skip
    built = runner.logits_rows.build(plan, Sp, Pp * runner.page_size, first_row)
    sampling = SamplingInputs(
        temperature=temp, top_k=top_k, top_p=top_p, seed=seed, position=spos,
        logits=built if variant.transforms else None, **variant.fields(),
    )  # fmt: skip
    return batch, sampling


def decode_inputs(runner: Any, plan: list[tuple[Sequence, int]], Tp: int, Sp: int, Pp: int) -> Any:
    """`sample_inputs` of a step that feeds each sequence one token and samples its row (the
    synchronous engine's every decode step): `decode_batch`'s layout, which is
    `build_batch`'s (tests/jdet/test_batch.py), and the plan's kept sampling rows; None
    (the general path) when a row needs LogitsInputs."""
    rows = ahead_rows(runner, plan, Sp)
    if rows is None:
        return None
    batch = decode_batch([s.token_ids[s.num_computed_tokens] for s, _ in plan],
                         [s.num_computed_tokens for s, _ in plan],
                         [s.page_table for s, _ in plan], runner.page_size,
                         pad_tokens=Tp, pad_seqs=Sp, pad_pages=Pp)  # fmt: skip
    temp, top_k, top_p, seed, variant = rows
    sampling = SamplingInputs(
        temperature=temp, top_k=top_k, top_p=top_p, seed=seed,
        position=batch.context_lens.copy(),  # the sampled token's position: last + 1
        logits=runner.neutral_logits(variant, Sp, Pp), **variant.fields(),
    )  # fmt: skip
    return batch, sampling


def score_inputs(runner: Any, plan: list[tuple[Sequence, int]]) -> tuple[Any, np.ndarray]:
    """The padded numpy StepBatch and targets [T] of score requests (`Sequence.targets`):
    every computed row gives the log-prob of the token after it (the score function's
    shapes: logits rows padded to the T bucket)."""
    T = sum(n for _, n in plan)
    Tp, Sp, Pp = runner.shapes.fit(T, len(plan), max(len(s.page_table) for s, _ in plan))
    items, targets, t0 = [], np.zeros(Tp, np.int32), 0
    for seq, n in plan:
        start = seq.num_computed_tokens
        items.append((seq.token_ids[start : start + n], start, seq.page_table))
        targets[t0 : t0 + n] = seq.targets[start : start + n]
        t0 += n
    batch, _ = build_batch(items, runner.page_size, logits="all", pad_tokens=Tp, pad_seqs=Sp,
                           pad_pages=Pp, pad_rows=Tp)  # fmt: skip
    return batch, targets


def score_as_step(runner: Any, batch: Any) -> tuple[Any, Any]:
    """A `prepare_score` batch as a step's inputs (rows: the S bucket's, greedy), for a
    separate draft model, which writes its own K/V of the same tokens (its `mirror`)."""
    Sp, Pp = batch.page_table.shape
    z = np.zeros(Sp, np.float32)
    sampling = SamplingInputs(
        temperature=z, top_k=np.zeros(Sp, np.int32), top_p=z + 1,
        seed=np.zeros(Sp, np.uint32), position=np.zeros(Sp, np.int32),
        logits=runner.logits_rows.neutral(Sp, Pp * runner.page_size),
    )  # fmt: skip
    return dataclasses.replace(batch, logits_rows=np.zeros(Sp, np.int32)), sampling


def ahead_inputs(runner: Any, plan: list[tuple[Sequence, int]], tokens: Any) -> tuple | None:
    """The decode step after the one in flight, one row per sequence in the same order, its
    input tokens the in-flight step's sampled `tokens` (a device array, never brought to the
    host): sequence i's new token sits at position seq.num_tokens (the host does not know
    it yet). Fewer `tokens` than the step's T bucket (an S bucket below its T bucket, e.g.
    max_num_seqs=8 under a 16-token bucket) are padded on the device, as the host pads its
    own token ids; None when there are more (the caller then runs the step the ordinary
    way, after the host has the tokens)."""
    S = len(plan)
    Tp, Sp, Pp = runner.shapes.fit(S, S, max(len(s.page_table) for s, _ in plan))
    if tokens.ndim != 1 or tokens.shape[0] > Tp:
        return None
    if tokens.shape[0] < Tp:
        tokens = runner.pad_tokens(tokens.shape[0], Tp)(tokens)
    rows = ahead_rows(runner, plan, Sp)
    if rows is None:
        return None  # penalties, masks, grammar read the previous token on the host
    runner.shapes_seen.add((Tp, Sp, Pp))
    batch = decode_batch([0] * S, [s.num_tokens for s, _ in plan],
                         [s.page_table for s, _ in plan], runner.page_size,
                         pad_tokens=Tp, pad_seqs=Sp, pad_pages=Pp)  # fmt: skip
    batch.token_ids = tokens
    temp, top_k, top_p, seed, variant = rows
    sampling = SamplingInputs(
        temperature=temp, top_k=top_k, top_p=top_p, seed=seed,
        position=batch.context_lens.copy(),
        logits=runner.neutral_logits(variant, Sp, Pp), **variant.fields(),
    )  # fmt: skip
    return batch, sampling


def ahead_rows(runner: Any, plan: list[tuple[Sequence, int]], Sp: int) -> tuple | None:
    """The sampling rows (temperature, top_k, top_p, seed [Sp]) of a decode step of `plan`'s
    sequences and its sampler variant (serving/engine/sampler_variants.py `Variant`),
    or None if one of them needs LogitsInputs. Kept for the last plan: a steady
    decode dispatches the same sequences step after step, and a sequence's options and seed
    never change, so the arrays are built once, not once a step (the step only reads them:
    never written after they are built)."""
    key = (Sp, tuple(s.seq_id for s, _ in plan))
    if runner.ahead_cache is not None and runner.ahead_cache[0] == key:
        return runner.ahead_cache[1]
    val, S, opts = None, len(plan), [s.options for s, _ in plan]
    if not any(o.needs_logits_inputs for o in opts):
        pad = [0] * (Sp - S)
        val = (np.array([o.temperature for o in opts] + pad, np.float32),
               np.array([o.top_k for o in opts] + pad, np.int32),
               np.array([o.top_p for o in opts] + [1] * (Sp - S), np.float32),
               np.array([s.seed for s, _ in plan] + pad, np.uint32))  # fmt: skip
        want_top = any(o.logprobs for o in opts)
        val += (sampler_variants.step_variant(*val[:3], want_top, False, runner.variants),)
    runner.ahead_cache = (key, val)
    return val
