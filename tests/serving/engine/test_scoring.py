"""Score requests scheduled by the one scheduler (serving/engine/scoring.py) on a tiny random Qwen3.

A score request's log-probs must be bitwise those of the same request scored alone, and the
sampling requests beside it bitwise theirs, whether the two kinds share engine steps, the score
request is preempted and recomputed, or it re-reads its rows' K/V from the prefix cache; every
page comes back. Negative controls: "none" made batch dependent (tests/conftest.py
`batch_dependent_none`) must differ when the kinds share steps, and a score request allowed to
read cached pages it has not scored must lose log-probs.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.engine.engine import Engine
from serving.engine.scheduler import Scheduler
from serving.sampling_options import InvalidRequest

PAGE = 8
MAX_LEN = 72
BUDGET = 16

_rng = random.Random(20261123)
GEN_PROMPT = [_rng.randrange(1, 320) for _ in range(20)]
GEN = dict(temperature=0.0, max_tokens=10, logprobs=2, ignore_eos=True)
GEN2 = dict(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True)
SCORE = [_rng.randrange(1, 320) for _ in range(45)]
LONG_SCORE = [_rng.randrange(1, 320) for _ in range(MAX_LEN)]
_rng5 = random.Random(5)
PROMPTS_56 = [[_rng5.randrange(1, 320) for _ in range(56)] for _ in range(2)]


def make_engine(model, mode: str = "tp", num_pages: int = 24, **kw) -> Engine:
    """One shape per kind (step and score), so each mode compiles each once per process."""
    return Engine(
        model, invariance=mode, max_num_batched_tokens=BUDGET, max_num_seqs=4,
        max_model_len=MAX_LEN, page_size=PAGE, num_pages=num_pages, min_tokens_bucket=BUDGET,
        min_seqs_bucket=4, min_pages_bucket=MAX_LEN // PAGE, **kw,
    )  # fmt: skip


def run(eng: Engine, gens: dict, scores: dict) -> dict:
    """Add the requests (sampling ones first), step to the end, check every page came back."""
    for rid, (ids, params) in gens.items():
        eng.add_request(rid, ids, params)
    for rid, ids in scores.items():
        eng.add_score(rid, ids)
    outs = {o.request_id: o for o in eng.run()}
    eng.page_manager.check([])
    assert eng.page_manager.num_used == 0 and not eng.requests
    return outs


def gen_bits(o) -> tuple:
    c = o.outputs[0]
    return list(c.token_ids), np.asarray(c.logprobs, np.float32), c.top_logprobs


def same_gen(a, b) -> bool:
    (t1, l1, k1), (t2, l2, k2) = gen_bits(a), gen_bits(b)
    return t1 == t2 and np.array_equal(l1, l2) and k1 == k2


def same_score(a, b) -> bool:
    return np.array_equal(np.asarray(a.scores, np.float32), np.asarray(b.scores, np.float32))


@pytest.mark.parametrize("mode", ["tp", pytest.param("none", id="none-control")])
def test_score_and_generate_in_the_same_steps(serving_model, mode, request):
    if mode == "none":
        request.getfixturevalue("batch_dependent_none")
    eng = make_engine(serving_model, mode)
    g_alone = run(eng, {"g": (GEN_PROMPT, GEN)}, {})["g"]
    s_alone = run(eng, {}, {"s": SCORE})["s"]
    before = eng.num_mixed_steps
    mixed = run(eng, {"g": (GEN_PROMPT, GEN), "g2": (GEN_PROMPT[:7], GEN2)}, {"s": SCORE})
    assert eng.num_mixed_steps - before >= 2, "the score request never shared a step"
    assert len(mixed["s"].scores) == len(SCORE) - 1 and mixed["s"].outputs[0].token_ids == []
    equal = same_gen(mixed["g"], g_alone) and same_score(mixed["s"], s_alone)
    if mode == "tp":
        assert equal, "sharing steps changed a score or a generated token's bits"
        # and a score is the sampler's log-probs of the same tokens
        out = mixed["g"].outputs[0]
        sc = run(eng, {}, {"t": GEN_PROMPT + out.token_ids})["t"].scores
        assert np.array_equal(np.asarray(sc[-len(out.logprobs) :], np.float32),
                              np.asarray(out.logprobs, np.float32))  # fmt: skip
    else:
        assert not equal, "negative control: batch-dependent 'none' matched when mixed"


def test_a_preempted_score_request_keeps_its_bits(serving_model):
    """Two sampling requests of 56 + 16 tokens and a max_model_len score request do not fit 24
    pages at once: the score request (the newest) is preempted, and recomputed reading the rows
    it had scored from the prefix cache; its bits do not change."""
    ref = run(make_engine(serving_model), {}, {"s": LONG_SCORE})["s"]
    eng = make_engine(serving_model)
    gens = {f"g{i}": (p, GEN2 | {"seed": i, "max_tokens": 16}) for i, p in enumerate(PROMPTS_56)}
    outs = run(eng, gens, {"s": LONG_SCORE})
    assert outs["s"].num_preemptions >= 1 and eng.scheduler.num_preemptions >= 1
    assert outs["s"].num_cached_tokens > 0 and eng.num_mixed_steps > 0
    assert same_score(outs["s"], ref)
    assert all(o.outputs[0].finish_reason == "length" for k, o in outs.items() if k != "s")


def _preempt_midway(eng: Engine, rid: str, ids: list[int], steps: int) -> None:
    eng.add_score(rid, ids)
    for _ in range(steps):
        eng.step()
    (seq,) = eng.requests[rid].seqs
    eng.scheduler._preempt(seq, {}, [0])  # as when a running sequence needs its pages


def test_a_score_request_reads_only_its_scored_rows_from_the_prefix_cache(serving_model):
    ref = run(make_engine(serving_model), {}, {"s": SCORE})["s"]
    eng = make_engine(serving_model)
    # preempted after 2 steps (32 rows scored, 4 full pages published): the recompute reads
    # those pages from the cache and computes only the rest
    _preempt_midway(eng, "s", SCORE, steps=2)
    out = {o.request_id: o for o in eng.run()}["s"]
    assert out.num_cached_tokens == 2 * BUDGET and out.num_preemptions == 1
    assert same_score(out, ref)
    # a second score request of the same tokens finds them cached but reads nothing: its rows'
    # log-probs need their logits
    again = run(eng, {}, {"s2": SCORE})["s2"]
    assert again.num_cached_tokens == 0 and same_score(again, ref)
    # a sampling request with that prefix hits the pages the score request published
    g_ref = run(make_engine(serving_model), {"g": (SCORE[:30], GEN)}, {})["g"]
    g = run(eng, {"g": (SCORE[:30], GEN)}, {})["g"]
    assert g.num_cached_tokens == 24 and same_gen(g, g_ref)


def test_control_a_score_reading_unscored_cached_rows_loses_them(serving_model, monkeypatch):
    """Negative control for the cap in Scheduler._admit_waiting: with it removed, a score
    request behind a cached prefix skips those rows and their log-probs are never computed."""
    ref = run(make_engine(serving_model), {}, {"s": SCORE})["s"]
    original = Scheduler._admit_waiting

    def uncapped(self, plan, budget):
        for seq in self.waiting:
            seq.num_scored = len(seq.token_ids) if seq.is_score else seq.num_scored
        return original(self, plan, budget)

    eng = make_engine(serving_model)
    run(eng, {}, {"s": SCORE})  # publishes SCORE's pages
    monkeypatch.setattr(Scheduler, "_admit_waiting", uncapped)
    got = run(eng, {}, {"s2": SCORE})["s2"]
    assert got.num_cached_tokens > 0 and not same_score(got, ref)


def test_aborting_a_score_request_frees_its_pages(serving_model):
    eng = make_engine(serving_model)
    eng.add_score("s", SCORE)
    eng.add_request("g", GEN_PROMPT, GEN)
    eng.step()
    assert eng.page_manager.num_used > 0
    assert eng.abort("s") and eng.abort("g")
    eng.page_manager.check([])
    assert eng.page_manager.num_used == 0 and not eng.has_unfinished()


@pytest.mark.parametrize(
    "ids, match",
    [([5], "at least 2 tokens"), ([5, 99999], "outside the vocabulary"),
     ([1] * (MAX_LEN + 1), "max_model_len"), ("12", "at least 2 tokens")],
)  # fmt: skip
def test_bad_score_requests_are_refused_by_name(serving_model, ids, match):
    eng = make_engine(serving_model)
    with pytest.raises(InvalidRequest, match=match) as e:
        eng.add_score("s", ids)
    assert e.value.field == "token_ids" and not eng.has_unfinished()
    eng.add_score("ok", SCORE[:3])
    with pytest.raises(InvalidRequest, match="already in use"):
        eng.add_score("ok", SCORE[:3])


def test_score_requests_beside_a_draft_model(serving_model):
    """With a separate draft model (speculative decoding, exact verify), score rows run beside
    the verifies and the draft's cache follows them (`ModelRunner.as_step`): no bit changes."""
    from jdet.spec_config import SpeculativeConfig

    plain = make_engine(serving_model)
    g_ref = run(plain, {"g": (GEN_PROMPT, GEN)}, {})["g"]
    s_ref = run(plain, {}, {"s": SCORE})["s"]
    spec = SpeculativeConfig(method="draft", num_tokens=2, verify="exact",
                             draft_model=serving_model)  # fmt: skip
    eng = make_engine(serving_model, speculative=spec)
    mirrored = []  # score batches handed to the draft model
    as_step = eng.runner.as_step
    eng.runner.as_step = lambda batch: (mirrored.append(batch), as_step(batch))[1]
    outs = run(eng, {"g": (GEN_PROMPT, GEN)}, {"s": SCORE, "s2": GEN_PROMPT + [7, 8]})
    assert eng.num_mixed_steps > 0 and len(mirrored) > 0
    assert same_gen(outs["g"], g_ref) and same_score(outs["s"], s_ref)
