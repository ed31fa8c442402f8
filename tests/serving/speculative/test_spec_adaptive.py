"""Adaptive K (serving/speculative/adaptive.py): a request whose drafts keep being rejected decodes
without drafts, and steps where no request drafts are dispatched ahead (async scheduling).
Neither may change a bit in exact mode: each run is compared with the plain synchronous engine
with np.array_equal (tokens, log-probs, top log-probs, text, finish reasons), and each checks
that the paths it is about were taken (verifies AND dispatched-ahead steps in one run).
Negative control: ahead steps fed the wrong rows' tokens inside a speculative engine differ.
"""

from __future__ import annotations

import numpy as np
import pytest

from jdet import compile_cache
from jdet.spec_config import SpeculativeConfig
from serving.sampling_options import SamplingOptions
from serving.sequence import Sequence
from serving.speculative.adaptive import WARMUP, AdaptiveK
from tests.serving.speculative.test_speculative import (
    PARAMS,
    PROMPTS,
    assert_same,
    make_engine,
    random_draft,  # noqa: F401 - a fixture: a random draft model (mostly rejected drafts)
    run,
)


def requests() -> list[tuple[str, list[int], dict]]:
    """A copy-heavy request (drafts accepted) beside random ones (drafts rejected), greedy and
    seeded, n = 2 and EOS included."""
    return [
        ("copy/greedy", PROMPTS["copy"], PARAMS["greedy"]),
        ("random/greedy", PROMPTS["random"], PARAMS["greedy"]),
        ("random/sampled", PROMPTS["random"], PARAMS["sampled"]),
        ("copy2/sampled_n2", PROMPTS["copy2"], PARAMS["sampled_n2"]),
        ("random/eos", PROMPTS["random"], PARAMS["eos"]),
    ]


@pytest.fixture(scope="module")
def plain(serving_model) -> dict:
    return run(make_engine(serving_model), requests())


def random_only() -> list[tuple[str, list[int], dict]]:
    return [r for r in requests() if r[0].startswith("random")]


@pytest.mark.parametrize("method", ["ngram", "self", "draft"])
def test_adaptive_k_with_async_dispatch_keeps_the_bits(serving_model, plain, method, request):
    """Batched: the copy request drafts (verifies), the random ones fall back (K = 0); once only
    fallen-back requests run, their steps go ahead of the host. Same bits as plain decoding.
    Model drafts: the target's first layer, or a random model (its cache mirrors ahead steps)."""
    spec = SpeculativeConfig(min_alpha=0.5, probe_every=4)
    if method == "self":
        spec = SpeculativeConfig(method="self", draft_layers=1, min_alpha=0.5, probe_every=4)
    elif method == "draft":
        dm = request.getfixturevalue("random_draft")
        spec = SpeculativeConfig(method="draft", draft_model=dm, min_alpha=0.5, probe_every=4)
    eng = make_engine(serving_model, spec, async_scheduling="on")
    eng.warmup()
    before = compile_cache.stats()
    got = run(eng, requests())
    assert compile_cache.stats().compiles == before.compiles  # ahead steps, mirrors included
    assert_same(got, plain)
    st = eng.speculator.stats()
    assert st["verifies"] > 0 and st["accepted_tokens"] > 0, st
    assert eng.speculator.adaptive.num_fallback_steps > 0
    assert eng.num_steps_ahead > 0  # speculation no longer turns async dispatch off

    if method != "ngram":
        return
    # random prompts alone: after the warm-up drafts, (nearly) every step goes ahead
    eng = make_engine(serving_model, spec, async_scheduling="on")
    got = run(eng, random_only())
    assert_same(got, {k: plain[k] for k in got})
    assert eng.num_steps_ahead > 10, eng.num_steps_ahead


