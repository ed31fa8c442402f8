"""The weight layout is stated by `Ops` (`fused`, `untied`: what jdet/plan.py `prepare_params`
produced), not probed from the params' keys, so the model computes with the layout it is told.

Why it matters: a probe (`"wqkv" in lp`) silently follows whatever keys a params dict happens to
carry; a flag set where the layout is decided makes a mismatch a KeyError naming the weight.
Bitwise checks on the CPU's fixed-order path (`xla_fixed`, whose column dots are 128 wide): with
q, k, v and FFN widths that are multiples of 128, the fused q|k|v and gate|up products are made
of the separate ones' column blocks, so the bits are the same; each check has a negative control
that must differ.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.batch import build_batch
from jdet.model import forward
from jdet.ops import Ops
from jdet.plan import fuse_projections
from tests.sharding.tiny import PAGE, pages_for, prompts, tiny_cfg, tiny_params

MODE = "batch"  # the unsharded invariant step (no padding): BIO matmuls only


def _logits(ops: Ops, cfg, params) -> np.ndarray:
    toks = prompts(cfg, (7, 3), seed=3)
    pages = pages_for([len(t) for t in toks])
    b, _ = build_batch([(t, 0, p) for t, p in zip(toks, pages, strict=True)], PAGE,
                       logits="all", pad_tokens=16)  # fmt: skip
    kv_shape = (cfg.num_layers, cfg.num_kv_heads, sum(map(len, pages)), PAGE, cfg.head_dim)
    kv = {"k": jnp.zeros(kv_shape), "v": jnp.zeros(kv_shape)}
    _, out = jax.jit(lambda p, kv, b: forward(p, cfg, kv, b, ops))(
        params, kv, jax.tree.map(jnp.asarray, b)
    )
    return np.asarray(out)


def test_a_tied_model_ignores_a_stray_lm_head_unless_told_it_is_untied():
    cfg = tiny_cfg(tie_word_embeddings=True, intermediate_size=256, num_layers=1)
    params = tiny_params(cfg, seed=1)
    assert "lm_head" not in params
    plain = _logits(Ops(MODE), cfg, params)
    stray = {**params, "lm_head": jnp.asarray(np.random.default_rng(0).standard_normal(
        (cfg.hidden_size, cfg.vocab_size)), jnp.float32)}  # fmt: skip
    assert np.array_equal(_logits(Ops(MODE), cfg, stray), plain)
    # control: told the weights are untied, the model reads the stray lm_head
    assert not np.array_equal(_logits(Ops(MODE, untied=True), cfg, stray), plain)


def test_fused_projections_follow_the_flag_and_keep_the_bits():
    cfg = tiny_cfg(intermediate_size=256, num_layers=1)  # q, k, v, F: 1024, 256, 256, 256
    params = tiny_params(cfg, seed=2)
    sep = _logits(Ops(MODE), cfg, params)
    assert np.isfinite(sep).all()
    fused = fuse_projections(params, 1)
    assert np.array_equal(_logits(Ops(MODE, fused=True), cfg, fused), sep)
    # control: a fused weight in another layout (TP=2's shard order read at TP=1) changes the bits
    wrong = fuse_projections(params, 2)
    assert not np.array_equal(_logits(Ops(MODE, fused=True), cfg, wrong), sep)


def test_a_layout_flag_that_disagrees_with_the_weights_names_the_weight():
    cfg = tiny_cfg(intermediate_size=256, num_layers=1)
    params = tiny_params(cfg, seed=2)
    with pytest.raises(KeyError, match="wqkv"):
        _logits(Ops(MODE, fused=True), cfg, params)
    with pytest.raises(KeyError, match="wq"):
        _logits(Ops(MODE), cfg, fuse_projections(params, 1))
