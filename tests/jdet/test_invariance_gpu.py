"""Model-level invariance compiled on a GPU (`-m gpu`): a Qwen3-shaped random bf16 model large
enough for XLA's own matmul to change bits with the batch (measured on H100 for M >= 256)."""

import numpy as np
import pytest

import jdet

pytestmark = pytest.mark.gpu

# Qwen3-0.6B's shape (benchmarks/serve_bench.py "0.6b"), cut to 4 layers below
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, tie_word_embeddings=True)  # fmt: skip


@pytest.fixture(scope="module")
def model():
    import jax.numpy as jnp

    from jdet.config import ModelConfig
    from jdet.loader import Model
    from jdet.params import init_params

    raw = dict(QWEN3_06B, num_hidden_layers=4, model_type="qwen3")
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


def test_gpu_mosaic_attention_one_shot_equals_chunks_and_decodes(model, monkeypatch):
    """JDET_ATTENTION=mosaic (Hopper): a 3,000-token prompt scored in 2,048 + 1,024-token steps
    and in 64-token chunks (both the looped launch, two consumers), and a generation's decodes
    (16-token bucket: the split launch, `launch_plan`) against score()'s rows: the same bits.
    Control: the default Triton family gives other bits, so the comparison can see a kernel
    change. The step caches are bypassed (as in test_moe_invariance_gpu.py): the environment is
    read when a step is traced."""
    import jdet.ops
    import jdet.step
    import serving.engine.host_inputs as host_inputs
    from pallas_kernels._platform import ATTENTION_ENV, backend
    from pallas_kernels.paged_attention_mosaic import launch_plan

    if not backend().hopper:
        pytest.skip("the Mosaic GPU attention runs on Hopper only")
    assert launch_plan(2048, (1, 256), 8, 2, 128, 16, 256)[0] == "looped"
    assert launch_plan(16, (16, 256), 8, 2, 128, 16, 256)[0] == "split"
    target = np.random.default_rng(5).integers(0, model.cfg.vocab_size, 3000).tolist()
    kw = dict(invariance="tp", num_pages=512, warmup=False)
    triton = jdet.LLM(model, max_num_batched_tokens=64, **kw).score([target])[0]
    monkeypatch.setenv(ATTENTION_ENV, "mosaic")
    monkeypatch.setattr(jdet.step, "make_step_fn", jdet.step.make_step_fn.__wrapped__)
    monkeypatch.setattr(jdet.step, "make_score_fn", jdet.step.make_score_fn.__wrapped__)
    monkeypatch.setattr(host_inputs, "_split_step_fn", host_inputs._split_step_fn.__wrapped__)
    assert jdet.ops.Ops().attn_kernel(64) == "mosaic"
    one = jdet.LLM(model, max_num_batched_tokens=2048, **kw).score([target])[0]
    llm = jdet.LLM(model, max_num_batched_tokens=64, **kw)
    chunks = llm.score([target])[0]
    sp = jdet.SamplingParams(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)
    out = llm.generate(target[:2000], sp)[0]
    scored = llm.score([target[:2000] + out.token_ids])[0]
    assert np.isfinite(one).all()
    assert np.array_equal(one, chunks)
    assert np.array_equal(out.logprobs, scored[1999:])
    assert not np.array_equal(one, triton)


def test_gpu_generate_logprobs_equal_score(model):
    llm = jdet.LLM(model, invariance="tp", max_num_batched_tokens=512, num_pages=2048)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, model.cfg.vocab_size, n).tolist() for n in (40, 300, 7)]
    outs = llm.generate(prompts, jdet.SamplingParams(temperature=1.0, seed=3, max_tokens=16,
                                                     ignore_eos=True))  # fmt: skip
    scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
    for p, o, s in zip(prompts, outs, scores, strict=True):
        assert np.array_equal(o.logprobs, s[len(p) - 1 :])


def _decode_inputs(cfg, batch: int, ctx: int, pmax: int, pad_tokens: int, page: int = 16):
    """A greedy decode step of `batch` sequences at position ctx - 1, sequence b on pages
    b * used, ..., with `pad_tokens` rows (padding rows write nothing)."""
    from jdet.batch import decode_batch
    from jdet.step import SamplingInputs
    from serving.engine.sampler_variants import for_step

    used = -(-ctx // page)
    tokens = np.random.default_rng(0).integers(1, cfg.vocab_size, batch).tolist()
    pages = [list(range(b * used, (b + 1) * used)) for b in range(batch)]
    sb = decode_batch(tokens, [ctx - 1] * batch, pages, page, pad_tokens=pad_tokens,
                      pad_seqs=batch, pad_pages=pmax)  # fmt: skip
    z, k = np.zeros(batch, np.float32), np.zeros(batch, np.int32)
    si = SamplingInputs(temperature=z, top_k=k, top_p=z + 1, seed=np.zeros(batch, np.uint32),
                        position=np.full(batch, ctx, np.int32),
                        **for_step(k, z + 1, False))  # fmt: skip
    return sb, si


def test_gpu_unrolled_layers_equal_the_layer_loop(model):
    """Ops.unroll_layers_gpu: the layers as L inlined calls of one jitted layer instead of
    XLA's loop run the same kernels on the same operands: tokens, log-probs and every K/V row of
    a decode step (3 sequences, 5 padding rows) are equal. Control: the loop's step on weights
    that differ in one row of the last layer's q|k|v projection (one bf16 step) writes other K/V
    rows, so the comparison sees a changed weight."""
    import jax
    import jax.numpy as jnp

    from serving.engine.engine import Engine
    from sharding.mesh import make_tp_mesh
    from sharding.tp import make_tp_step

    sb, si = _decode_inputs(model.cfg, 3, 100, 16, pad_tokens=8)
    eng = Engine(model, invariance="tp", max_num_batched_tokens=256, num_pages=64,
                 max_model_len=512, async_scheduling="off")  # fmt: skip
    r = eng.runner
    kv0 = jax.tree.map(np.asarray, r.kv)

    def run(params, unroll):
        fn = make_tp_step(model.cfg, "tp", make_tp_mesh(1), unroll_layers_gpu=unroll)
        kv = jax.device_put(kv0, jax.tree.map(lambda a: a.sharding, r.kv))
        kv, out = fn(params, kv, jax.device_put(sb), jax.device_put(si))
        return [np.asarray(out.tokens), np.asarray(out.logprobs), np.asarray(kv["k"]),
                np.asarray(kv["v"])]  # fmt: skip

    looped, unrolled = run(r.params, 0), run(r.params, 1)
    for name, a, b in zip(("tokens", "logprobs", "k", "v"), looped, unrolled, strict=True):
        assert np.array_equal(a, b), name
    layers = dict(r.params["layers"])
    w = layers["wqkv"]
    layers["wqkv"] = w.at[-1, 0, :].set(jnp.nextafter(w[-1, 0, :], jnp.inf))
    nudged = run({**r.params, "layers": layers}, 0)
    assert not np.array_equal(nudged[2], looped[2])