def test_adaptive_k_off_never_goes_ahead_and_drafts_more(serving_model, plain):
    """min_alpha=0 is the previous engine: every decode drafts, nothing is dispatched ahead."""
    off = make_engine(serving_model, SpeculativeConfig(min_alpha=0.0), async_scheduling="on")
    on = make_engine(serving_model, SpeculativeConfig(), async_scheduling="on")
    assert_same(run(off, requests()), plain)
    assert_same(run(on, requests()), plain)
    assert off.speculator.adaptive is None and off.num_steps_ahead == 0
    assert on.speculator.stats()["draft_tokens"] < off.speculator.stats()["draft_tokens"]


def test_rejection_mode_goes_ahead_too_and_greedy_keeps_the_bits(serving_model, plain):
    """Rejection mode's step takes the ahead steps (no draft rows); greedy rows keep the plain
    bits there (p one-hot: the rule accepts exactly the argmax)."""
    reqs = [r for r in requests() if r[0].endswith("/greedy")]
    spec = SpeculativeConfig(method="self", draft_layers=1, verify="rejection", probe_every=4)
    eng = make_engine(serving_model, spec, async_scheduling="on")
    got = run(eng, reqs)
    assert_same(got, {k: plain[k] for k in got})
    assert eng.num_steps_ahead > 0 and eng.speculator.stats()["verifies"] > 0


def _rejection_async_vs_sync(
    model, lag: int | None = None, draft_model=None
) -> tuple[dict, dict, list]:
    """The sampled requests (greedy rows keep plain bits anyway) in rejection mode with the
    self draft (or `draft_model`), falling back and probing (probe_every=4), on an async engine
    and a synchronous one; `lag` replaces the policy's (the control)."""
    reqs = [r for r in requests() if not r[0].endswith("/greedy")]
    spec = SpeculativeConfig(method="self", draft_layers=1, verify="rejection", min_alpha=0.5,
                             probe_every=4)  # fmt: skip
    if draft_model is not None:
        spec = SpeculativeConfig(method="draft", draft_model=draft_model, verify="rejection",
                                 min_alpha=0.5, probe_every=4)  # fmt: skip
    got, engines = [], []
    for mode in ("on", "off"):
        eng = make_engine(model, spec, async_scheduling=mode)
        if lag is not None:
            eng.speculator.adaptive.lag = lag
        got.append(run(eng, reqs))
        engines.append(eng)
    return got[0], got[1], engines


@pytest.mark.parametrize("method", ["self", "draft"])
def test_rejection_bits_do_not_depend_on_async_scheduling(serving_model, method, request):
    """Rejection mode: which positions are rejection-sampled is part of the bits, and adaptive
    K decides it; its decisions look at the tokens before the step's input token only, which a
    dispatched-ahead step and a synchronous one both know (serving/speculative/adaptive.py). So the
    same requests give the same bits with async scheduling on and off; checked that the async
    run went ahead, fell back and verified. Drafts: the self draft, a random draft model."""
    dm = request.getfixturevalue("random_draft") if method == "draft" else None
    on, off, (a, s) = _rejection_async_vs_sync(serving_model, draft_model=dm)
    assert a.num_steps_ahead > 0 and s.num_steps_ahead == 0
    assert a.speculator.adaptive.num_fallback_steps > 0
    assert a.speculator.stats()["verifies"] > 0 and a.speculator.stats()["accepted_tokens"] > 0
    assert_same(on, off)


def test_negative_control_rejection_policy_seeing_the_latest_token_depends_on_async(
    serving_model,
):
    """The same comparison with the policy looking at every token (lag 0, the policy before
    session 7): a synchronous step sees one token more than an ahead step had, so the two runs
    rejection-sample other positions and some request's tokens differ."""
    on, off, _ = _rejection_async_vs_sync(serving_model, lag=0)
    assert any(
        not np.array_equal(x.token_ids, y.token_ids)
        for r in on
        for x, y in zip(on[r].outputs, off[r].outputs, strict=True)
    )


