"""Tensor-parallel invariance compiled for real GPUs (Mosaic GPU / Triton kernels, NCCL).

Same property as test_tp_invariance.py on a bf16 model sized for the GPU kernels' tiles: every TP
size the host offers (1, 2, 4, 8) gives bitwise the same score() log-probs and greedy tokens in
"tp" mode; "batch" mode (sequential-K partials + NCCL psum) is the negative control.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.sharding import tiny

PROMPT_LENS = (37, 5, 64)
DECODE_STEPS = 4


def _tps() -> list[int]:
    return [t for t in (1, 2, 4, 8) if t <= jax.device_count()]


def _gpu_model():
    # bf16 block_k = 64: o_proj K = 16*128 = 32 tiles (8 leaves); F = 2816 pads to 3072 = 48 tiles
    # (8 leaves of 6); V = 1000 pads to 1024; 4 kv heads, so TP 8 replicates them.
    cfg = tiny.tiny_cfg(
        hidden_size=1024,
        intermediate_size=2816,
        num_heads=16,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=1000,
        num_layers=3,
    )
    return cfg, tiny.tiny_params(cfg, seed=3, scale=0.03, dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_score_and_greedy_are_bitwise_identical_for_every_tp_size():
    tps = _tps()
    if len(tps) < 2:
        pytest.skip("needs at least 2 GPUs")
    cfg, params = _gpu_model()
    run = dict(prompt_lens=PROMPT_LENS, dtype=jnp.bfloat16, page=16)
    ref_lp = tiny.run_score(cfg, params, 1, "tp", **run)
    ref_tok, ref_glp = tiny.run_greedy(cfg, params, 1, "tp", decode_steps=DECODE_STEPS, **run)
    assert np.isfinite(ref_lp).all()
    for tp in tps[1:]:
        assert np.array_equal(tiny.run_score(cfg, params, tp, "tp", **run), ref_lp), f"TP={tp}"
        tok, glp = tiny.run_greedy(cfg, params, tp, "tp", decode_steps=DECODE_STEPS, **run)
        assert np.array_equal(tok, ref_tok) and np.array_equal(glp, ref_glp), f"TP={tp}"


@pytest.mark.gpu
def test_gpu_negative_control_batch_mode_psum_differs_between_tp_sizes():
    tps = _tps()
    if len(tps) < 2:
        pytest.skip("needs at least 2 GPUs")
    cfg, params = _gpu_model()
    ref = tiny.run_score(cfg, params, 1, "batch", PROMPT_LENS, jnp.bfloat16, 16)
    differs = [
        tp
        for tp in tps[1:]
        if not np.array_equal(
            tiny.run_score(cfg, params, tp, "batch", PROMPT_LENS, jnp.bfloat16, 16), ref
        )
    ]
    assert differs, f"batch mode (psum) matched TP=1 at TP {tps[1:]} on this device and input"


@pytest.mark.gpu
def test_gpu_tp_engine_through_the_pull_all_reduce_gives_tp1_tokens(monkeypatch):
    """jdet.LLM at TP 2 (and 4) in "tp" mode, whose row-parallel all-reduce "auto" makes the
    one-launch pull kernel at these sizes (with the leaf groups, the residual add and the
    padding rows it takes in the engine), generates TP 1's greedy tokens and log-probs and
    scores them with TP 1's bits. The spy proves the kernel was traced at every TP > 1."""
    import jdet
    from jdet.loader import Model
    from pallas_kernels import allreduce_mosaic

    tps = _tps()
    if len(tps) < 2:
        pytest.skip("needs at least 2 GPUs")
    monkeypatch.setenv("JDET_EXEC_CACHE", "0")  # trace every step: the spy must see them
    calls: list[tuple] = []
    kernel = allreduce_mosaic.allreduce

    def spy(parts, axis_name, n, **kw):
        calls.append((n, parts.shape, kw.get("live")))
        return kernel(parts, axis_name, n, **kw)

    monkeypatch.setattr(allreduce_mosaic, "allreduce", spy)
    cfg, params = _gpu_model()
    model = Model(cfg=cfg, params=params)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (37, 5)]
    sp = jdet.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = None
    for tp in tps[:3]:  # 1, 2, 4
        llm = jdet.LLM(model, tp=tp, invariance="tp", max_num_batched_tokens=64, num_pages=64,
                       max_model_len=256)  # fmt: skip
        outs = llm.generate(prompts, sp)
        scores = llm.score([p + o.token_ids for p, o in zip(prompts, outs, strict=True)])
        got = ([o.token_ids for o in outs], [np.asarray(o.logprobs) for o in outs], scores)
        del llm
        if ref is None:
            ref = got
            assert not calls, "TP 1 has no all-reduce to run"
            continue
        assert got[0] == ref[0], f"TP={tp} tokens"
        assert all(np.array_equal(a, b) for a, b in zip(got[1], ref[1], strict=True)), tp
        assert all(np.array_equal(a, b) for a, b in zip(got[2], ref[2], strict=True)), tp
        assert any(c[0] == tp for c in calls), f"TP={tp} never ran the pull all-reduce: {calls}"
        assert any(live is not None and live < shape[1] for _, shape, live in calls), calls
