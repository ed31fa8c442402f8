"""Scheduler and page manager without a model: budget, decode-first, FCFS, preemption choice,
prefix hash chain and exact page accounting. A fake "step" appends a random token per sampled
sequence, so the tests drive the real scheduling loop."""

from __future__ import annotations

import random

import pytest

from serving.engine.page_manager import PageManager, page_hash
from serving.engine.scheduler import Scheduler
from serving.sampling_options import SamplingOptions
from serving.sequence import Sequence, Status, derive_seed


def make_seq(n_prompt: int, rid: str = "r", rng: random.Random | None = None) -> Sequence:
    rng = rng or random.Random(0)
    prompt = [rng.randrange(1, 300) for _ in range(n_prompt)]
    return Sequence(rid, 0, prompt, SamplingOptions(), seed=0)


def fake_step(sched: Scheduler, plan, rng: random.Random, max_out: int) -> list[Sequence]:
    """Advance the plan as the engine does: K/V written, a token sampled per finished prefill."""
    sched.advance(plan)
    done = []
    for seq, _ in plan:
        if seq.status is Status.RUNNING and seq.num_uncomputed == 0:
            seq.token_ids.append(rng.randrange(1, 300))
            if seq.num_output_tokens >= max_out:
                sched.finish(seq)
                done.append(seq)
    return done


def all_seqs(sched: Scheduler) -> list[Sequence]:
    return list(sched.running) + list(sched.waiting)


def test_budget_is_respected_and_decodes_come_first():
    pm = PageManager(num_pages=64, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=16, max_num_seqs=8)
    rng = random.Random(1)
    decoders = [make_seq(3, f"d{i}", rng) for i in range(3)]
    for s in decoders:
        sched.add(s)
    plan = sched.schedule()
    assert sum(n for _, n in plan) <= 16
    fake_step(sched, plan, rng, max_out=100)
    assert all(s.num_uncomputed == 1 for s in decoders)  # all three now decoding
    sched.add(make_seq(40, "long", rng))
    plan = sched.schedule()
    assert sum(n for _, n in plan) == 16  # the long prefill fills exactly the rest
    assert [s.request_id for s, _ in plan][:3] == ["d0", "d1", "d2"]
    assert [n for _, n in plan] == [1, 1, 1, 13]
    pm.check(all_seqs(sched))


def test_prefill_first_policy_stalls_decodes():
    pm = PageManager(num_pages=64, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=16, max_num_seqs=8, policy="prefill_first")
    rng = random.Random(2)
    sched.add(make_seq(3, "d", rng))
    fake_step(sched, sched.schedule(), rng, max_out=100)
    sched.add(make_seq(10, "p", rng))
    plan = sched.schedule()
    assert [s.request_id for s, _ in plan] == ["p"]  # the decode stalls


def test_admission_is_fcfs_and_limited_by_max_num_seqs():
    pm = PageManager(num_pages=64, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=1000, max_num_seqs=3)
    for i in range(5):
        sched.add(make_seq(5, f"r{i}"))
    plan = sched.schedule()
    assert [s.request_id for s, _ in plan] == ["r0", "r1", "r2"]
    assert [s.request_id for s in sched.waiting] == ["r3", "r4"]


def test_head_of_queue_is_not_overtaken_when_pages_are_short():
    pm = PageManager(num_pages=6, page_size=4, watermark=0.0)
    sched = Scheduler(pm, max_num_batched_tokens=8, max_num_seqs=8)
    sched.add(make_seq(20, "big"))  # 5 pages
    sched.add(make_seq(2, "small"))
    plan = sched.schedule()
    assert [(s.request_id, n) for s, n in plan] == [("big", 8)]  # budget-limited chunk
    plan = sched.schedule()
    fake_step(sched, plan, random.Random(0), 100)
    pm.check(all_seqs(sched))


