"""Per-request logits transforms (issue 19): penalties, logit bias, min-p, min_tokens,
stop_token_ids, bad_words, allowed_token_ids.

Each is checked three ways: (1) the device transform against a numpy reference of the specified
semantics (OpenAI / vLLM definitions); (2) a request's tokens and log-probs are bitwise the same
alone and batched with requests using other options (`np.array_equal`), in the sampler and
through the engine, and under TP=2 on CPU devices; (3) the option changes the output as specified.
Negative control: a sampler whose transforms read a neighbouring row's inputs (not row-local)
makes the same comparisons fail.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.ops import Ops
from jdet.sampling import (
    MAX_LOGIT_BIAS,
    LogitsInputs,
    SamplingInputs,
    apply_min_p,
    process_logits,
    sample,
)
from serving.constrained.logits_rows import pack_allowed
from serving.engine.engine import Engine
from tests.serving.conftest import write_tiny_model

# One xdist worker for the whole module: its tests share its model, engine and compiled steps
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("sampling_options")

V = 320  # the tiny serving model's vocabulary
OPS = Ops("tp")


# ---------------------------------------------------------------------------- numpy reference
def reference_logits(logits: np.ndarray, rows: list[dict], prompts: list, outputs: list):
    """vLLM's order: allowed/bad/min_tokens mask, logit bias, repetition (prompt + generated),
    frequency and presence (generated). Then (after temperature) min-p."""
    out = logits.astype(np.float32).copy()
    for r, o in enumerate(rows):
        x = out[r]
        if o.get("allowed") is not None:
            keep = np.zeros(V, bool)
            keep[o["allowed"]] = True
            x[~keep] = -np.inf
        for t in o.get("banned", []):
            x[t] = -np.inf
        for t, b in o.get("bias", {}).items():
            x[t] = np.float32(x[t] + np.float32(b))
        seen = set(prompts[r]) | set(outputs[r])
        rep = np.float32(o.get("rep", 1.0))
        for t in seen:
            x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
        for t in set(outputs[r]):
            c = np.float32(outputs[r].count(t))
            x[t] = x[t] - np.float32(o.get("freq", 0.0)) * c - np.float32(o.get("pres", 0.0))
    return out


def reference_min_p(scaled: np.ndarray, min_p: np.ndarray) -> np.ndarray:
    p = np.exp(scaled - scaled.max(-1, keepdims=True))  # p / p_max
    keep = (min_p[:, None] <= 0) | (p >= min_p[:, None] * (1 - 1e-6))
    return np.where(keep, scaled, -np.inf)


def logits_inputs(rows: list[dict], prompts: list, outputs: list, U: int = 64) -> LogitsInputs:
    """Host arrays as serving/constrained/logits_rows.py builds them."""
    N, W = len(rows), -(-V // 32)
    a = dict(
        min_p=np.zeros(N, np.float32),
        presence=np.zeros(N, np.float32),
        frequency=np.zeros(N, np.float32),
        repetition=np.ones(N, np.float32),
        pen_ids=np.full((N, U), -1, np.int32),
        pen_counts=np.zeros((N, U), np.int32),
        bias_ids=np.full((N, MAX_LOGIT_BIAS), -1, np.int32),
        bias_vals=np.zeros((N, MAX_LOGIT_BIAS), np.float32),
        mask=np.full((N, W), -1, np.int32),
    )
    for r, o in enumerate(rows):
        a["min_p"][r] = o.get("min_p", 0)
        a["presence"][r], a["frequency"][r] = o.get("pres", 0), o.get("freq", 0)
        a["repetition"][r] = o.get("rep", 1)
        toks = sorted(set(prompts[r]) | set(outputs[r]))
        if o.get("rep", 1) != 1 or o.get("pres") or o.get("freq"):
            a["pen_ids"][r, : len(toks)] = toks
            a["pen_counts"][r, : len(toks)] = [outputs[r].count(t) for t in toks]
        for j, (t, b) in enumerate(o.get("bias", {}).items()):
            a["bias_ids"][r, j], a["bias_vals"][r, j] = t, b
        if o.get("allowed") is not None:
            a["mask"][r] = pack_allowed(o["allowed"], W)
        u = a["mask"][r].view(np.uint32)
        for t in o.get("banned", []):
            u[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)
    return LogitsInputs(**a)


ROWS = [
    {},
    {"rep": 1.3},
    {"rep": 0.7, "freq": 0.5},
    {"pres": 1.2, "freq": -0.4},
    {"bias": {5: 30.0, 7: -100.0, 300: 2.5}},
    {"allowed": [3, 9, 27, 81, 243]},
    {"banned": [0, 11, 12], "bias": {11: 50.0}},
    {"min_p": 0.2, "rep": 1.1},
]


def random_case(seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 3, (len(ROWS), V)).astype(np.float32)
    prompts = [rng.integers(0, V, rng.integers(1, 20)).tolist() for _ in ROWS]
    outputs = [rng.integers(0, 40, rng.integers(0, 25)).tolist() for _ in ROWS]  # repeats
    return logits, prompts, outputs


def test_transforms_match_the_numpy_reference():
    logits, prompts, outputs = random_case()
    x = logits_inputs(ROWS, prompts, outputs)
    got = np.asarray(jax.jit(process_logits)(jnp.asarray(logits), x))
    want = reference_logits(logits, ROWS, prompts, outputs)
    assert np.array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(want)], want[np.isfinite(want)], rtol=1e-6)
    assert not np.allclose(got[1:4], logits[1:4])  # the penalties did something
    min_p = np.array([0, 0.05, 0.3, 0.9, 0, 0, 0, 0.5], np.float32)
    scaled = want / 0.7
    got_p = np.asarray(apply_min_p(jnp.asarray(scaled), jnp.asarray(min_p)))
    assert np.array_equal(np.isinf(got_p), np.isinf(reference_min_p(scaled, min_p)))
    assert np.isinf(got_p[3]).sum() > np.isinf(got_p[1]).sum() > np.isinf(scaled[1]).sum()


def _sample(logits, rows, prompts, outputs, temps, fn=sample, seeds=None):
    N = len(rows)
    seeds = np.arange(N) + 7 if seeds is None else np.asarray(seeds)
    inp = SamplingInputs(
        temperature=np.asarray(temps, np.float32),
        top_k=np.zeros(N, np.int32),
        top_p=np.ones(N, np.float32),
        seed=seeds.astype(np.uint32),
        position=np.full(N, 30, np.int32),
        logits=logits_inputs(rows, prompts, outputs),
    )
    return _jitted(fn)(jnp.asarray(logits), inp)


@functools.cache
def _jitted(fn):
    return jax.jit(lambda lg, i: fn(lg, i, OPS))


def test_greedy_picks_the_argmax_of_the_reference_and_reports_raw_logprobs():
    logits, prompts, outputs = random_case(1)
    out = _sample(logits, ROWS, prompts, outputs, [0.0] * len(ROWS))
    want = reference_logits(logits, ROWS, prompts, outputs)
    assert np.array_equal(np.asarray(out.tokens), want.argmax(-1))
    raw = jax.nn.log_softmax(jnp.asarray(logits), -1)
    chosen = np.take_along_axis(np.asarray(raw), np.asarray(out.tokens)[:, None], -1)[:, 0]
    np.testing.assert_allclose(np.asarray(out.logprobs), chosen, rtol=1e-5, atol=1e-5)
    assert set(np.asarray(out.tokens)[5:6]) <= {3, 9, 27, 81, 243}
    assert np.asarray(out.tokens)[4] == 5 and np.asarray(out.tokens)[6] not in (0, 11, 12)


def broken_sample(logits, inp, ops):
    """Negative control: the transforms read the previous row's inputs (not row-local)."""
    x = jax.tree_util.tree_map(lambda a: jnp.roll(a, 1, axis=0), inp.logits)
    return sample(logits, dataclasses.replace(inp, logits=x), ops)