def test_adaptive_k_under_preemption_and_prefix_cache(serving_model, plain):
    """Few pages (preemption) and the prefix cache on, async on: still the plain bits."""
    eng = make_engine(serving_model, SpeculativeConfig(), async_scheduling="on", num_pages=20)
    got = run(eng, requests())
    assert_same(got, plain)
    assert eng.scheduler.num_preemptions > 0
    eng2 = make_engine(serving_model, SpeculativeConfig(), async_scheduling="on")
    run(eng2, requests()[:1])
    got = run(eng2, requests())  # the copy prompt's pages are cached now
    assert_same(got, plain)


def test_negative_control_wrong_ahead_tokens_in_a_spec_engine_differ(
    serving_model, plain, monkeypatch
):
    """The comparison sees a wrong ahead step inside a speculative engine: feed each ahead step
    the wrong rows' tokens."""
    import jax.numpy as jnp

    bad = make_engine(serving_model, SpeculativeConfig(), async_scheduling="on")
    real = bad.runner.prepare_ahead
    monkeypatch.setattr(bad.runner, "prepare_ahead", lambda p, t: real(p, jnp.roll(t, 1)))
    got = run(bad, requests())
    assert bad.num_steps_ahead > 0
    assert any(
        not np.array_equal(got[r].outputs[0].token_ids, plain[r].outputs[0].token_ids)
        for r in plain
    )


def _seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, list(tokens), SamplingOptions(), seed=1, arrival_time=0.0)


def test_policy_falls_back_and_recovers_on_host_measure():
    """n-gram: rejected verifies -> fallen back; tokens the lookup would have proposed (measured
    on the host) -> drafting again. Model drafts: a probe after probe_every tokens."""
    hits = {"on": False}

    def lookup(seq, i):
        return seq.token_ids[i - 1] if hits["on"] else None  # 'repeat the last token' when on

    a = AdaptiveK(0.5, 3, lookup)
    s = _seq([5, 6, 7])
    assert a.drafts(s)  # no evidence yet
    for _ in range(WARMUP):
        a.record_verify(s, 0, 1)
    assert not a.drafts(s) and a.fallen_back(s)
    s.token_ids += [8, 9]  # the lookup (off) proposed neither
    a.observe([s])
    assert a.fallen_back(s)
    hits["on"] = True
    s.token_ids += [9, 9, 9, 9]  # each is the previous token: the lookup would have hit
    a.observe([s])
    assert not a.fallen_back(s) and a.drafts(s)
    assert a.num_shadow_checks >= 3

    m = AdaptiveK(0.5, 3, None)  # a model draft: probe after 3 tokens without drafts
    s = _seq([1, 2])
    for _ in range(WARMUP):
        m.record_verify(s, 0, 1)
    assert not m.drafts(s)
    s.token_ids += [3, 4]
    assert not m.drafts(s)
    s.token_ids += [5]
    assert m.drafts(s)  # the probe
    m.record_verify(s, 0, 1)  # rejected again: back to decoding without drafts
    assert not m.drafts(s)