def test_newest_running_sequence_is_preempted_and_requeued_first():
    pm = PageManager(num_pages=4, page_size=4, watermark=0.0)
    sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8)
    rng = random.Random(3)
    a, b = make_seq(7, "old", rng), make_seq(7, "new", rng)
    sched.add(a)
    sched.add(b)
    fake_step(sched, sched.schedule(), rng, 100)  # both prefilled: 2 pages each, pool full
    assert pm.num_free == 0
    fake_step(sched, sched.schedule(), rng, 100)  # token 8 of each fits in page 2
    plan = sched.schedule()  # token 9 needs a third page each: "new" is preempted
    assert [s.request_id for s, _ in plan] == ["old"]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and b.page_table == []
    assert sched.waiting[0] is b and sched.num_preemptions == 1
    pm.check(all_seqs(sched))


def test_prefix_cache_hit_reuses_full_pages_only_and_chain_depends_on_parent():
    pm = PageManager(num_pages=32, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8)
    rng = random.Random(4)
    first = make_seq(10, "a", rng)
    sched.add(first)
    plan = sched.schedule()
    first_pages = list(first.page_table[:2])  # freed (and the table cleared) when it finishes
    fake_step(sched, plan, rng, max_out=1)  # finishes: pages freed but cached
    assert pm.num_used == 0 and len(pm.hash_to_page) == 2
    same = Sequence("b", 0, list(first.prompt_token_ids), SamplingOptions(), seed=0)
    sched.add(same)
    plan = sched.schedule()
    assert same.num_cached_tokens == 8 and plan[0][1] == 2  # 2 full pages hit, 2 tokens left
    assert same.page_table[:2] == first_pages, "the hit must reuse the cached physical pages"
    assert all(pm.ref_count[p] == 1 for p in first_pages)
    # the same page of tokens after a different first page hashes differently
    p0, p1 = first.prompt_token_ids[:4], first.prompt_token_ids[4:8]
    assert page_hash(page_hash(b"", p0), p1) != page_hash(page_hash(b"", p1), p1)
    pm.check(all_seqs(sched))


def test_prompt_fully_cached_still_recomputes_its_last_token():
    pm = PageManager(num_pages=32, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8)
    rng = random.Random(5)
    first = make_seq(8, "a", rng)
    sched.add(first)
    fake_step(sched, sched.schedule(), rng, max_out=1)
    again = Sequence("b", 0, list(first.prompt_token_ids), SamplingOptions(), seed=0)
    sched.add(again)
    plan = sched.schedule()
    assert again.num_cached_tokens == 4 and plan[0][1] == 4


def test_lru_eviction_takes_least_recently_freed_page():
    pm = PageManager(num_pages=3, page_size=2, watermark=0.0)
    s1, s2 = make_seq(2, "a", random.Random(6)), make_seq(2, "b", random.Random(7))
    for s in (s1, s2):
        pm.admit(s, [])
        pm.grow(s, 2)
        s.num_computed_tokens = 2
        pm.register_full_pages(s)
    p1, p2 = s1.page_table[0], s2.page_table[0]
    pm.release(s1)
    pm.release(s2)
    s3 = make_seq(4, "c", random.Random(8))
    pm.admit(s3, [])
    pm.grow(s3, 4)  # takes the never-used page, then the least recently freed (p1)
    assert p1 in s3.page_table and p2 not in s3.page_table
    assert pm.evictions == 1 and p2 in pm.page_to_hash


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_page_returns_after_random_workload_with_aborts(seed):
    rng = random.Random(seed)
    pm = PageManager(num_pages=12, page_size=4, watermark=0.1)
    sched = Scheduler(pm, max_num_batched_tokens=rng.choice([8, 16, 64]), max_num_seqs=5)
    shared = [rng.randrange(1, 300) for _ in range(9)]
    live: list[Sequence] = []
    for step in range(400):
        if step < 150 and rng.random() < 0.3:
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(1, 300) for _ in range(rng.randrange(1, 12))
            ]
            s = Sequence(f"r{step}", 0, prompt, SamplingOptions(), seed=0)
            sched.add(s)
            live.append(s)
        if live and rng.random() < 0.05:  # abort anything, in any state
            victim = rng.choice(live)
            if not victim.is_finished:
                sched.finish(victim)
        plan = sched.schedule()
        assert sum(n for _, n in plan) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        fake_step(sched, plan, rng, max_out=rng.randrange(1, 10))
        pm.check(all_seqs(sched))
        if step > 150 and not sched.has_work():
            break
    assert not sched.has_work()
    assert pm.num_free == pm.num_pages and all(c == 0 for c in pm.ref_count)
    assert pm.prefix_hits > 0