def _rows_alone_equal_batched(fn) -> bool:
    logits, prompts, outputs = random_case(2)
    temps = [0.0, 0.8, 0.0, 1.0, 0.9, 1.0, 0.0, 1.0]
    seeds = list(range(100, 100 + len(ROWS)))
    batched = _sample(logits, ROWS, prompts, outputs, temps, fn, seeds)
    for r in range(len(ROWS)):
        pad = [r, 0] if r else [0, 1]  # alone: one real row and one other
        sub = lambda a, pad=pad: [a[i] for i in pad]  # noqa: E731
        alone = _sample(logits[pad], sub(ROWS), sub(prompts), sub(outputs), sub(temps), fn,
                        sub(seeds))  # fmt: skip
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            if not np.array_equal(np.asarray(getattr(alone, name))[0],
                                  np.asarray(getattr(batched, name))[r]):  # fmt: skip
                return False
    return True


def test_sampler_rows_do_not_depend_on_the_batch():
    assert _rows_alone_equal_batched(sample)
    assert not _rows_alone_equal_batched(broken_sample)  # negative control fails


# ---------------------------------------------------------------------------- engine
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import jdet

    return jdet.load(write_tiny_model(tmp_path_factory.mktemp("tiny_opts")), dtype="float32")


def engine(model, **kw) -> Engine:
    return Engine(
        model,
        invariance=kw.pop("invariance", "tp"),
        max_num_batched_tokens=64,
        max_num_seqs=16,
        max_model_len=128,
        page_size=8,
        num_pages=kw.pop("num_pages", 128),
        min_tokens_bucket=64,
        min_seqs_bucket=16,
        min_pages_bucket=16,
        **kw,
    )


