"""Speculative decoding with verify="exact" changes no bit (serving/speculative/speculator.py).

Every test runs the same requests on a plain engine and on a speculative one and compares tokens,
log-probs, top log-probs, text and finish reasons with `np.array_equal`/`==`: greedy and seeded
temperature/top-k/top-p, n > 1, alone and batched, under preemption, behind a prefix-cache hit,
with EOS / stop tokens / max_tokens / stop strings that fall inside accepted runs. The prompts
repeat a pattern, so n-gram drafts are both accepted and rejected (checked: a test whose drafts
were never accepted would prove nothing). Negative control: a wrong acceptance rule (every draft
accepted) gives different tokens.

All engines share one step shape (T = S = 32, Pmax = 16 pages of 8), compiled once.
"""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

import jdet
from jdet.spec_config import SpeculativeConfig
from serving.engine.engine import Engine
from serving.speculative.speculator import Speculator, ngram_draft

# One xdist worker for the whole module: its tests share the reference outputs and compiled steps
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("speculative")

BUDGET = 32
PAGE = 8
MAX_LEN = 128


def make_engine(model, spec=None, **kw) -> Engine:
    return Engine(
        model,
        invariance="tp",
        max_num_batched_tokens=BUDGET,
        max_num_seqs=kw.pop("max_num_seqs", BUDGET),
        max_model_len=MAX_LEN,
        page_size=PAGE,
        num_pages=kw.pop("num_pages", 64),
        min_tokens_bucket=BUDGET,
        min_seqs_bucket=BUDGET,
        min_pages_bucket=MAX_LEN // PAGE,
        speculative=spec,
        **kw,
    )


_rng = random.Random(13)
PATTERN = [_rng.randrange(1, 320) for _ in range(10)]
PROMPTS = {
    "copy": PATTERN * 4,
    "copy2": [_rng.randrange(1, 320) for _ in range(5)] * 5,
    "random": [_rng.randrange(1, 320) for _ in range(21)],
}
PARAMS = {
    "greedy": dict(temperature=0.0, max_tokens=28, ignore_eos=True, logprobs=3),
    "sampled": dict(
        temperature=0.9, top_k=40, top_p=0.9, seed=7, max_tokens=28, ignore_eos=True, logprobs=3
    ),
    "sampled_n2": dict(temperature=1.0, top_p=0.8, seed=11, n=2, max_tokens=20, ignore_eos=True),
    "eos": dict(temperature=1.0, seed=3, max_tokens=40, logprobs=1),  # EOS (id 0) may end it
}


def run(engine: Engine, requests: list[tuple[str, list[int], dict]]) -> dict:
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    outs = {o.request_id: o for o in engine.run()}
    engine.page_manager.check([])  # every page back, rejected-draft pages included
    assert engine.page_manager.num_used == 0 or engine.page_manager.enable_prefix_caching
    return outs


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        for x, y in zip(a[rid].outputs, b[rid].outputs, strict=True):
            assert np.array_equal(x.token_ids, y.token_ids), rid
            assert np.array_equal(np.asarray(x.logprobs), np.asarray(y.logprobs)), rid
            assert x.top_logprobs == y.top_logprobs, rid
            assert (x.text, x.finish_reason, x.stop_reason) == (
                y.text,
                y.finish_reason,
                y.stop_reason,
            ), rid


def all_requests() -> list[tuple[str, list[int], dict]]:
    return [(f"{p}/{s}", PROMPTS[p], PARAMS[s]) for p in PROMPTS for s in PARAMS]


def spec_cfg(k: int = 4, method: str = "ngram", draft_model=None) -> SpeculativeConfig:
    return SpeculativeConfig(method=method, num_tokens=k, verify="exact", draft_model=draft_model)


METHODS = ["ngram", "self", "draft"]


def method_cfg(method: str, model, k: int = 4) -> SpeculativeConfig:
    """"self": the first of the 2 layers; "draft": the target's weights as a separate model
    (own KV cache, another runtime: its drafts agree with the target almost always, so long
    accepted runs, sampled rows included, are exercised)."""
    return spec_cfg(k, method, model if method == "draft" else None)


def check_drafts_mattered(engine: Engine) -> None:
    st = engine.speculator.stats()
    assert st["accepted_tokens"] > 0, st
    if engine.speculative.method != "draft":  # the target-copy draft may be right every time
        assert st["accepted_tokens"] < st["draft_tokens"], st  # and some were rejected


