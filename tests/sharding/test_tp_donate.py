"""The sharded runtime's weight layout: donated weights are freed as they are replaced and give
the same bits; a TP size the reduction tree cannot split fails when the engine is built.

Why donation: "tp" mode lays the weights out anew (padded FFN and vocabulary, fused projections,
TP shards), a second copy of most of them; a model near the device's size does not fit twice.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jdet
from jdet.loader import Model
from sharding.tp import make_tp_runtime
from tests.sharding import tiny

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")

# F = 700 pads to 768 and V = 301 to 1024, so the experts and lm_head get new arrays
MOE = dict(model_type="qwen3_moe", moe="qwen3_moe", num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=700, sparse_layers=(0,))  # fmt: skip


def _score(rt, cfg) -> np.ndarray:
    toks = tiny.prompts(cfg, (7, 4), seed=1)
    pages = tiny.pages_for([len(t) for t in toks])
    b = tiny.batch([(t, 0, p) for t, p in zip(toks, pages, strict=True)], logits="all")
    targets = np.concatenate([np.roll(t, -1) for t in toks]).astype(np.int32)
    kv = rt.init_kv(sum(map(len, pages)), tiny.PAGE, np.float32)
    return np.asarray(rt.score(rt.params, kv, b, targets)[1])


@pytest.mark.parametrize("tp", [1, 2])
def test_donated_weights_are_freed_and_give_the_same_bits(tp):
    cfg = tiny.tiny_cfg(**MOE)
    kept, given = tiny.tiny_params(cfg, seed=0), tiny.tiny_params(cfg, seed=0)
    ref = _score(make_tp_runtime(kept, cfg, tp, "tp"), cfg)
    rt = make_tp_runtime(given, cfg, tp, "tp", donate=True)
    assert np.array_equal(_score(rt, cfg), ref)
    # negative control: without donate the caller's arrays all live
    assert not any(x.is_deleted() for x in jax.tree.leaves(kept))
    deleted = {jax.tree_util.keystr(p) for p, x in jax.tree.leaves_with_path(given)
               if x.is_deleted()}  # fmt: skip
    assert "['layers']['expert_down']" in deleted and "['lm_head']" in deleted
    # what the placement aliases (a CPU places host views without a copy) stays alive
    assert not any(x.is_deleted() for x in jax.tree.leaves(rt.params))


def test_a_donated_models_hash_says_why_it_is_gone():
    cfg = tiny.tiny_cfg(**MOE)
    model = Model(cfg=cfg, params=tiny.tiny_params(cfg, seed=0))
    make_tp_runtime(model.params, cfg, 1, "tp", donate=True)
    with pytest.raises(ValueError, match="donate_weights"):
        _ = model.weights_hash


def test_a_tp_size_the_tree_cannot_split_fails_when_the_engine_is_built():
    # o_proj's input width 4 x 16 = 64: two f32 leaves of 32 columns, so tp <= 2
    cfg = tiny.tiny_cfg(num_heads=4, head_dim=16, **MOE)
    model = Model(cfg=cfg, params=tiny.tiny_params(cfg, seed=0))
    kw = dict(max_model_len=64, num_pages=16, max_num_batched_tokens=16, max_num_seqs=2,
              warmup=False)  # fmt: skip
    with pytest.raises(ValueError, match="o_proj's input width 64.*use tp <= 2"):
        jdet.LLM(model, tp=4, **kw)
    jdet.LLM(model, tp=2, **kw)  # the control: a TP size it can split builds