PROMPT = [17, 42, 99, 7, 123, 5, 250, 31, 8, 64]
BASE = dict(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=20)
OPTIONS = {
    "presence": dict(presence_penalty=2.0),
    "frequency": dict(frequency_penalty=1.5),
    "repetition": dict(repetition_penalty=1.6),
    "bias": dict(logit_bias={}),  # filled from the plain output in the test
    "min_p": dict(temperature=1.0, min_p=0.3, seed=5),
    "min_tokens": dict(min_tokens=8, ignore_eos=False, stop_token_ids=[]),
    "stop_ids": dict(stop_token_ids=[]),
    "allowed": dict(allowed_token_ids=[40, 41, 42, 43, 44, 45]),
    "bad_words": dict(bad_words=[]),
    "sampled_penalised": dict(temperature=0.9, top_k=30, seed=11, frequency_penalty=0.7),
}


def run(eng: Engine, reqs: dict) -> dict:
    for rid, (ids, params) in reqs.items():
        eng.add_request(rid, ids, params)
    outs = {o.request_id: o.outputs[0] for o in eng.run()}
    assert eng.page_manager.num_used == 0
    return outs


def requests(model, eng) -> dict:
    plain = run(eng, {"plain": (PROMPT, BASE)})["plain"]
    toks = plain.token_ids
    opts = {k: {**BASE, **v} for k, v in OPTIONS.items()}
    opts["bias"]["logit_bias"] = {toks[0]: -100.0, 77: 9.0}
    opts["stop_ids"]["stop_token_ids"] = [toks[3]]
    opts["min_tokens"]["stop_token_ids"] = [toks[1]]
    word = model.tokenizer.decode(toks[:2]).strip() or model.tokenizer.decode(toks[:1])
    opts["bad_words"]["bad_words"] = [word]
    return {k: (PROMPT[: 4 + i], v) for i, (k, v) in enumerate(opts.items())}, plain


def bits_equal(a, b) -> bool:
    return (
        np.array_equal(np.asarray(a.token_ids), np.asarray(b.token_ids))
        and np.array_equal(np.asarray(a.logprobs, np.float32), np.asarray(b.logprobs, np.float32))
        and a.top_logprobs == b.top_logprobs
    )


