"""The step input: one flat ragged batch of prefill chunks and decode tokens (DESIGN §3).

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
    The one bucket rule: the engine's token buckets (serving/shapes.py `ShapeSet`) and
    jdet.train's flat batch follow it."""
    b = max(1, minimum)
    while b < n:
        b *= 2
    return min(b, maximum) if n <= maximum else n


def build_batch(
    seqs: list[tuple[list[int], int, list[int]]],
    page_size: int,
    *,
    logits: str = "last",
    pad_tokens: int | None = None,
    pad_seqs: int | None = None,
    pad_pages: int | None = None,
) -> tuple[StepBatch, np.ndarray]:
    """Host-side batch for sequences given as (new token ids, start position, page list).

    `logits="last"` asks for one logits row per sequence (its last new token), `"all"` for every
    token row. Returns the padded numpy batch and the number of real logits rows per sequence.
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
        if logits == "last":
            rows.append(t0 + n - 1)
            nrows[s] = 1
        else:
            rows.extend(range(t0, t0 + n))
            nrows[s] = n
        t0 += n
    qs[S + 1 :] = t0
    batch = StepBatch(tok, pos, slot, qs, cl, pt, np.asarray(rows, np.int32))
    return batch, nrows
