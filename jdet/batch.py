"""The step input: one flat ragged batch of prefill chunks and decode tokens (ARCHITECTURE.md).

Why flat: prefill chunks and decodes share one batch (Sarathi-Serve), and every kernel sees the
same layout; padding to bucketed sizes keeps the number of compiled shapes small.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepBatch:
    token_ids: jax.Array  # i32[T]
    positions: jax.Array  # i32[T]
    slot_mapping: jax.Array  # i32[T]; -1 = padding, not written
    query_start: jax.Array  # i32[S+1]
    context_lens: jax.Array  # i32[S]
    page_table: jax.Array  # i32[S, Pmax]
    logits_rows: jax.Array  # i32[N]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


def pow2_bucket(n: int, minimum: int, maximum: int = 1 << 62) -> int:
    """Smallest power of two >= max(n, minimum), capped at `maximum` (itself a valid bucket).
    The one bucket rule: the engine's token buckets (serving/engine/shapes.py `ShapeSet`) and
    jdet.train's flat batch follow it."""
    b = max(1, minimum)
    while b < n:
        b *= 2
    return min(b, maximum) if n <= maximum else n


def build_batch(
    seqs: list[tuple[list[int], int, list[int]]],
    page_size: int,
    *,
    logits: str | list[int] = "last",
    pad_tokens: int | None = None,
    pad_seqs: int | None = None,
    pad_pages: int | None = None,
    pad_rows: int | None = None,
) -> tuple[StepBatch, np.ndarray]:
    """Host-side batch for sequences given as (new token ids, start position, page list): THE
    batch builder (the engine's steps, decode steps dispatched ahead, model drafts, scoring,
    jdet.train), so every caller lays a step out the same way (ARCHITECTURE.md).

    `logits="last"` asks for one logits row per sequence (its last new token), `"all"` for every
    token row, a list of ints for that many trailing rows of each sequence (a speculative verify
    samples its last k + 1). `pad_rows` pads `logits_rows` with row 0 to that length (the step
    samples `S` bucket rows, scoring `T` bucket rows). Returns the padded numpy batch and the
    number of real logits rows per sequence.
    """
    T = sum(len(t) for t, _, _ in seqs)
    S = len(seqs)
    Pm = max([len(p) for _, _, p in seqs] + [1])
    Tp = pad_tokens or T
    Sp = pad_seqs or S
    Pp = pad_pages or Pm
    if Tp < T or Sp < S or Pp < Pm:
        raise ValueError("padding sizes must not be smaller than the batch")
    tok = np.zeros(Tp, np.int32)
    pos = np.zeros(Tp, np.int32)
    slot = np.full(Tp, -1, np.int32)
    qs = np.zeros(Sp + 1, np.int32)
    cl = np.zeros(Sp, np.int32)
    pt = np.zeros((Sp, Pp), np.int32)
    rows: list[int] = []
    nrows = np.zeros(S, np.int32)
    if not isinstance(logits, str) and len(logits) != S:
        raise ValueError(f"logits gives row counts for {len(logits)} of {S} sequences")
    if isinstance(logits, str) and logits not in ("last", "all"):
        raise ValueError(f"logits must be 'last', 'all' or row counts per sequence: {logits!r}")
    t0 = 0
    for s, (ids, start, pages) in enumerate(seqs):
        n = len(ids)
        p = np.arange(start, start + n)
        if start + n > len(pages) * page_size:
            raise ValueError(f"sequence {s} needs {start + n} slots but has {len(pages)} pages")
        tok[t0 : t0 + n] = ids
        pos[t0 : t0 + n] = p
        pg = np.asarray(pages, np.int32)
        slot[t0 : t0 + n] = pg[p // page_size] * page_size + p % page_size
        qs[s + 1] = t0 + n
        cl[s] = start + n
        pt[s, : len(pages)] = pg
        k = 1 if logits == "last" else n if logits == "all" else int(logits[s])
        if not 0 <= k <= n:
            raise ValueError(f"sequence {s} asks for {k} logits rows of its {n} tokens")
        rows.extend(range(t0 + n - k, t0 + n))
        nrows[s] = k
        t0 += n
    qs[S + 1 :] = t0
    R = len(rows) if pad_rows is None else pad_rows
    if R < len(rows):
        raise ValueError(f"pad_rows={R} is below the batch's {len(rows)} logits rows")
    out_rows = np.zeros(R, np.int32)
    out_rows[: len(rows)] = rows
    batch = StepBatch(tok, pos, slot, qs, cl, pt, out_rows)
    return batch, nrows


def decode_batch(
    tokens: list[int],
    positions: list[int],
    pages: list[list[int]],
    page_size: int,
    *,
    pad_tokens: int,
    pad_seqs: int,
    pad_pages: int,
) -> StepBatch:
    """A decode step: sequence s feeds one token, `tokens[s]` at `positions[s]`, and samples it
    (rows padded to `pad_seqs`). Why a helper: the decode step dispatched ahead
    (serving/engine/model_runner.py `prepare_ahead`, which then puts the device's tokens in) and a
    model draft's passes (serving/speculative/draft_model.py) build exactly this, once per decode
    step.

    The layout is `build_batch`'s (one token and one logits row per sequence; tests/jdet/
    test_batch.py checks the two equal bitwise), built with a fixed handful of numpy calls
    (the int32 fields are slices of one buffer) plus one page-table row copy and a little
    integer arithmetic per sequence, where the general builder makes ~10 numpy calls per
    sequence. Why: on the critical path once the device step is short (several times faster at
    batch 8: BENCHMARKS.md)."""
    S = len(positions)
    if len(tokens) != S or len(pages) != S:
        raise ValueError(f"decode_batch got {len(tokens)} tokens, {S} positions and "
                         f"{len(pages)} page lists; it needs one of each per sequence")  # fmt: skip
    Pm = max([len(p) for p in pages] + [1])
    if pad_tokens < S or pad_seqs < S or pad_pages < Pm:
        raise ValueError("padding sizes must not be smaller than the batch")
    pt = np.zeros((pad_seqs, pad_pages), np.int32)
    slots = [0] * S
    for s, (pg, q) in enumerate(zip(pages, positions, strict=True)):
        if q < 0:
            raise ValueError(f"sequence {s}'s decode position is {q}; positions are >= 0")
        if q >= len(pg) * page_size:
            raise ValueError(f"sequence {s} needs {q + 1} slots but has {len(pg)} pages")
        pt[s, : len(pg)] = pg
        slots[s] = pg[q // page_size] * page_size + q % page_size
    T, Sp = pad_tokens, pad_seqs
    buf = np.zeros(3 * T + 3 * Sp + 1, np.int32)  # one allocation; the fields are its slices
    tok, p, slot = buf[:T], buf[T : 2 * T], buf[2 * T : 3 * T]
    a = 3 * T + Sp + 1
    qs, cl, rows = buf[3 * T : a], buf[a : a + Sp], buf[a + Sp : a + 2 * Sp]
    tok[:S] = tokens
    p[:S] = positions
    slot[:S] = slots
    slot[S:] = -1
    qs[: S + 1] = range(S + 1)
    qs[S + 1 :] = S
    cl[:S] = p[:S] + 1
    rows[:S] = range(S)
    return StepBatch(tok, p, slot, qs, cl, pt, rows)
