"""Mixture-of-experts invariance compiled on a GPU (`-m gpu`): a Qwen3-MoE-shaped random bf16
model (Qwen3-30B-A3B's layer widths, 4 layers, 32 experts) whose grouped matmul runs the Pallas
kernels: score() alone, among other requests, and chunked give the same bits; generate's
log-probs are score()'s. The control: an expert sum split by the step's size, which must
differ."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jdet

pytestmark = pytest.mark.gpu

# Qwen3-30B-A3B's widths (benchmarks/moe_bench.py), fewer layers, experts and vocabulary
MOE = dict(model_type="qwen3_moe", vocab_size=32000, hidden_size=2048, intermediate_size=6144,
           num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
           num_experts=32, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
           max_position_embeddings=4096)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    import jax.numpy as jnp

    from jdet.config import ModelConfig
    from jdet.loader import Model
    from jdet.params import init_params

    cfg = ModelConfig.from_hf(MOE)
    return Model(cfg=cfg, params=init_params(cfg, seed=0, dtype=jnp.bfloat16))


def _score_alone_batched_chunked(model, invariance):
    rng = np.random.default_rng(0)
    V = model.cfg.vocab_size
    target = rng.integers(0, V, 300).tolist()
    others = [rng.integers(0, V, n).tolist() for n in (700, 33, 1200, 5)]
    llm = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=2048, num_pages=1024,
                   warmup=False)  # fmt: skip
    alone = llm.score([target])[0]
    batched = llm.score(others[:2] + [target] + others[2:])[2]
    chunked = jdet.LLM(model, invariance=invariance, max_num_batched_tokens=64, num_pages=1024,
                       warmup=False).score([target])[0]  # fmt: skip
    return alone, batched, chunked


@pytest.mark.parametrize("invariance", ["tp", "batch"])
def test_gpu_moe_score_bits_do_not_depend_on_batch_or_chunking(model, invariance):
    alone, batched, chunked = _score_alone_batched_chunked(model, invariance)
    assert np.isfinite(alone).all()
    assert np.array_equal(alone, batched)
    assert np.array_equal(alone, chunked)


def _down_split_by_step_rows(original, splits: list):
    """The control's experts' down projection: K in two halves, each rounded to the model's
    dtype and then summed in f32, when the step lays out more than 1,024 (token, expert) rows,
    the whole K rounded once otherwise: a reduction whose order and roundings follow the step's
    size, as a batch-dependent kernel's would. Both halves run the GPU's own grouped kernel.
    `splits` gets an entry each time a split is traced."""

    def grouped_row_matmul(self, x, w, tiles, live=None, layer=None):
        if x.shape[0] <= 1024:
            return original(self, x, w, tiles, live, layer)
        splits.append(x.shape)
        h = x.shape[1] // 2
        lo = original(self, x[:, :h], w[..., :h, :], tiles, None, layer).astype(jnp.float32)
        hi = original(self, x[:, h:], w[..., h:, :], tiles, None, layer).astype(jnp.float32)
        lo, hi = jax.lax.optimization_barrier((lo, hi))
        return (lo + hi).astype(x.dtype)

    return grouped_row_matmul


def test_gpu_moe_negative_control_a_step_size_dependent_expert_sum_changes_the_score(
    model, monkeypatch
):
    """The harness sees a batch-dependent MoE: with the down projection split by the step's
    rows, the 300-token score (one step of >= 2,400 expert rows) differs from its 64-token
    chunks (512 rows). Why not "none": on a GPU "none" runs the same row-local grouped kernels,
    and at these shapes XLA's dense matmuls and the attention split kept its bits across batch
    and chunking too.

    The step and score functions are cached per (config, Ops) for the process (jdet/step.py),
    and the tests above compiled this model's: the control bypasses the caches, or its patch
    would never be traced and it would compare the unpatched programs (`splits` checks that)."""
    import jdet.ops
    import jdet.step
    import serving.engine.host_inputs as host_inputs

    splits: list = []
    split = _down_split_by_step_rows(jdet.ops.Ops.grouped_row_matmul, splits)
    monkeypatch.setattr(jdet.ops.Ops, "grouped_row_matmul", split)
    monkeypatch.setattr(jdet.step, "make_step_fn", jdet.step.make_step_fn.__wrapped__)
    monkeypatch.setattr(jdet.step, "make_score_fn", jdet.step.make_score_fn.__wrapped__)
    monkeypatch.setattr(host_inputs, "_split_step_fn", host_inputs._split_step_fn.__wrapped__)
    alone, batched, chunked = _score_alone_batched_chunked(model, "tp")
    assert splits, "the control's split was never traced: a cached step ran instead"
    assert np.isfinite(alone).all()
    assert not np.array_equal(alone, chunked)


def test_gpu_moe_generate_logprobs_equal_score_alone_and_among_others(model):
    llm = jdet.LLM(model, invariance="tp", max_num_batched_tokens=512, num_pages=1024,
                   warmup=False)  # fmt: skip
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (40, 300, 7)]
    sp = jdet.SamplingParams(temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    outs = llm.generate(prompts, sp)
    alone = llm.generate(prompts[1], sp)[0]
    assert alone.token_ids == outs[1].token_ids
    assert np.array_equal(alone.logprobs, outs[1].logprobs)
    scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    for p, o, s in zip(prompts, outs, scores, strict=True):
        assert np.array_equal(o.logprobs, s[len(p) - 1 :])