def alone_vs_batched(model, eng_alone, eng_batched) -> tuple[dict, dict, dict]:
    reqs, _ = requests(model, eng_alone)
    alone = {k: run(eng_alone, {k: v})[k] for k, v in reqs.items()}
    rng = np.random.default_rng(3)
    filler = {
        f"f{i}": (rng.integers(1, V, rng.integers(1, 30)).tolist(),
                  dict(temperature=0.7, max_tokens=int(rng.integers(1, 12)), seed=i))
        for i in range(5)
    }  # fmt: skip
    batched = run(eng_batched, {**filler, **reqs})
    return reqs, alone, batched


def test_each_option_gives_the_same_bits_alone_and_batched(model):
    eng = engine(model)
    reqs, alone, batched = alone_vs_batched(model, eng, eng)
    for k in reqs:
        assert bits_equal(alone[k], batched[k]), f"{k}: bits changed when batched"


def test_options_change_the_output_as_specified(model):
    eng = engine(model)
    reqs, plain = requests(model, eng)
    out = run(eng, reqs)
    toks = plain.token_ids
    assert toks[0] not in out["bias"].token_ids
    assert set(out["allowed"].token_ids) <= set(range(40, 46))
    assert out["stop_ids"].finish_reason == "stop" and out["stop_ids"].token_ids[-1] == toks[3]
    assert len(out["min_tokens"].token_ids) >= 8
    got = out["bad_words"].token_ids
    for ids in eng.runner.logits_rows.bad_word_ids(tuple(reqs["bad_words"][1]["bad_words"])):
        k = len(ids)
        assert all(tuple(got[i : i + k]) != ids for i in range(len(got))), ids
    assert out["repetition"].token_ids != run(eng, {"p": (reqs["repetition"][0], BASE)})[
        "p"].token_ids  # fmt: skip
    # presence/frequency act on repeated tokens: take a prompt whose plain greedy output repeats
    rng = np.random.default_rng(0)
    for _ in range(20):
        prompt = rng.integers(1, V, 6).tolist()
        plain = run(eng, {"p": (prompt, BASE)})["p"].token_ids
        if len(set(plain)) < len(plain):
            break
    assert len(set(plain)) < len(plain)
    # frequency/presence shift logits, so log-probs too: with the raw top-20 log-probs the
    # engine reports, the greedy choice is the argmax of the penalised raw log-probs
    for k in ("presence", "frequency"):
        p = reqs[k][1]
        o = run(eng, {k: (prompt, p)})[k]
        assert o.token_ids != plain, k
        for i, tok in enumerate(o.token_ids):
            gen = o.token_ids[:i]
            scores = {t: lp - p.get("frequency_penalty", 0) * gen.count(t)
                      - p.get("presence_penalty", 0) * (t in gen)
                      for t, lp in o.top_logprobs[i]}  # fmt: skip
            best = max(scores, key=scores.get)
            assert tok == best or scores[best] - scores.get(tok, -1e9) < 1e-5, (k, i)


def test_negative_control_a_non_row_local_transform_changes_bits(model):
    from jdet.model import forward

    ops = Ops("tp")

    @jax.jit
    def step(params, kv, batch, sampling):
        kv, logits = forward(params, model.cfg, kv, batch, ops)
        return kv, broken_sample(logits, sampling, ops)

    eng = engine(model, step_fn=step, sharded=False)
    reqs, alone, batched = alone_vs_batched(model, eng, eng)
    assert any(not bits_equal(alone[k], batched[k]) for k in reqs)


def test_options_give_the_same_bits_under_tp2():
    """TP=1 (sharded runtime) vs TP=2 on CPU devices, options batched together."""
    from jdet.loader import Model
    from tests.sharding.tiny import tiny_cfg, tiny_params

    cfg = tiny_cfg(vocab_size=V)
    m = Model(cfg=cfg, params=tiny_params(cfg), tokenizer=None)
    opts = {k: v for k, v in OPTIONS.items() if k != "bad_words"}
    opts["bias"] = dict(logit_bias={3: 5.0, 4: -100.0})
    reqs = {k: (PROMPT[: 4 + i], {**BASE, **v}) for i, (k, v) in enumerate(opts.items())}
    one = run(engine(m, tp=1, sharded=True), reqs)
    two = run(engine(m, tp=2), reqs)
    for k in reqs:
        assert bits_equal(one[k], two[k]), k


