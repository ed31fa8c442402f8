"""Model-level invariance compiled on a GPU (`-m gpu`): a Qwen3-shaped random bf16 model large
enough for XLA's own matmul to change bits with the batch (measured on H100 for M >= 256)."""

import numpy as np
import pytest

import jdet

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    import jax.numpy as jnp

    from benchmarks.serve_bench import SHAPES
    from jdet.config import ModelConfig
    from jdet.loader import Model
    from jdet.params import init_params

    raw = dict(SHAPES["0.6b"], num_hidden_layers=4, model_type="qwen3")
    raw["max_position_embeddings"] = 4096
    cfg = ModelConfig.from_hf(raw)
    return Model(cfg=cfg, params=init_params(cfg, seed=0, dtype=jnp.bfloat16))


def _score_alone_and_batched(model, invariance):
    rng = np.random.default_rng(0)
    V = model.cfg.vocab_size
    target = rng.integers(0, V, 300).tolist()
    others = [rng.integers(0, V, n).tolist() for n in (700, 33, 1200, 5)]
    llm = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=2048, num_pages=2048)
    alone = llm.score([target])[0]
    batched = llm.score(others[:2] + [target] + others[2:])[2]
    chunked = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=64,
                       num_pages=2048).score([target])[0]  # fmt: skip
    return alone, batched, chunked


@pytest.mark.parametrize("invariance", ["tp", "batch"])
def test_gpu_score_bits_do_not_depend_on_batch_or_chunking(model, invariance):
    alone, batched, chunked = _score_alone_and_batched(model, invariance)
    assert np.array_equal(alone, batched)
    assert np.array_equal(alone, chunked)


def test_gpu_negative_control_xla_score_changes_with_batch_or_chunking(model):
    alone, batched, chunked = _score_alone_and_batched(model, "none")
    assert not (np.array_equal(alone, batched) and np.array_equal(alone, chunked))


def test_gpu_generate_logprobs_equal_score(model):
    llm = jdet.LLM(model, invariance="tp", max_num_batched_tokens=512, num_pages=2048)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (40, 300, 7)]
    outs = llm.generate(prompts, jdet.SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                                                     ignore_eos=True))  # fmt: skip
    scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    for p, o, s in zip(prompts, outs, scores, strict=True):
        assert np.array_equal(o.logprobs, s[len(p) - 1 :])
