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
