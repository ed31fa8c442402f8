"""Partition specs, padding and kv-head replication: layout rules, checked without a model."""

from __future__ import annotations

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jdet.config import ModelConfig
from jdet.params import init_params
from jdet.plan import pad_params
from jdet.tp_layout import check_heads, check_tp_size, expand_kv_heads, kv_heads_in_cache
from sharding.specs import param_partition_specs


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="qwen3",
        vocab_size=301,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=8,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        qkv_bias=False,
        o_bias=False,
        qk_norm=True,
    )
    base.update(kw)
    return ModelConfig(**base)


def test_a_head_count_tp_cannot_serve_is_a_value_error_naming_the_numbers():
    with pytest.raises(ValueError, match=r"tp=4 .*6 query heads"):
        check_heads(_cfg(num_heads=6, num_kv_heads=2), 4)
    with pytest.raises(ValueError, match=r"tp=4 .*6 kv heads"):
        check_heads(_cfg(num_heads=12, num_kv_heads=6), 4)
    with pytest.raises(ValueError, match="power of two"):
        check_tp_size(3)


def test_kv_heads_are_replicated_so_each_device_holds_the_head_its_queries_read():
    cfg = _cfg(num_heads=8, num_kv_heads=2, head_dim=4)
    params = init_params(cfg, seed=1, dtype=np.float32)
    assert kv_heads_in_cache(cfg, 2) == 2 and kv_heads_in_cache(cfg, 8) == 8
    wk = np.asarray(params["layers"]["wk"])  # [L, D, 2*E]
    for tp in (4, 8):
        out = np.asarray(expand_kv_heads(params, cfg, tp)["layers"]["wk"])
        E, G, H = cfg.head_dim, cfg.num_heads // cfg.num_kv_heads, cfg.num_heads
        for d in range(tp):  # device d holds cache head d; its first query head is d*H/tp
            kv_head = (d * H // tp) // G
            assert np.array_equal(
                out[..., d * E : (d + 1) * E], wk[..., kv_head * E : (kv_head + 1) * E]
            )


def test_padding_is_exact_zeros_idempotent_and_the_same_for_every_tp_size():
    cfg = _cfg(tie_word_embeddings=True)
    params = init_params(cfg, seed=2, dtype=np.float32)
    out = pad_params(params, cfg, ffn_multiple=64)
    lg = out["layers"]
    F, V = cfg.intermediate_size, cfg.vocab_size
    assert lg["w_gate"].shape[-1] == 64 and lg["w_down"].shape[1] == 64
    assert not np.asarray(lg["w_gate"][..., F:]).any() and not np.asarray(lg["w_down"][:, F:]).any()
    assert np.array_equal(np.asarray(lg["w_up"][..., :F]), np.asarray(params["layers"]["w_up"]))
    assert out["lm_head"].shape[1] % 8 == 0 and not np.asarray(out["lm_head"][:, V:]).any()
    assert np.array_equal(np.asarray(out["lm_head"][:, :V]), np.asarray(params["embed"]).T)
    again = pad_params(out, cfg, ffn_multiple=64)
    assert again["layers"]["w_gate"].shape == lg["w_gate"].shape
    assert again["lm_head"].shape == out["lm_head"].shape


def test_every_weight_has_a_spec_splitting_the_right_axis():
    cfg = _cfg(qkv_bias=True, o_bias=True)
    params = pad_params(init_params(cfg, seed=0, dtype=np.float32), cfg, ffn_multiple=64)
    specs = param_partition_specs(params, cfg)
    ls = specs["layers"]
    assert ls["wq"] == P(None, None, "tp") and ls["wk"] == P(None, None, "tp")
    assert ls["bq"] == P(None, "tp") and ls["bv"] == P(None, "tp")
    assert ls["wo"] == P(None, "tp", None) and ls["w_down"] == P(None, "tp", None)
    assert ls["w_gate"] == P(None, None, "tp") and ls["w_up"] == P(None, None, "tp")
    assert ls["attn_norm"] == P(None, None) and ls["bo"] == P(None, None)
    assert specs["lm_head"] == P(None, "tp") and specs["embed"] == P(None, None)
    assert specs["final_norm"] == P(None)
    assert set(ls) == set(params["layers"]) and set(specs) == set(params)