@pytest.fixture(scope="module")
def reference(serving_model) -> dict:
    """Each request alone on a plain engine."""
    out = {}
    for rid, prompt, params in all_requests():
        out.update(run(make_engine(serving_model), [(rid, prompt, params)]))
    return out


def test_exact_spec_equals_plain_alone(serving_model, reference):
    got = {}
    for i, req in enumerate(all_requests()):
        e = make_engine(serving_model, spec_cfg(1 + i % 4))  # K = 1..4
        got.update(run(e, [req]))
    assert_same(reference, got)


@pytest.mark.parametrize("method", METHODS)
def test_exact_spec_equals_plain_batched_and_under_preemption(serving_model, reference, method):
    e = make_engine(serving_model, method_cfg(method, serving_model))
    assert_same(reference, run(e, all_requests()))
    check_drafts_mattered(e)
    # a pool of 16 pages (one max_model_len sequence): sequences are preempted and recomputed
    e = make_engine(serving_model, method_cfg(method, serving_model), num_pages=16)
    assert_same(reference, run(e, all_requests()))
    assert e.scheduler.num_preemptions > 0
    check_drafts_mattered(e)


def test_a_random_draft_model_changes_no_bit(serving_model, serving_model_dir, reference, tmp_path):
    from tests.serving.conftest import write_tiny_model

    other = jdet.load(write_tiny_model(tmp_path / "draft", seed=1), dtype="float32")
    assert other.cfg.vocab_size == serving_model.cfg.vocab_size
    e = make_engine(serving_model, spec_cfg(3, "draft", other))
    assert_same(reference, run(e, all_requests()))
    assert e.speculator.stats()["draft_tokens"] > 0


@pytest.mark.parametrize("method", METHODS)
def test_exact_spec_equals_plain_behind_prefix_cache_hit(serving_model, reference, method):
    e = make_engine(serving_model, method_cfg(method, serving_model, 3))
    rid, prompt, params = all_requests()[0]
    run(e, [("warm", prompt, dict(temperature=0.0, max_tokens=2))])
    out = run(e, [(rid, prompt, params)])
    assert out[rid].num_cached_tokens > 0
    assert_same({rid: reference[rid]}, out)
    check_drafts_mattered(e)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_stops_inside_accepted_runs_finish_at_the_same_token(serving_model, method):
    """Stop tokens, max_tokens and stop strings at every position of a greedy output."""
    plain = make_engine(serving_model)
    prompt = PROMPTS["copy"]
    base = run(plain, [("b", prompt, dict(temperature=0.0, max_tokens=40, ignore_eos=True))])
    toks, text = base["b"].outputs[0].token_ids, base["b"].outputs[0].text
    reqs = []
    for j in range(0, 40, 3):
        stop_tok = dict(temperature=0, max_tokens=40, stop_token_ids=[toks[j]])
        reqs.append((f"tok{j}", prompt, stop_tok))
        reqs.append((f"len{j}", prompt, dict(temperature=0, max_tokens=j + 1, ignore_eos=True)))
    for j in range(1, len(text) - 2, max(1, len(text) // 12)):
        reqs.append((f"str{j}", prompt, dict(temperature=0, max_tokens=40, stop=[text[j : j + 2]])))
    a = run(make_engine(serving_model), reqs)
    e = make_engine(serving_model, method_cfg(method, serving_model))
    b = run(e, reqs)
    assert_same(a, b)
    check_drafts_mattered(e)
    assert any(o.outputs[0].finish_reason == "stop" for o in b.values())


def test_streaming_emits_every_accepted_token(serving_model, reference):
    e = make_engine(serving_model, spec_cfg(4))
    rid, prompt, params = all_requests()[0]
    e.add_request(rid, prompt, params)
    got, sizes = [], []
    while e.has_unfinished():
        for o in e.step():
            got += o.outputs[0].delta_token_ids
            sizes.append(len(o.outputs[0].delta_token_ids))
    assert got == reference[rid].outputs[0].token_ids
    assert max(sizes) > 1  # some step emitted several tokens


def test_negative_control_wrong_acceptance_rule_differs(serving_model, reference, monkeypatch):
    """Accepting every draft (as a broken verifier would) must change the tokens."""

    def accept_all(self, seq, drafts, tokens, ends):
        self.num_draft_tokens += len(drafts)
        return len(drafts) + 1

    monkeypatch.setattr(Speculator, "num_emitted", accept_all)
    e = make_engine(serving_model, spec_cfg(4))
    got = run(e, all_requests())
    assert any(
        not np.array_equal(reference[r].outputs[0].token_ids, got[r].outputs[0].token_ids)
        for r in reference
    )


def test_requests_with_logits_transforms_are_not_drafted(serving_model):
    e = make_engine(serving_model, spec_cfg(4))
    params = dict(temperature=0.0, max_tokens=20, ignore_eos=True, repetition_penalty=1.2)
    a = run(make_engine(serving_model), [("p", PROMPTS["copy"], params)])
    b = run(e, [("p", PROMPTS["copy"], params)])
    assert_same(a, b)
    assert e.speculator.stats()["draft_tokens"] == 0


def test_transform_rows_batched_behind_verify_rows_keep_their_inputs(serving_model):
    """A verify takes k + 1 sampled rows, so the rows after it move: a penalised / biased /
    masked request behind drafted ones must still get its own logits inputs."""
    reqs = [(f"{p}/{s}", PROMPTS[p], PARAMS[s]) for p in ("copy", "copy2") for s in ("greedy",)]
    reqs += [
        ("pen", PROMPTS["copy"], dict(temperature=0.0, max_tokens=20, ignore_eos=True,
                                      repetition_penalty=1.3, logit_bias={5: 3.0})),
        ("mask", PROMPTS["random"], dict(temperature=0.0, max_tokens=12, ignore_eos=True,
                                         allowed_token_ids=[5, 6, 7, 8])),
    ]  # fmt: skip
    e = make_engine(serving_model, spec_cfg(4))
    assert_same(run(make_engine(serving_model), reqs), run(e, reqs))
    check_drafts_mattered(e)


def test_ngram_draft_is_the_continuation_of_the_latest_match():
    assert ngram_draft([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert ngram_draft([5, 6, 7], 3, 1, 3) == []
    assert ngram_draft([4, 4], 3, 1, 2) == [4]
    assert ngram_draft([1, 2, 3, 4, 2, 3], 5, 2, 2) == [4, 2, 3]


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(method="medusa"), "method 'medusa' is unknown"),
        (dict(verify="typical"), "verify 'typical' is unknown"),
        (dict(num_tokens=0), "num_tokens"),
        (dict(num_tokens=True), "num_tokens"),
        (dict(method="draft"), "needs draft_model"),
        (dict(method="ngram", draft_model="x"), "only used by method='draft'"),
        (dict(method="ngram", draft_layers=1), "only used by method='self'"),
    ],
)
def test_config_refuses_bad_values_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**kw)


