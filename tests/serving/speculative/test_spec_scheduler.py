"""The scheduler's speculative rules, without a model (serving/engine/scheduler.py).

Exact mode cuts a verify's drafts to what the budget and the free pages leave (no bit depends on
it); rejection mode (`verify_tokens` = K + 1) schedules a verify whole or defers it, and a
recompute leaves its last token to a decode step. The bits these rules protect are tested on a
model in tests/serving/speculative/test_spec_rejection_load.py; here, the plans themselves, each
beside exact mode's plan for the same state (the control: the same state does get cut there).
"""

from __future__ import annotations

import random

import pytest

from serving.engine.page_manager import PageManager
from serving.engine.scheduler import Scheduler
from serving.sequence import Sequence, Status
from tests.serving.engine.test_scheduler import all_seqs, fake_step, make_seq

K = 4


def decoding(sched: Scheduler, prompts: list[int], rng: random.Random) -> list[Sequence]:
    """Sequences admitted, prefilled and holding one output token each: all decoding."""
    seqs = [make_seq(n, f"s{i}", rng) for i, n in enumerate(prompts)]
    for s in seqs:
        sched.add(s)
    while any(s.num_output_tokens == 0 for s in seqs):
        fake_step(sched, sched.schedule(), rng, max_out=100)
    assert all(s.num_uncomputed == 1 for s in seqs)
    return seqs


def plan_with_drafts(verify_tokens: int | None, drafts: list[int], **kw) -> dict[str, int]:
    """The plan (request id -> tokens) for decoding sequences holding `drafts[i]` drafts."""
    pm = PageManager(num_pages=kw.pop("num_pages", 64), page_size=4)
    sched = Scheduler(pm, max_num_seqs=8, verify_tokens=verify_tokens, **kw)
    seqs = decoding(sched, [3] * len(drafts), random.Random(0))
    for s, k in zip(seqs, drafts, strict=True):
        s.draft_token_ids = [7] * k
    plan = sched.schedule()
    pm.check(all_seqs(sched))
    return {s.request_id: n for s, n in plan}


def test_rejection_verifies_are_whole_or_deferred_never_cut():
    """Budget 13: two verifies of 4 drafts fit whole, the third waits (its 5 tokens do not fit
    the 3 left), a younger plain decode still gets its token. Exact mode, same state: the third
    verify is cut to 1 draft."""
    rej = plan_with_drafts(K + 1, [K, K, K, 0], max_num_batched_tokens=13)
    assert rej == {"s0": 5, "s1": 5, "s3": 1}
    exact = plan_with_drafts(None, [K, K, K, 0], max_num_batched_tokens=13)
    assert exact == {"s0": 5, "s1": 5, "s2": 2, "s3": 1}  # decodes first, then drafts cut


def test_rejection_verify_takes_its_pages_as_a_decode_does():
    """Too few free pages for every verify's drafts: rejection mode preempts the newest running
    sequence (as for a decode's own page) rather than cut a verify; exact mode cuts the drafts
    to the pages left and preempts nobody."""
    pages = dict(max_num_batched_tokens=32, num_pages=4)  # 4 sequences x 1 page, none free
    rej = plan_with_drafts(K + 1, [K, K, K, K], **pages)
    assert all(n == 5 for n in rej.values()) and len(rej) < 4  # whole; someone preempted
    exact = plan_with_drafts(None, [K, K, K, K], **pages)
    assert len(exact) == 4 and any(n < 5 for n in exact.values())


def recompute_plan(verify_tokens: int | None, prompt: int, outputs: int) -> tuple:
    """A sequence preempted after `outputs` output tokens (its full pages in the prefix cache),
    then re-admitted: the sequence, its tokens in the re-admitting step, the scheduler."""
    pm = PageManager(num_pages=64, page_size=4, enable_prefix_caching=True)
    sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8, verify_tokens=verify_tokens)
    rng = random.Random(1)
    (seq,) = decoding(sched, [prompt], rng)
    while seq.num_output_tokens < outputs:
        fake_step(sched, sched.schedule(), rng, max_out=100)
    sched._preempt(seq, {}, [0])
    assert seq.status is Status.WAITING
    plan = dict(sched.schedule())
    pm.check(all_seqs(sched))
    return seq, plan[seq], sched


@pytest.mark.parametrize("prompt, outputs", [(6, 3), (8, 1), (5, 4)])
def test_a_rejection_recompute_leaves_its_last_token_to_a_decode_step(prompt, outputs):
    """Rejection mode: the recompute computes all but the last token (even when the prefix
    cache holds every page before it: (5, 4) has 9 tokens, 8 of them cached), so the next step
    is a decode that drafts as it would have. Exact mode (the control): the recompute computes
    the last token too and samples the next position in its prefill."""
    seq, n, sched = recompute_plan(K + 1, prompt, outputs)
    assert n >= 1 and seq.num_computed_tokens + n == seq.num_tokens - 1
    assert sched.num_held_recomputes == 1
    seq, n, sched = recompute_plan(None, prompt, outputs)
    assert seq.num_computed_tokens + n == seq.num_tokens and sched.num_held_recomputes == 0


def test_a_verify_larger_than_the_budget_is_refused_by_name():
    with pytest.raises(ValueError, match="max_num_batched_tokens to at least 5"):
        Scheduler(PageManager(8, 4), max_num_batched_tokens=4, max_num_seqs=2, verify_tokens=5)
