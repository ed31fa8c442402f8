"""Model-level invariance (README.md): bitwise equality of log-probs and tokens, bf16.

Each property runs in the invariant modes and, as a negative control, in "none", where the same
comparison must report a difference. On a CPU, XLA's own ops happen to give identical bits at
these sizes, so the "variant" controls run "none" with the `batch_dependent_none` hook (attention
whose order of scaling is chosen from the step's token count: an order that follows the batch);
the "xla" controls run plain "none" and are GPU tests (`-m gpu`), where XLA differs by itself.
Since "none" runs jdet's Pallas paged attention on the GPU, plain "none" failed the controls for
batch composition, generate-vs-score and generation among others on an H100 (2026-11-22; the run
kept only pytest's progress line, so "found no difference" is the likely but unconfirmed cause):
those three keep only the "variant" control (`VARIANT_ONLY`), which differs for certain; chunked
prefill passed in plain "none" there and keeps both.
"""

import numpy as np
import pytest

import jdet

# One xdist worker for the whole module: its tests share the model's compiled steps
# (tests/conftest.py: --dist loadgroup).
pytestmark = pytest.mark.xdist_group("invariance")

MODES = ["tp", "batch"]


@pytest.fixture(scope="module")
def model(hf_checkpoints):
    return jdet.load(hf_checkpoints["qwen3"], dtype="bfloat16")


def _seqs(n, lengths, seed=0, vocab=283):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, L).tolist() for L in lengths][:n]


def _same(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


CONTROLS = ["variant", pytest.param("xla", marks=pytest.mark.gpu)]
VARIANT_ONLY = pytest.mark.parametrize("control", ["variant"], indirect=True)


@pytest.fixture(params=CONTROLS)
def control(request):
    """'variant': "none" made batch dependent (CPU and GPU); 'xla': plain "none" (GPU only)."""
    if request.param == "variant":
        request.getfixturevalue("batch_dependent_none")
    return request.param


def _control(differs: bool, what: str):
    assert differs, f"negative control: the comparison found no difference for {what}"


def score_alone_vs_batched(model, invariance, budget=512):
    # 70 tokens, as chunked_vs_one_shot's sequence: the alone score and that one-shot score share
    # their shape (compiled once in the module's worker), the batched one is a larger shape
    target = _seqs(1, [70], seed=1)[0]
    others = _seqs(7, [3, 60, 17, 33, 2, 90, 11], seed=2)
    llm = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=budget)
    alone = llm.score([target])[0]
    batched = llm.score(others[:3] + [target] + others[3:])[3]
    return alone, batched


@pytest.mark.parametrize("invariance", MODES)
def test_score_bits_do_not_depend_on_batch_composition(model, invariance):
    alone, batched = score_alone_vs_batched(model, invariance)
    assert np.array_equal(alone, batched)


@VARIANT_ONLY
def test_score_batch_composition_negative_control(model, control):
    alone, batched = score_alone_vs_batched(model, "none")
    _control(not np.array_equal(alone, batched), "score alone vs batched")


def chunked_vs_one_shot(model, invariance):
    seq = _seqs(1, [70], seed=3)[0]
    one = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=512).score([seq])[0]
    out = [one]
    for budget in (16, 7):
        out.append(
            jdet.LLM(model, invariance=invariance, max_num_batched_tokens=budget).score([seq])[0]
        )
    return out


@pytest.mark.parametrize("invariance", MODES)
def test_chunked_prefill_equals_one_shot_prefill(model, invariance):
    one, *chunked = chunked_vs_one_shot(model, invariance)
    for c in chunked:
        assert np.array_equal(one, c)


def test_chunked_prefill_negative_control(model, control):
    one, *chunked = chunked_vs_one_shot(model, "none")
    _control(any(not np.array_equal(one, c) for c in chunked), "chunked vs one-shot prefill")


def decode_vs_score(model, invariance):
    # budget 32, as alone_vs_crowd's: the step shapes (T = 8, 16, 32) are compiled once for both,
    # and the 43 prompt tokens are prefilled in chunks beside decodes (at 64 they fit one step)
    llm = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=32)
    prompts = _seqs(3, [9, 30, 4], seed=4)
    outs = llm.generate(
        prompts, jdet.SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    )
    scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    return [(o.logprobs, s[len(p) - 1 :]) for p, o, s in zip(prompts, outs, scores, strict=True)]


@pytest.mark.parametrize("invariance", MODES)
def test_generate_logprobs_equal_score_bitwise(model, invariance):
    for gen, sc in decode_vs_score(model, invariance):
        assert np.array_equal(gen, sc)


@VARIANT_ONLY
def test_generate_vs_score_negative_control(model, control):
    pairs = decode_vs_score(model, "none")
    _control(any(not np.array_equal(g, s) for g, s in pairs), "decode vs teacher-forced score")


def alone_vs_crowd(model, invariance):
    llm = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=32)
    sp = jdet.SamplingParams(temperature=0.7, seed=5, max_tokens=10, ignore_eos=True)
    target = _seqs(1, [13], seed=6)[0]
    alone = llm.generate([target], sp)[0]
    crowd = llm.generate(_seqs(5, [40, 3, 22, 8, 51], seed=7) + [target], sp)[-1]
    return alone, crowd


@pytest.mark.parametrize("invariance", MODES)
def test_generation_does_not_depend_on_other_requests(model, invariance):
    alone, crowd = alone_vs_crowd(model, invariance)
    assert alone.token_ids == crowd.token_ids
    assert np.array_equal(alone.logprobs, crowd.logprobs)


@VARIANT_ONLY
def test_generation_among_other_requests_negative_control(model, control):
    alone, crowd = alone_vs_crowd(model, "none")
    differs = alone.token_ids != crowd.token_ids or not np.array_equal(
        alone.logprobs, crowd.logprobs
    )
    _control(differs, "generation alone vs among other requests")