def test_config_from_dict_refuses_unknown_keys():
    assert SpeculativeConfig.from_any({"num_tokens": 2}).num_tokens == 2
    with pytest.raises(ValueError, match="num_tokenz"):
        SpeculativeConfig.from_any({"num_tokenz": 2})
    with pytest.raises(TypeError):
        SpeculativeConfig.from_any(4)


def test_llm_accepts_speculative(serving_model):
    kw = dict(
        max_num_batched_tokens=BUDGET, max_num_seqs=BUDGET, max_model_len=MAX_LEN, page_size=PAGE,
        num_pages=64, min_tokens_bucket=BUDGET, min_seqs_bucket=BUDGET,
        min_pages_bucket=MAX_LEN // PAGE, warmup=False,
    )  # fmt: skip
    sp = jdet.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    a = jdet.LLM(serving_model, **kw).generate(PROMPTS["copy"], sp)
    llm = jdet.LLM(serving_model, **kw, speculative={"method": "ngram", "num_tokens": 4})
    b = llm.generate(PROMPTS["copy"], sp)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert np.array_equal(a[0].outputs[0].logprobs, b[0].outputs[0].logprobs)
    assert llm.engine.speculator.stats()["accepted_tokens"] > 0


def test_metrics_report_acceptance(serving_model):
    e = make_engine(serving_model, spec_cfg(4))
    run(e, all_requests()[:2])
    text = e.metrics.render().decode()
    st = e.speculator.stats()
    assert f"jdet_spec_accepted_tokens_total {float(st['accepted_tokens'])}" in text
    assert f"jdet_spec_acceptance_rate {st['acceptance_rate']}" in text
    assert "jdet_spec_mean_accepted_length" in text
    assert f"jdet_spec_rejected_tokens_total {float(st['rejected_tokens'])}" in text
    assert "jdet_spec" not in make_engine(serving_model).metrics.render().decode()


