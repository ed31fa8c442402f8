"""Mixture-of-experts models: config mapping, loading as published (per-expert tensors) and as
transformers holds them in memory (fused gate_up_proj), orbax round trip, and the router's
top-k (ties to the lower expert index, renormalisation as the config says)."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jdet
from jdet.config import ModelConfig
from jdet.moe import route

MOE_ARCHS = ["qwen3_moe", "mixtral"]


def _raw(**kw) -> dict:
    base = dict(model_type="qwen3_moe", vocab_size=50, hidden_size=32, intermediate_size=64,
                num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)  # fmt: skip
    return {**base, **kw}


def test_qwen3_moe_sparse_layers_follow_step_and_mlp_only_layers():
    cfg = ModelConfig.from_hf(_raw(decoder_sparse_step=2, mlp_only_layers=[3]))
    assert cfg.sparse_layers == (1, 5) and cfg.dense_layers == (0, 2, 3, 4)
    assert cfg.norm_topk_prob is False
    cfg = ModelConfig.from_hf(_raw(norm_topk_prob=True))
    assert cfg.sparse_layers == tuple(range(6)) and cfg.norm_topk_prob
    # transformers 5 writes Qwen3-MoE's expert count as num_local_experts
    raw = _raw()
    raw["num_local_experts"] = raw.pop("num_experts")
    assert ModelConfig.from_hf(raw).num_experts == 4
    mix = ModelConfig.from_hf(_raw(model_type="mixtral", num_local_experts=8))
    assert mix.sparse_layers == tuple(range(6)) and mix.norm_topk_prob
    assert mix.moe_intermediate_size == 64  # Mixtral's experts are intermediate_size wide
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(_raw(num_experts_per_tok=5))


def test_a_dense_config_dict_has_no_expert_fields():
    d = ModelConfig.from_hf(_raw(model_type="qwen3")).to_dict()
    assert "num_experts" not in d and "sparse_layers" not in d


def _fused_copy(src, dst, arch: str):
    """The checkpoint with transformers' in-memory tensor names (experts fused per layer)."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd), "no fused experts in memory"
    save_file(sd, str(dst / "model.safetensors"))
    return hf


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_per_expert_and_fused_expert_checkpoints_load_to_the_same_weights(
    hf_checkpoints, tmp_path, arch
):
    hf = _fused_copy(hf_checkpoints[arch], tmp_path / "fused", arch)
    a = jdet.load(hf_checkpoints[arch], dtype="float32")
    b = jdet.load(tmp_path / "fused", dtype="float32")
    la, lb = jax.tree.leaves_with_path(a.params), jax.tree.leaves(b.params)
    for (path, x), y in zip(la, lb, strict=True):
        assert np.array_equal(np.asarray(x), np.asarray(y)), path
    # and they are transformers' weights: expert e's gate = rows :F of gate_up_proj[e], as [D, F]
    layer = a.cfg.sparse_layers[0]
    sd = hf.state_dict()
    gu = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"].numpy()
    down = sd[f"model.layers.{layer}.mlp.experts.down_proj"].numpy()
    F = a.cfg.moe_intermediate_size
    lp = a.params["layers"]
    np.testing.assert_array_equal(np.asarray(lp["expert_gate"][0, 1]), gu[1, :F].T)
    np.testing.assert_array_equal(np.asarray(lp["expert_up"][0, 1]), gu[1, F:].T)
    np.testing.assert_array_equal(np.asarray(lp["expert_down"][0, 1]), down[1].T)
    router = sd[f"model.layers.{layer}.mlp.gate.weight"].numpy()
    np.testing.assert_array_equal(np.asarray(lp["router"][0]), router.T)


def test_orbax_round_trip_keeps_every_expert_weight(hf_checkpoints, tmp_path):
    model = jdet.load(hf_checkpoints["qwen3_moe"], dtype="bfloat16")
    back = jdet.load(jdet.save(model, tmp_path / "native"))
    assert back.cfg == model.cfg
    for (path, x), y in zip(jax.tree.leaves_with_path(model.params),
                            jax.tree.leaves(back.params), strict=True):  # fmt: skip
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y)), path
    assert json.loads((tmp_path / "native" / "config.json").read_text())["mlp_only_layers"] == [1]


def test_router_ties_go_to_the_lower_expert_index():
    logits = jnp.asarray([[0.5, 2.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0]], jnp.float32)
    _, ids = route(logits, 3, normalize=False)
    assert np.asarray(ids).tolist() == [[1, 2, 4], [0, 1, 2]]


def _route_rows_alone_and_in_pieces(route_fn) -> tuple[np.ndarray, np.ndarray]:
    """Routing weights of 512 rows of f32 logits [512, 8] in one call and in 64-row calls."""
    logits = (np.random.default_rng(0).standard_normal((512, 8)) * 3).astype(np.float32)
    f = jax.jit(lambda x: route_fn(x, 8, True)[0])
    return np.asarray(f(logits)), np.concatenate(
        [np.asarray(f(logits[i : i + 64])) for i in range(0, 512, 64)]
    )


def test_router_weights_of_a_row_do_not_depend_on_how_many_rows_are_routed():
    """A row's routing weights are its own in a 512-row step and in 64-row chunks, bitwise (on
    a CPU XLA's exp of [512, 8] and of [64, 8] differed in 76 rows: xla_fixed.exp_rows)."""
    whole, pieces = _route_rows_alone_and_in_pieces(route)
    assert np.array_equal(whole, pieces)


def test_negative_control_a_router_whose_exp_follows_the_row_count_changes_the_weights():
    """The comparison sees a router whose exp is computed another way above 64 rows."""

    def shape_dependent(logits, k, normalize):
        x = logits - jnp.max(logits, axis=-1, keepdims=True)
        e = jnp.exp2(x * np.float32(1.4426950408889634)) if x.shape[0] > 64 else jnp.exp(x)
        top, ids = jax.lax.top_k(e / jnp.sum(e, axis=-1, keepdims=True), k)
        return top / jnp.sum(top, axis=-1, keepdims=True), ids

    whole, pieces = _route_rows_alone_and_in_pieces(shape_dependent)
    assert not np.array_equal(whole, pieces)


@pytest.mark.parametrize("normalize", [False, True])
def test_router_matches_transformers_topk(normalize):
    logits = np.random.default_rng(0).standard_normal((64, 8)).astype(np.float32)
    w, ids = route(jnp.asarray(logits), 2, normalize)
    probs = torch.softmax(torch.tensor(logits), dim=-1, dtype=torch.float)
    tw, tids = torch.topk(probs, 2, dim=-1)
    if normalize:
        tw = tw / tw.sum(-1, keepdim=True)
    assert np.array_equal(np.asarray(ids), tids.numpy())
    np.testing.assert_allclose(np.asarray(w), tw.numpy(), rtol=1e-6)
    if not normalize:
        assert (np.asarray(w).sum(-1) < 0.999).any()  # the unnormalised weights stay so


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_a_model_built_in_code_saves_a_config_that_gives_back_its_experts(tmp_path, arch):
    from jdet.loader import Model
    from jdet.params import init_params

    raw = _raw(model_type=arch, decoder_sparse_step=2, mlp_only_layers=[3], num_local_experts=4)
    cfg = ModelConfig.from_hf(raw)
    model = Model(cfg=cfg, params=init_params(cfg, dtype=jnp.float32))
    assert jdet.load(jdet.save(model, tmp_path / "m")).cfg.to_dict() == {
        **cfg.to_dict(), "torch_dtype": "bfloat16"}  # fmt: skip
