"""The CPU's 1-token bucket with f32 activations (issue 17): a batch-1 decode of an f32 model runs
T = 1 steps, two sequences T = 8 ones, and both must give score()'s bits.

tests/serving/engine/test_small_buckets.py checks this for the bf16 embedded model; CI's other f32
engine tests pad every step to one bucket of 16 or more tokens, so no f32 model ran the 1-token
step. f32 activations are where the CPU path's exact products matter most
(pallas_kernels/xla_fixed.py, "FMA contraction": RoPE's products and rms_norm's squares are exact in
f32 only by construction). Negative control: the plain RoPE expression (jdet/ops.py `apply_rope`),
whose contraction LLVM picks by the step's shape, must make the batch-1 decode leave the batched one
(measured: it does for every f32 model tried, the embedded one and tiny Qwen3/Llama checkpoints).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jdet

pytestmark = [
    pytest.mark.skipif(jax.default_backend() != "cpu", reason="the 1-token bucket is the CPU's"),
    pytest.mark.xdist_group("small_buckets"),
]

PROMPTS = ["The quick brown fox jumps", "Deterministic inference means"]
PARAMS = jdet.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _decode(model, monkeypatch) -> tuple[jdet.LLM, list, list]:
    """(engine, outputs decoded together (T = 8 steps), each decoded alone (T = 1))."""
    # The 1-token bucket asked for: by default it exists only where the small row blocks are
    # verified (serving/engine/shapes.py `single_token_bucket`; elsewhere a T = 1 step runs 8-row
    # dots), and the T = 1 step is what this tests, everywhere.
    import serving.engine.shapes

    monkeypatch.setattr(serving.engine.shapes, "single_token_bucket", lambda: True)
    # a budget of 8 and short sequences: two step shapes (T = 1, 8) and one score shape compile
    llm = jdet.LLM(model, invariance="tp", warmup=False, max_num_batched_tokens=8,
                   max_model_len=64, num_pages=16)  # fmt: skip
    assert llm.engine.runner.shapes.tokens == (1, 8)
    together = llm.generate(PROMPTS, PARAMS)
    alone = [llm.generate([p], PARAMS)[0] for p in PROMPTS]
    return llm, together, alone


def test_f32_batch_1_decode_has_the_bits_of_the_batched_decode_and_score(serving_model,
                                                                          monkeypatch):
    assert serving_model.dtype == np.float32
    llm, together, alone = _decode(serving_model, monkeypatch)
    for out, one in zip(together, alone, strict=True):
        assert list(one.token_ids) == list(out.token_ids)
        assert np.array_equal(np.float32(one.logprobs), np.float32(out.logprobs))
    ids = [
        list(llm.engine.tokenizer.encode(p)) + list(o.token_ids)
        for p, o in zip(PROMPTS, together, strict=True)
    ]
    for out, score in zip(together, llm.score(ids), strict=True):
        assert np.array_equal(np.float32(score)[-len(out.token_ids) :], np.float32(out.logprobs))


@pytest.fixture
def plain_rope(monkeypatch):
    """The step with the plain RoPE expression where LLVM's contraction by shape was observed
    (tests/pallas_kernels/variants.py `contraction_by_shape_measured`), elsewhere with a
    contraction chosen by the step's rows by construction (`contracted_rope_by_rows`: JAX 0.11.2
    did not contract by shape where 0.10.2 did). JAX's caches are cleared before and after, so the
    control traces its own steps and leaves none (test_small_buckets.py's fixture)."""
    import jdet.ops
    from jdet.ops import apply_rope
    from tests.pallas_kernels import variants

    rope = apply_rope if variants.contraction_by_shape_measured() else \
        variants.contracted_rope_by_rows  # fmt: skip
    jax.clear_caches()
    monkeypatch.setattr(jdet.ops.Ops, "rope", lambda self, x, cos, sin: rope(x, cos, sin))
    yield
    monkeypatch.undo()
    jax.clear_caches()


def test_negative_control_plain_rope_makes_the_f32_batch_1_decode_differ(serving_model, plain_rope,
                                                                        monkeypatch):
    _, together, alone = _decode(serving_model, monkeypatch)
    assert any(
        not np.array_equal(np.float32(one.logprobs), np.float32(out.logprobs))
        for out, one in zip(together, alone, strict=True)
    )
