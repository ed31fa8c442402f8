"""Fused column-parallel weights (jdet/plan.py `fuse_projections`: one q|k|v and one gate|up
matmul per layer) give bitwise the log-probs of the separate projections, compiled on Hopper.

Why it can hold: the Mosaic BIO kernel reduces every output element over the same K steps whatever
N is and whichever CTA holds the column. Checked at M = 106 (128-row CTAs) and M = 7 (the 64-row
decode CTAs). Negative control: a fused weight in the wrong layout (the TP=2 shard order read at
TP=1) must change the log-probs, so the comparison can fail.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from tests.sharding import tiny

pytestmark = pytest.mark.gpu


def _model():
    cfg = tiny.tiny_cfg(hidden_size=1024, intermediate_size=2816, num_heads=16, num_kv_heads=4,
                        head_dim=128, vocab_size=1000, num_layers=3)  # fmt: skip
    return cfg, tiny.tiny_params(cfg, seed=5, scale=0.03, dtype=jnp.bfloat16)


def _score(cfg, params, prompt_lens, *, fuse: bool, fuse_tp: int = 1) -> np.ndarray:
    import jax

    from jdet.plan import fuse_projections, prepare_params
    from sharding.mesh import make_tp_mesh
    from sharding.specs import named, param_partition_specs
    from sharding.tp import init_tp_kv_cache, make_tp_score

    mesh = make_tp_mesh(1)
    p = prepare_params(params, cfg, 1, fuse=False)
    if fuse:
        p = fuse_projections(p, fuse_tp)
    p = jax.device_put(p, named(mesh, param_partition_specs(p, cfg)))
    toks = tiny.prompts(cfg, prompt_lens, seed=1)
    pages = tiny.pages_for([len(t) for t in toks], 16)
    b = tiny.batch([(t, 0, pg) for t, pg in zip(toks, pages, strict=True)], 16, logits="all")
    targets = np.concatenate([np.roll(t, -1) for t in toks]).astype(np.int32)
    kv = init_tp_kv_cache(cfg, mesh, sum(map(len, pages)), 16, jnp.bfloat16)
    _, lp = make_tp_score(cfg, "tp", mesh, fused=fuse)(p, kv, b, targets)  # the layout of p
    out = np.full(targets.shape, np.nan, np.float32)  # poison
    out[...] = np.asarray(lp)
    return out


@pytest.mark.parametrize("prompt_lens", [(37, 5, 64), (7,)])
def test_gpu_fused_projections_give_the_bits_of_separate_ones(prompt_lens):
    cfg, params = _model()
    sep = _score(cfg, params, prompt_lens, fuse=False)
    assert np.isfinite(sep).all()
    assert np.array_equal(_score(cfg, params, prompt_lens, fuse=True), sep)


def test_gpu_negative_control_misordered_fusion_changes_the_bits():
    cfg, params = _model()
    sep = _score(cfg, params, (37, 5, 64), fuse=False)
    assert not np.array_equal(_score(cfg, params, (37, 5, 64), fuse=True, fuse_tp=2), sep)
