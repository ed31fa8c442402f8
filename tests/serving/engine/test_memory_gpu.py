"""A default engine fits on the GPU it runs on (`-m gpu`): the Llama-3-8B shape (random bf16
weights drawn on the device), `jdet.LLM(model)` with every setting at its default, its largest
step shape run, then a request served."""

import numpy as np
import pytest

import jdet

pytestmark = pytest.mark.gpu

LLAMA3_8B = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                 hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 max_position_embeddings=8192, eos_token_id=0, bos_token_id=0)  # fmt: skip


@pytest.mark.parametrize("invariance", ["tp", "none"])
def test_default_engine_fits_and_runs_its_largest_shape(invariance):
    import gc

    import jax
    import jax.numpy as jnp

    from jdet.config import ModelConfig
    from jdet.loader import Model
    from jdet.params import init_params
    from serving.engine import sampler_variants

    gc.collect()  # the other mode's engine and weights
    cfg = ModelConfig.from_hf(LLAMA3_8B)
    model = Model(cfg=cfg, params=init_params(cfg, dtype=jnp.bfloat16, on_device=True))
    kw = {} if invariance == "tp" else {"invariance": invariance}
    llm = jdet.LLM(model, **kw)
    eng = llm.engine
    stats = jax.devices()[0].memory_stats()
    k, v = eng.runner.kv["k"], eng.runner.kv["v"]
    # two pools, not one buffer seen twice (the step writes both in place)
    assert k.unsafe_buffer_pointer() != v.unsafe_buffer_pointer()
    pool = 2 * k.size * k.dtype.itemsize
    b = eng.memory_budget
    assert b is not None and stats["bytes_in_use"] >= b.in_use + pool
    assert eng.max_model_len == 8192 and eng.page_manager.num_pages * 16 >= 8192
    for variant in sampler_variants.engine_variants():
        batch, sampling = eng.runner.warmup_batch(eng.runner.shapes.all()[-1], "step", variant)
        jax.block_until_ready(eng.runner.dispatch(eng.runner.place_tokens(batch), sampling))
    peak = jax.devices()[0].memory_stats()["peak_bytes_in_use"]
    assert peak <= b.in_use + pool + b.peak + b.headroom, (peak, b.describe())
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, 3000).tolist()
    out = llm.generate([ids], jdet.SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(out.token_ids) == 8