def test_a_lookup_that_finds_nothing_is_not_a_miss_and_dry_steps_go_ahead():
    """An n-gram lookup that proposes nothing leaves the acceptance estimate alone (a copying
    request must not fall back between copies), and after DRY such lookups in a row the
    sequence's steps may go ahead; one whose lookup finds a draft may not. Control: the same
    calls on a sequence whose lookup proposes a draft give the opposite answer."""
    from serving.speculative.adaptive import DRY
    from serving.speculative.speculator import Speculator

    spec = Speculator(SpeculativeConfig(), max_model_len=4096)
    dry = _seq(list(range(1, 30)))  # no token repeats: the lookup finds nothing
    dry.num_computed_tokens = len(dry.token_ids) - 1  # decoding: one uncomputed token
    wet = _seq([7, 8, 9] * 10)  # the lookup proposes the pattern's continuation
    wet.num_computed_tokens = len(wet.token_ids) - 1
    for s in (dry, wet):
        s.status = type(s.status).RUNNING
    for _ in range(2 * WARMUP):
        spec.propose([dry, wet])
        assert dry.draft_token_ids == [] and wet.draft_token_ids[:1] == [7]
    st = spec.adaptive.state[dry]
    assert st.num_reached == 0 and st.alpha == 1.0 and not spec.adaptive.fallen_back(dry)
    assert st.dry >= DRY
    assert spec.can_run_ahead([(dry, 1)])
    assert not spec.can_run_ahead([(wet, 1)]) and not spec.can_run_ahead([(dry, 1), (wet, 1)])
    assert not spec.can_run_ahead([(dry, 2)])  # a verify's successor: never ahead
    fresh = Speculator(SpeculativeConfig(), max_model_len=4096)
    fresh.propose([dry])
    assert not fresh.can_run_ahead([(dry, 1)])  # one dry lookup is not yet a streak
    always = Speculator(SpeculativeConfig(min_alpha=0.0), max_model_len=4096)
    assert not always.can_run_ahead([(dry, 1)])  # min_alpha=0: the previous engine
    rej = Speculator(SpeculativeConfig(verify="rejection"), max_model_len=4096)
    dry.token_ids.append(30)  # rejection mode drafts from the first output token on
    dry.num_computed_tokens += 1
    for _ in range(2 * DRY):
        rej.propose([dry])
    assert rej.adaptive.dry(dry) and not rej.can_run_ahead([(dry, 1)])  # rejection: bits


def test_rejection_fingerprint_holds_the_adaptive_policy_revision(serving_model, monkeypatch):
    """In rejection mode the adaptive policy decides which positions are rejection-sampled:
    another policy revision is another fingerprint; exact mode's stays plain decoding's."""
    from jdet import fingerprint as fp
    from jdet.plan import Plan

    plan = Plan(serving_model.cfg, "tp", 1)
    rej, exact = SpeculativeConfig(verify="rejection"), SpeculativeConfig()
    before = fp.fingerprint(serving_model, plan, page_size=8, speculative=rej)
    plain = fp.fingerprint(serving_model, plan, page_size=8)
    monkeypatch.setattr(fp, "ADAPTIVE_POLICY", fp.ADAPTIVE_POLICY + 1)
    assert fp.fingerprint(serving_model, plan, page_size=8, speculative=rej) != before
    assert fp.fingerprint(serving_model, plan, page_size=8, speculative=exact) == plain


def test_dry_requests_go_ahead_without_falling_back_and_keep_the_bits(serving_model, plain):
    """Random prompts with 4-gram lookups (ngram_min=4: next to nothing matches): their steps
    go ahead because the lookups run dry, not because the estimate fell; same bits as plain
    synchronous decoding (the module's negative control shows a wrong ahead step is seen)."""
    spec = SpeculativeConfig(ngram_min=4)
    eng = make_engine(serving_model, spec, async_scheduling="on")
    got = run(eng, random_only())
    assert_same(got, {k: plain[k] for k in got})
    assert eng.num_steps_ahead > 10, eng.num_steps_ahead
    assert eng.speculator.adaptive.num_fallback_steps == 0


@pytest.mark.parametrize(
    "kw, match",
    [(dict(min_alpha=1.5), "min_alpha"), (dict(min_alpha="x"), "min_alpha"),
     (dict(probe_every=0), "probe_every")],  # fmt: skip
)
def test_adaptive_settings_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kw)