def test_derived_seeds_are_deterministic_and_distinct():
    assert derive_seed(7, 0) == 7
    seeds = [derive_seed(7, i) for i in range(8)]
    assert seeds == [derive_seed(7, i) for i in range(8)] and len(set(seeds)) == 8
    assert all(0 <= s < 2**32 for s in seeds + [derive_seed(-5, 0), derive_seed(2**70, 0)])


def _score_seq(n: int, rid: str) -> Sequence:
    toks = list(range(1, n + 2))
    return Sequence(rid, 0, toks[:-1], SamplingOptions(), seed=0, targets=toks[1:])


def test_a_step_without_decodes_takes_the_largest_bucket_its_prompts_fill():
    """The stall-free budget holds while anyone decodes or a score request is queued; a step
    without decodes rounds up to max_num_batched_tokens down to a token bucket the pending prompt
    tokens fill, and never below the stall-free budget."""
    pm = PageManager(num_pages=128, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8, stall_free_budget=16,
                      token_buckets=(8, 16, 32, 64))  # fmt: skip
    rng = random.Random(2)
    long = make_seq(100, "long", rng)
    sched.add(long)
    sizes = []
    while long.num_output_tokens == 0:
        plan = sched.schedule()
        sizes.append(sum(n for _, n in plan))
        fake_step(sched, plan, rng, max_out=100)
    assert sizes == [64, 32, 4]  # 100 = 64 + 32 + 4: largest bucket within what is pending
    sched.add(make_seq(60, "next", rng))  # "long" now decodes: the stall-free budget holds
    assert sum(n for _, n in sched.schedule()) == 16
    pm.check(all_seqs(sched))

    pm = PageManager(num_pages=128, page_size=4)
    sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8, stall_free_budget=16,
                      token_buckets=(8, 16, 32, 64))  # fmt: skip
    sched.add(make_seq(100, "a", rng))
    sched.add(_score_seq(40, "score"))  # a score request anywhere: its rows stay within 16
    assert sum(n for _, n in sched.schedule()) == 16

    control = Scheduler(PageManager(num_pages=128, page_size=4), max_num_batched_tokens=16,
                        max_num_seqs=8, token_buckets=(8, 16))  # fmt: skip
    control.add(make_seq(100, "c", rng))
    assert sum(n for _, n in control.schedule()) == 16  # no stall-free budget below the cap


def test_prefill_first_steps_take_the_whole_budget_while_decodes_wait():
    """prefill_first: a step that admits a waiting sequence holds prefills only, so it takes up to
    max_num_batched_tokens even while others decode; stall_free holds such a step to the
    stall-free budget (the control)."""
    sizes = {}
    for policy in ("prefill_first", "stall_free"):
        pm = PageManager(num_pages=128, page_size=4)
        sched = Scheduler(pm, max_num_batched_tokens=64, max_num_seqs=8, policy=policy,
                          stall_free_budget=16, token_buckets=(8, 16, 32, 64))  # fmt: skip
        rng = random.Random(3)
        sched.add(make_seq(5, "d", rng))
        fake_step(sched, sched.schedule(), rng, max_out=100)  # "d" now decodes
        sched.add(make_seq(100, "long", rng))
        sizes[policy] = sum(n for _, n in sched.schedule())
        pm.check(all_seqs(sched))
    assert sizes == {"prefill_first": 64, "stall_free": 16}