# ---------------------------------------------------------------------------- LLM.chat, prompts
@pytest.fixture(scope="module")
def llm(model):
    import jdet

    return jdet.LLM(model, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=128,
                    page_size=8, min_tokens_bucket=64, min_seqs_bucket=8)  # fmt: skip


def test_prompt_logprobs_are_the_samplers_logprobs(llm):
    """Teacher-forced prompt log-probs (score()'s plan) of prompt + generated tokens equal the
    log-probs the sampler reported for those tokens, bitwise."""
    import jdet

    prompt = PROMPT[:7]
    gen = llm.generate(prompt, jdet.SamplingParams(temperature=0.8, seed=4, max_tokens=9,
                                                   ignore_eos=True))[0]  # fmt: skip
    full = llm.generate(prompt + gen.token_ids,
                        jdet.SamplingParams(max_tokens=1, prompt_logprobs=0))[0]  # fmt: skip
    plp = full.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt) + len(gen.token_ids)
    got = np.asarray(plp[len(prompt) :], np.float32)
    assert np.array_equal(got, gen.logprobs)
    assert not np.array_equal(np.asarray(plp[len(prompt) - 1 : -1], np.float32), gen.logprobs)


def test_chat_renders_the_template_and_batches_conversations(llm):
    import jdet

    sp = jdet.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    one = llm.chat(conv, sp)[0]
    assert one.prompt.endswith("<|im_start|>assistant\n") and "be brief" in one.prompt
    ids = llm.tokenizer(one.prompt, add_special_tokens=False)["input_ids"]
    assert one.token_ids == llm.generate(ids, sp)[0].token_ids
    two = llm.chat([conv, [{"role": "user", "content": "fox"}]], sp)
    assert two[0].token_ids == one.token_ids and len(two) == 2
    custom = llm.chat(conv, sp, chat_template="{% for m in messages %}{{ m['content'] }}|"
                      "{% endfor %}")  # fmt: skip
    assert custom[0].prompt == "be brief|hello|"
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "no role"}], sp)


def test_gpu_top_k_top_p_select_equals_the_skipping_cond(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the top-k/top-p filter runs every step behind a per-row select (a `lax.cond`
    around a sort is a host-side conditional there: it made every step synchronous). The select
    must give the bits of the cond it replaces, for steps where no row, some rows and all rows
    filter. Control: a select that filters every row (ignoring the row's request) differs."""
    from pallas_kernels import _platform

    ops = Ops("none")  # XLA's log_softmax: runs anywhere under the patched platform
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, V)).astype(np.float32) * 3)
    z = np.zeros(6, np.float32)
    cases = {
        "none": (np.zeros(6, np.int32), z + 1),
        "some": (np.array([0, 5, 0, 40, 0, 0], np.int32),
                 np.array([1, 1, 0.9, 1, 0.5, 1], np.float32)),
        "all": (np.full(6, 7, np.int32), z + 0.8),
    }

    def draw(top_k: np.ndarray, top_p: np.ndarray) -> tuple:
        inp = SamplingInputs(temperature=z + 0.9, top_k=jnp.asarray(top_k),
                             top_p=jnp.asarray(top_p), seed=jnp.arange(6, dtype=jnp.uint32),
                             position=jnp.arange(6, dtype=jnp.int32) + 11)  # fmt: skip
        out = jax.jit(lambda lg, i: sample(lg, i, ops))(logits, inp)
        return np.asarray(out.tokens), np.asarray(out.logprobs)

    cond = {k: draw(*v) for k, v in cases.items()}
    monkeypatch.setattr(_platform, "platform", lambda: "gpu")
    for k, v in cases.items():
        sel = draw(*v)
        assert np.array_equal(sel[0], cond[k][0]) and np.array_equal(sel[1], cond[k][1]), k
    # control: filtering the unfiltered rows with another row's top-k changes their draws
    forced = draw(np.full(6, 5, np.int32), cases["some"][1])
    assert not np.array_equal(forced[0], cond["some"][0])