def test_cli_flags(capsys):
    from jdet.cli import main

    base = ["generate", "Return a list of", "--max-tokens", "8", "--invariance", "none"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--speculative-method", "ngram", "--num-speculative-tokens", "3"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*base, "--speculative-method", "ngram", "--num-speculative-tokens", "0"]) == 2
    assert "num_tokens must be an integer in [1, 16]" in capsys.readouterr().err
    assert main([*base, "--speculative-draft-layers", "2"]) == 2
    assert "needs --speculative-method" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*base, "--speculative-method", "medusa"])


@pytest.mark.parametrize("method, verify", [("self", "exact"), ("draft", "exact"),
                                            ("self", "rejection")])  # fmt: skip
def test_after_warmup_model_drafts_compile_nothing(serving_model, method, verify):
    """Warm-up compiles the draft's passes (and a draft model's mirror step) for every shape,
    and in rejection mode the rejection step (the target's) and the draft's q-returning passes."""
    from jdet import compile_cache

    cfg = dataclasses.replace(method_cfg(method, serving_model), verify=verify)
    e = make_engine(serving_model, cfg)
    e.warmup("step")
    before = compile_cache.stats()
    run(e, all_requests())
    assert e.speculator.stats()["accepted_tokens"] > 0
    assert compile_cache.stats().compiles == before.compiles


# ---------------------------------------------------------------------- verify="rejection"
@pytest.mark.parametrize("method", METHODS)
def test_rejection_is_deterministic_and_greedy_keeps_the_bits(serving_model, reference, method):
    """Rejection mode: a fixed seed gives fixed bits (run twice); greedy rows equal plain
    decoding (p is one-hot: the rule accepts exactly the target's argmax)."""
    cfg = SpeculativeConfig(method=method, num_tokens=3, verify="rejection",
                            draft_model=serving_model if method == "draft" else None)  # fmt: skip
    a = run(make_engine(serving_model, cfg), all_requests())
    e = make_engine(serving_model, cfg)
    assert_same(a, run(e, all_requests()))
    assert e.speculator.stats()["accepted_tokens"] > 0
    for rid in a:
        if rid.endswith("/greedy"):
            assert_same({rid: reference[rid]}, {rid: a[rid]})


def _outcomes(engine: Engine, seed: int, n: int) -> list[tuple[int, ...]]:
    """n samples (seeds derived from `seed`) of 3 tokens after a 9-token prompt, top-k 3."""
    p = dict(temperature=1.0, top_k=3, seed=seed, n=n, max_tokens=3, ignore_eos=True)
    out = run(engine, [("r", PROMPTS["copy"][:9], p)])["r"]
    return [tuple(c.token_ids) for c in out.outputs]


