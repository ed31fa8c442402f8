"""The offline API: generate and score agree; bad input is refused with a clear message."""

import numpy as np
import pytest

import jdet


@pytest.fixture(scope="module")
def llm_f32(hf_checkpoints):
    return jdet.LLM(
        jdet.load(hf_checkpoints["qwen3"], dtype="float32"),
        invariance="none",
        max_num_batched_tokens=32,
    )


def test_generated_logprobs_agree_with_score(llm_f32):
    prompts = [[5, 17, 33, 2, 9, 100, 7], [44, 1, 250]]
    outs = llm_f32.generate(
        prompts, jdet.SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    )
    scores = llm_f32.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    for p, o, s in zip(prompts, outs, scores, strict=True):
        assert len(o.token_ids) == 10 and o.logprobs.shape == (10,)
        np.testing.assert_allclose(o.logprobs, s[len(p) - 1 :], atol=1e-5)


def test_seeded_sampling_is_reproducible_and_seeds_differ(llm_f32):
    sp = lambda seed: jdet.SamplingParams(
        temperature=8.0,
        seed=seed,
        max_tokens=12,  # noqa: E731
        ignore_eos=True,
    )
    a = llm_f32.generate([[3, 4, 5]], sp(1))[0].token_ids
    b = llm_f32.generate([[3, 4, 5]], sp(1))[0].token_ids
    c = llm_f32.generate([[3, 4, 5]], sp(2))[0].token_ids
    assert a == b
    assert a != c


def test_top_k_one_is_greedy(llm_f32):
    g = llm_f32.generate(
        [[9, 8, 7]], jdet.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    )[0]
    k = llm_f32.generate(
        [[9, 8, 7]],
        jdet.SamplingParams(temperature=1.5, top_k=1, seed=5, max_tokens=6, ignore_eos=True),
    )[0]
    assert g.token_ids == k.token_ids


def test_top_logprobs_are_sorted_and_include_greedy_token(llm_f32):
    o = llm_f32.generate(
        [[9, 8, 7]], jdet.SamplingParams(temperature=0.0, max_tokens=3, logprobs=5, ignore_eos=True)
    )[0]
    for tok, lp, top in zip(o.token_ids, o.logprobs, o.outputs[0].top_logprobs, strict=True):
        vals = list(top.values())
        assert len(top) == 5 and vals == sorted(vals, reverse=True)
        assert top[tok] == lp


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(n=0), "n must"),
        (dict(logprobs=99), "logprobs"),
    ],
)
def test_bad_sampling_params_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jdet.SamplingParams(**kwargs)


def test_overlong_prompt_and_bad_tokens_are_refused(llm_f32):
    with pytest.raises(ValueError, match="max_model_len"):
        llm_f32.generate([[1] * 250], jdet.SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm_f32.score([[1, 2, 99999]])
    with pytest.raises(ValueError, match="no tokenizer"):
        llm_f32.generate(["text prompt"])
    with pytest.raises(ValueError, match="invariance"):
        jdet.LLM(llm_f32.model, invariance="fast")