def _ngram_reference(tokens: list[int], k: int, n_min: int, n_max: int, latest: bool = True):
    """The sliding-window prompt lookup ngram_draft replaced (and, latest=False, a wrong one
    that takes the earliest match: the control)."""
    L = len(tokens)
    if k < 1 or L < 2:
        return []
    arr = np.asarray(tokens, np.int64)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        win = np.lib.stride_tricks.sliding_window_view(arr[: L - 1], n)
        hits = np.flatnonzero((win == arr[L - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1 if latest else 0]) + n
            return arr[start : start + k].tolist()
    return []


def test_fast_ngram_lookup_equals_the_sliding_window_one():
    """ngram_draft (one pass, run for every drafting sequence every step) gives the drafts of
    the sliding-window search over 5000 random and repetitive contexts; the earliest-match
    variant differs on the same inputs (the inputs can tell lookups apart)."""
    import random

    from serving.speculative.speculator import ngram_draft

    r = random.Random(5)
    cases = []
    for _ in range(5000):
        L = r.randrange(0, 60)
        toks = [r.randrange(r.choice([2, 3, 5, 20, 300])) for _ in range(L)]
        if r.random() < 0.3 and L > 5:
            toks = (toks[: r.randrange(1, 6)] * 30)[:L]
        n_min = r.randrange(1, 5)
        cases.append((toks, r.randrange(0, 6), n_min, r.randrange(n_min, 8)))
    for c in cases:
        assert ngram_draft(*c) == _ngram_reference(*c), c
        assert ngram_draft(np.asarray(c[0], np.int64), *c[1:]) == _ngram_reference(*c), c
    assert sum(_ngram_reference(*c, latest=False) != ngram_draft(*c) for c in cases) > 100


def _follow(tokens_of) -> int | None:
    """Append, drop and replace tokens of a sequence for 300 steps; the first step at which
    `tokens_of(seq)` differs from its token_ids (None: never)."""
    s = _seq([3, 1, 4, 1, 5])
    rng = np.random.default_rng(0)
    for step in range(300):
        if step % 37 == 1:
            s.token_ids.pop()  # a token the array already holds dropped (a stop string's)
        if step % 41 == 2:
            s.token_ids[-1] = (s.token_ids[-1] + 1) % 7  # and one it holds replaced
        s.token_ids += rng.integers(0, 7, rng.integers(0, 6)).tolist()
        if not np.array_equal(tokens_of(s), np.asarray(s.token_ids)):
            return step
    return None


def test_the_speculators_token_arrays_follow_the_sequence():
    """The n-gram lookup reads a per-sequence array extended step by step (Speculator._tokens);
    it must equal token_ids after appends, growth past its capacity, a dropped and a replaced
    token. A stale array would change no bit (exact mode), only the drafts, so it is checked
    here. Control: an append-only array (no check that its tokens are still the sequence's)
    fails the same loop."""
    from serving.speculative.speculator import Speculator

    spec = Speculator(SpeculativeConfig(), max_model_len=4096)
    assert _follow(spec._tokens) is None
    held: dict = {}

    def append_only(seq):
        a = held.get(seq, np.zeros(0, np.int64))
        held[seq] = a = np.concatenate([a, np.asarray(seq.token_ids[len(a) :], np.int64)])
        return a

    assert _follow(append_only) is not None


def test_cli_flag(capsys):
    """--speculative-min-alpha reaches the config; without --speculative-method it is refused,
    out of range it is refused by name."""
    import argparse

    from jdet.cli import main
    from jdet.spec_config import add_flags, from_args

    p = argparse.ArgumentParser()
    add_flags(p)
    assert from_args(p.parse_args(["--speculative-method", "ngram"])).min_alpha == 0.3
    on = ["--speculative-method", "ngram", "--speculative-min-alpha", "0"]
    assert from_args(p.parse_args(on)).min_alpha == 0.0
    base = ["generate", "Return a list of", "--max-tokens", "4", "--invariance", "none"]
    assert main([*base, "--speculative-min-alpha", "0.5"]) == 2
    assert "needs --speculative-method" in capsys.readouterr().err
    assert main([*base, "--speculative-method", "ngram", "--speculative-min-alpha", "2"]) == 2
    assert "min_alpha must be a number in [0, 1]" in capsys.readouterr().err