def _chi2_same(a: list, b: list) -> float:
    """p-value of a two-sample chi-square test that `a` and `b` come from one distribution
    (outcomes seen fewer than 5 times in all are pooled into one cell)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    ca, cb = Counter(a), Counter(b)
    cells = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    big = [k for k in cells if ca[k] + cb[k] >= 5]
    rest = [k for k in cells if ca[k] + cb[k] < 5]
    table = [[ca[k] for k in big] + [sum(ca[k] for k in rest)],
             [cb[k] for k in big] + [sum(cb[k] for k in rest)]]  # fmt: skip
    table = [row[: len(big)] + ([row[-1]] if rest else []) for row in table]
    return float(chi2_contingency(np.asarray(table)).pvalue)


@pytest.fixture(scope="module")
def random_draft(serving_model, tmp_path_factory):
    from tests.serving.conftest import write_tiny_model

    d = write_tiny_model(tmp_path_factory.mktemp("draft"), seed=1)
    return jdet.load(d, dtype="float32")


N_SAMPLES = 600


def test_rejection_preserves_the_target_distribution(serving_model, random_draft):
    """Chi-square over many seeds (tiny vocabulary: top-3 of 320, 3 tokens, <= 27 outcomes):
    rejection sampling gives the target's distribution of outputs, against plain decoding on
    other seeds. Drafts: the self draft (its first layer: q near p, both accepts and residual
    draws) and a random draft model (q far from p: mostly residual draws)."""
    plain = _outcomes(make_engine(serving_model), 2, N_SAMPLES)
    for cfg in (
        SpeculativeConfig(method="self", num_tokens=2, verify="rejection"),
        SpeculativeConfig(method="draft", num_tokens=2, verify="rejection",
                          draft_model=random_draft),
    ):  # fmt: skip
        e = make_engine(serving_model, cfg)
        spec = _outcomes(e, 1, N_SAMPLES)
        st = e.speculator.stats()
        assert st["rejected_tokens"] > 50, st
        if cfg.method == "self":
            assert st["accepted_tokens"] > 50, st
        assert _chi2_same(spec, plain) > 0.01, (cfg.method, st)


def test_rejection_negative_control_accepting_every_draft_is_detected(serving_model, monkeypatch):
    """The same test with a broken rule (every draft accepted: the output follows the draft
    model) must fail: p < 0.01."""

    def accept_all(self, res, r0, drafts):
        for k in ("tokens", "logprobs"):
            res[k] = res[k].copy()
        for i, d in enumerate(drafts):
            res["tokens"][r0 + i] = d

    monkeypatch.setattr(Speculator, "rewrite", accept_all)
    cfg = SpeculativeConfig(method="self", num_tokens=2, verify="rejection")
    spec = _outcomes(make_engine(serving_model, cfg), 1, N_SAMPLES)
    plain = _outcomes(make_engine(serving_model), 2, N_SAMPLES)
    assert _chi2_same(spec, plain) < 0.01


def test_fingerprint_changes_only_where_the_bits_can(serving_model):
    kw = dict(
        max_num_batched_tokens=BUDGET, max_num_seqs=BUDGET, max_model_len=MAX_LEN, page_size=PAGE,
        num_pages=64, warmup=False,
    )  # fmt: skip
    plain = jdet.LLM(serving_model, **kw).fingerprint()
    exact = jdet.LLM(serving_model, **kw, speculative=spec_cfg(4)).fingerprint()
    rej = jdet.LLM(serving_model, **kw, speculative=dict(num_tokens=4, verify="rejection"))
    rej3 = jdet.LLM(serving_model, **kw, speculative=dict(num_tokens=3, verify="rejection"))
    assert exact == plain
    assert rej.fingerprint() != plain and rej3.fingerprint() != rej.fingerprint()
    from serving.http.launch import server_fingerprint  # the server's: the same rule

    assert server_fingerprint(serving_model, rej.engine) == rej.fingerprint()


def test_the_shipped_draft_loads_and_a_vocabulary_mismatch_is_named(serving_model):
    """draft_model="default" is the embedded model's trained draft (vocabulary 8192): on the
    320-token test model it is refused by name."""
    with pytest.raises(ValueError, match=r"vocabulary \(8192\) differs from the target's \(320\)"):
        make_engine(serving_model, spec_cfg(2, "draft", "default"))


def test_replay_draft_has_a_controlled_acceptance_and_keeps_the_bits(serving_model, reference):
    """tests/serving/speculative/replay_draft.py (spec_bench's draft for a chosen alpha on random
    weights): through the model-draft slot, alpha 1 gets every draft accepted, alpha 0 none, alpha
    0.6 some and not all; the bits are the plain ones each time. Rejection mode is refused."""
    from tests.serving.speculative.replay_draft import ReplayDraft, attach_replay

    rid = "random/greedy"
    ref = reference[rid].outputs[0]
    script = PROMPTS["random"] + list(ref.token_ids)
    rates = {}
    for alpha in (1.0, 0.0, 0.6):
        e = make_engine(serving_model, SpeculativeConfig(num_tokens=3, min_alpha=0.0))
        attach_replay(e, ReplayDraft([script], alpha, serving_model.cfg.vocab_size, seed=1))
        assert_same(run(e, [(rid, PROMPTS["random"], PARAMS["greedy"])]), {rid: reference[rid]})
        st = e.speculator.stats()
        rates[alpha] = (st["accepted_tokens"], st["draft_tokens"], st["rejected_tokens"])
    assert rates[1.0][0] == rates[1.0][1] > 0 and rates[0.0][0] == 0 < rates[0.0][2]
    assert 0 < rates[0.6][0] < rates[0.6][1] and rates[0.6][2] > 0
    rej = make_engine(serving_model, SpeculativeConfig(verify="rejection"))
    with pytest.raises(ValueError, match="verify='exact' only"):
        attach_replay(rej, ReplayDraft([script], 0.5, serving_model.cfg.vocab_size))
