"""Bitwise invariance of the serving engine (README.md) on a tiny random Qwen3.

Two probe requests (greedy, and seeded top-k/top-p sampling), each with log-probs and top-3
log-probs, are run alone to get reference bits; then among 1/8/32 other requests, under token
budgets 16/64/512, with a page pool so small that sequences are preempted and recomputed, and
behind a prefix-cache hit. In `invariance="tp"` every comparison must be `np.array_equal`.

Negative control: the same comparisons in `"none"`, which must report a difference. These engines
pad every step to one shape, where XLA's own CPU ops happen to give equal bits whatever the batch,
so on a CPU "none" runs with the `batch_dependent_none` hook (attention whose order of scaling
follows the step's real token count: an order that provably depends on the batch); on a GPU
plain XLA differs.
The TP control runs "batch" mode (sequential-K partials + psum), which is not TP invariant.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from serving.engine.engine import Engine
from serving.engine.llm_backend import score
from serving.engine.page_manager import PageManager

# One xdist worker for the whole module: its tests share the reference runs and compiled steps
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("engine_invariance")

MODES = ["tp", "none"]
PAGE = 8
MAX_LEN = 128
MAX_SEQS = 34  # 32 others + 2 probes
NUM_PAGES = 64


def make_engine(model, mode: str, budget: int = 64, **kw) -> Engine:
    """Every engine here pads to one shape per budget, so each compiles once per process."""
    return Engine(
        model,
        invariance=mode,
        max_num_batched_tokens=budget,
        max_num_seqs=MAX_SEQS,
        max_model_len=MAX_LEN,
        page_size=PAGE,
        num_pages=kw.pop("num_pages", NUM_PAGES),
        min_tokens_bucket=budget,
        min_seqs_bucket=MAX_SEQS,
        min_pages_bucket=MAX_LEN // PAGE,
        **kw,
    )


_rng = random.Random(20261122)
PROBES = {
    "greedy": (
        [_rng.randrange(1, 320) for _ in range(27)],
        dict(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True),
    ),
    "sampled": (
        [_rng.randrange(1, 320) for _ in range(19)],
        dict(
            temperature=0.9,
            top_k=40,
            top_p=0.9,
            seed=1234,
            max_tokens=12,
            logprobs=3,
            ignore_eos=True,
        ),
    ),
}


def others(k: int, seed: int, long: bool = False) -> list[tuple[str, list[int], dict]]:
    rng = random.Random(seed)
    out = []
    for i in range(k):
        n = rng.randrange(40, 70) if long else rng.randrange(1, 14)
        params = dict(
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.8]),
            seed=rng.randrange(2**32),
            max_tokens=rng.randrange(8, 16) if long else rng.randrange(1, 9),
            logprobs=rng.choice([None, 2]),
            ignore_eos=long,  # fixed lengths: the same scheduling in every mode
        )
        out.append((f"other{i}", [rng.randrange(1, 320) for _ in range(n)], params))
    return out


def run(engine: Engine, reqs: list[tuple[str, list[int], dict]]) -> dict:
    for rid, ids, params in reqs:
        engine.add_request(rid, ids, params)
    outs = {o.request_id: o for o in engine.run()}
    engine.page_manager.check([])  # every page came back
    assert engine.page_manager.num_used == 0
    return outs


def bits(out) -> list:
    return [
        (np.asarray(c.token_ids), np.asarray(c.logprobs, np.float32), c.top_logprobs)
        for c in out.outputs
    ]


def probe_bits_equal(ref: dict, got: dict) -> bool:
    for name in PROBES:
        for (t1, l1, k1), (t2, l2, k2) in zip(bits(ref[name]), bits(got[name]), strict=True):
            if not (np.array_equal(t1, t2) and np.array_equal(l1, l2) and k1 == k2):
                return False
    return True


@pytest.fixture(autouse=True)
def _none_is_batch_dependent(request):
    """Negative controls in "none" mode run the batch-dependent variant (see conftest)."""
    callspec = getattr(request.node, "callspec", None)
    if callspec is not None and callspec.params.get("mode") == "none":
        request.getfixturevalue("batch_dependent_none")


def expect_same(mode: str, ref: dict, got: dict, what: str) -> None:
    equal = probe_bits_equal(ref, got)
    if mode == "tp":
        assert equal, f"probe bits changed {what}"
    else:
        assert not equal, f"negative control ({mode}): the probe bits did not change {what}"


_REF: dict[str, dict] = {}


def reference(model, mode: str) -> dict:
    """Each probe alone in a fresh engine without prefix caching."""
    if mode not in _REF:
        eng = make_engine(model, mode, enable_prefix_caching=False)
        _REF[mode] = {}
        for name, (ids, params) in PROBES.items():
            _REF[mode].update(run(eng, [(name, ids, params)]))
    return _REF[mode]


def with_probes(reqs: list, at: int) -> list:
    probes = [(name, ids, params) for name, (ids, params) in PROBES.items()]
    return reqs[:at] + probes + reqs[at:]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("k", [1, 8, 32])
def test_request_bits_do_not_depend_on_other_requests(serving_model, mode, k):
    ref = reference(serving_model, mode)
    got = run(make_engine(serving_model, mode), with_probes(others(k, seed=k), at=k // 2))
    expect_same(mode, ref, got, f"among {k} other requests")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [16, 512])
def test_request_bits_do_not_depend_on_token_budget(serving_model, mode, budget):
    ref = reference(serving_model, mode)  # budget 64
    got = run(make_engine(serving_model, mode, budget), with_probes(others(8, seed=budget), 3))
    expect_same(mode, ref, got, f"under a {budget}-token budget")


@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_recompute_do_not_change_bits(serving_model, mode):
    ref = reference(serving_model, mode)
    eng = make_engine(serving_model, mode)
    # the same compiled shapes, but the page manager may hand out only 20 of the 64 pages
    eng.page_manager = eng.scheduler.pm = PageManager(20, PAGE)
    got = run(eng, with_probes(others(4, seed=9, long=True), at=3))
    assert eng.scheduler.num_preemptions > 0
    assert all(got[p].num_preemptions > 0 for p in PROBES), "the probes should be preempted"
    expect_same(mode, ref, got, "after preemption and recompute")


@pytest.mark.parametrize("mode", MODES)
def test_prefix_cache_hit_gives_the_cold_bits(serving_model, mode):
    ref = reference(serving_model, mode)
    eng = make_engine(serving_model, mode)
    warm = [
        (f"warm-{n}", ids[:24] + [5, 6, 7], dict(max_tokens=2)) for n, (ids, _) in PROBES.items()
    ]
    run(eng, warm)
    got = run(eng, with_probes([], 0))
    assert got["greedy"].num_cached_tokens == 24 and got["sampled"].num_cached_tokens == 16
    expect_same(mode, ref, got, "with a prefix-cache hit")


def test_seeded_sampling_is_reproducible_and_seeds_differ(serving_model):
    eng = make_engine(serving_model, "tp")
    ids, params = PROBES["sampled"]
    first = run(
        eng,
        [
            ("a", ids, params),
            ("c", ids, {**params, "seed": 4321}),
            ("n", ids, {**params, "n": 4}),
            ("d", ids, {**params, "seed": None}),
        ],
    )
    a, c, many, d = (first[k] for k in "acnd")
    second = run(eng, [("b", ids, params), ("e", ids, {**params, "seed": d.seed})])
    b, e = second["b"], second["e"]
    assert np.array_equal(a.outputs[0].token_ids, b.outputs[0].token_ids)
    assert np.array_equal(a.outputs[0].logprobs, b.outputs[0].logprobs)
    assert a.outputs[0].token_ids != c.outputs[0].token_ids
    # sample 0 of n=4 is the n=1 request; the four samples have distinct seeds and outputs
    assert many.outputs[0].token_ids == a.outputs[0].token_ids
    assert len({o.seed for o in many.outputs}) == 4
    assert len({tuple(o.token_ids) for o in many.outputs}) == 4
    # no seed: one is drawn, recorded, and reproduces the output
    assert d.outputs[0].token_ids == e.outputs[0].token_ids


@pytest.mark.parametrize("mode", MODES)
def test_score_returns_the_sampler_logprobs(serving_model, mode):
    ref = reference(serving_model, mode)
    eng = make_engine(serving_model, mode)
    seqs, want = [], []
    for name, (ids, _) in PROBES.items():
        c = ref[name].outputs[0]
        seqs.append(ids + c.token_ids)
        want.append(np.asarray(c.logprobs, np.float32))
    got = score(eng, seqs)
    equal = all(np.array_equal(g[-len(w) :], w) for g, w in zip(got, want, strict=True))
    assert all(g.shape == (len(s) - 1,) for g, s in zip(got, seqs, strict=True))
    if mode == "tp":
        assert equal, "score() differs from the sampler's log-probs"
    else:
        assert not equal, "negative control: variant scoring matched the sampler's log-probs"


@pytest.mark.parametrize("mode", ["tp", pytest.param("batch", id="batch-control")])
def test_request_bits_do_not_depend_on_tp_size(mode):
    """The engine on the TP runtime (sharding/tp.py): TP=1 (same padded layout) vs TP=2, among
    other requests. Uses the sharding tests' tiny model, whose column shards stay >= 128 wide."""
    from jdet.loader import Model
    from tests.sharding.tiny import tiny_cfg, tiny_params

    cfg = tiny_cfg(vocab_size=320)
    model = Model(cfg=cfg, params=tiny_params(cfg), tokenizer=None)
    reqs = with_probes(others(6, seed=5), at=2)
    one = run(make_engine(model, mode, tp=1, sharded=True), reqs)
    two = run(make_engine(model, mode, tp=2), reqs)
    expect_same(mode, one, two, "between TP=1 and TP=2")
