"""Token buckets below 8 rows keep the invariance contract (issue 17): `min_tokens_bucket` 1 and 4,
and a CPU engine's default buckets, whose first is 1 (serving/engine/shapes.py
`single_token_bucket`: a batch-1 decode runs 2-row dots, pallas_kernels/xla_fixed.py `row_block`).

On a CPU these engines used to leave `score()`'s bits: greedy decode of the embedded model from
output 23 on (BENCHMARKS.md, session 10), because the query's RoPE of a 1-4 row step rounded
otherwise than an 8-row step's (a fused multiply-add on the other product; pallas_kernels/
xla_fixed.py, "FMA contraction"). Here: decode log-probs equal `score()`'s bitwise, and a
sequence's bits are the same decoding alone (1 row) or beside another (2 or 4 rows). Negative
control: the same engine with the plain RoPE expression (jdet/ops.py `apply_rope`) instead of
`xla_fixed.rope` must leave `score()`.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jdet
from jdet.plan import backend

pytestmark = pytest.mark.xdist_group("small_buckets")

PROMPTS = [
    "The list of all the files in a directory is returned as a list of",  # session 10's repro
    "Once upon a time there was a little",
]
# The control's prompt diverged from score() at output 23 before the fix, so 32 tokens.
PARAMS = jdet.SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return jdet.load()


def _score(llm, prompt: str, out) -> np.ndarray:
    ids = list(llm.engine.tokenizer.encode(prompt)) + list(out.token_ids)
    return np.float32(llm.score([ids])[0])[-len(out.token_ids) :]


@pytest.mark.parametrize("bucket", [1, 4])
def test_small_bucket_decode_equals_score_and_batch(model, bucket):
    llm = jdet.LLM(model, invariance="tp", min_tokens_bucket=bucket, warmup=False)
    together = llm.generate(PROMPTS, PARAMS)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = llm.generate([prompt], PARAMS)[0]
        assert list(alone.token_ids) == list(out.token_ids)
        assert np.array_equal(np.float32(alone.logprobs), np.float32(out.logprobs))
        assert np.array_equal(_score(llm, prompt, out), np.float32(out.logprobs))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the 1-token bucket is the CPU's")
def test_default_cpu_buckets_decode_alone_in_one_row_with_the_bits_of_eight(model):
    """The default engine: a batch-1 decode runs T = 1 (2-row dots), two sequences T = 8 (8-row
    dots); the same bits either way, and score()'s. Where the small row blocks are not verified
    (pallas_kernels/xla_fixed.py `small_row_blocks_verified`) there is no 1-token bucket."""
    llm = jdet.LLM(model, invariance="tp", warmup=False)
    first = (1, 8) if backend().small_row_blocks else (8, 16)
    assert llm.engine.runner.shapes.tokens[:2] == first
    together = llm.generate(PROMPTS, PARAMS)
    for prompt, out in zip(PROMPTS, together, strict=True):
        alone = llm.generate([prompt], PARAMS)[0]
        assert np.array_equal(np.float32(alone.logprobs), np.float32(out.logprobs))
        assert np.array_equal(_score(llm, prompt, alone), np.float32(alone.logprobs))


@pytest.fixture
def plain_rope(monkeypatch):
    """The step with the plain RoPE expression; returns how many times it was traced. JAX's
    caches are cleared before and after, so the control traces its own steps and leaves none
    (whatever Python-level caches hold the jitted steps)."""
    import jdet.ops
    from jdet.ops import apply_rope

    traced = []

    def rope(self, x, cos, sin):
        traced.append(x.shape)
        return apply_rope(x, cos, sin)

    jax.clear_caches()
    monkeypatch.setattr(jdet.ops.Ops, "rope", rope)
    yield traced
    monkeypatch.undo()
    jax.clear_caches()


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the contraction is XLA CPU's")
def test_negative_control_plain_rope_leaves_score(model, plain_rope):
    llm = jdet.LLM(model, invariance="tp", min_tokens_bucket=1, warmup=False)
    out = llm.generate(PROMPTS[:1], PARAMS)[0]
    assert plain_rope, "the control's steps did not trace the plain RoPE"
    assert not np.array_equal(_score(llm, PROMPTS[0], out), np.float32(out.logprobs))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the 1-token bucket is the CPU's")
def test_jdet_generate_keeps_its_one_step_shape_without_the_1_token_bucket():
    """`jdet generate` prefills and decodes in one compiled shape (jdet/cli.py): the 1-token
    bucket would be a second compile in a one-shot run."""
    from jdet.cli import _one_shape_budget
    from jdet.settings import EngineConfig
    from serving.engine.shapes import ShapeSet

    cfg = _one_shape_budget(EngineConfig(), None)
    shapes = ShapeSet.build(max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=8,
                            max_pages=8, min_tokens_bucket=cfg.min_tokens_bucket)  # fmt: skip
    assert shapes.tokens == (8,)
    default = ShapeSet.build(max_num_batched_tokens=8, max_num_seqs=8, max_pages=8)
    # what it would have run unpinned (no 1-token bucket where the small row blocks are off)
    assert default.tokens == ((1, 8) if backend().small_row_blocks else (8,))
