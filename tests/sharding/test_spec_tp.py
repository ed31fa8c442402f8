"""Exact speculative decoding under tensor parallelism: `jdet.LLM(model, tp=2, speculative=...)`
gives bitwise the tokens and log-probs of plain decoding at TP 1 (8 virtual CPU devices; the shared
tiny Qwen3 checkpoint). The prompts repeat a pattern, so n-gram drafts are both accepted and
rejected (checked: a run whose drafts were never accepted would prove nothing). The negative control
of the TP comparison is tests/sharding/test_tp_invariance.py's ("batch" mode's psum changes bits
between TP sizes); that of exactness is tests/serving/speculative/test_speculative.py's."""

import numpy as np

import jdet
from jdet.spec_config import SpeculativeConfig


def test_exact_speculative_decoding_at_tp2_gives_the_tp1_plain_bits(hf_checkpoints):
    model = jdet.load(hf_checkpoints["qwen3"], dtype="float32")
    rng = np.random.default_rng(3)
    motif = rng.integers(1, model.cfg.vocab_size, 5).tolist()
    prompts = [motif * 4 + [7], rng.integers(1, model.cfg.vocab_size, 11).tolist()]
    params = [jdet.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
              jdet.SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True)]
    # one step shape per engine (T = S = 16, 4 pages of 16): a CPU compile each
    kw = dict(invariance="tp", max_num_batched_tokens=16, max_model_len=64, min_tokens_bucket=16)
    plain = jdet.LLM(model, tp=1, **kw).generate(prompts, params)
    spec = jdet.LLM(model, tp=2, speculative=SpeculativeConfig(method="ngram", num_tokens=3),
                    **kw)  # fmt: skip
    got = spec.generate(prompts, params)
    assert spec.engine.speculator.stats()["accepted_tokens"] > 0
    for a, b in zip(plain, got, strict=True):
        assert a.token_ids == b.token_ids
        assert np.array_equal(np.asarray(a.logprobs), np.asarray(b.logprobs))
