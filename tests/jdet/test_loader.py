"""Loading: sharded safetensors, orbax round trip, and errors that name the problem."""

import json
import shutil

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jdet
from jdet.config import ModelConfig


def _leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
        for x, y in zip(la, lb, strict=True)
    )


def test_sharded_checkpoint_loads_like_single_file(hf_checkpoints, tmp_path):
    src = hf_checkpoints["llama"]
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    half = len(names) // 2
    shards = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for fname, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, tmp_path / fname)
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(src / "config.json", tmp_path / "config.json")
    a = jdet.load(src, dtype="float32")
    b = jdet.load(tmp_path, dtype="float32")
    assert _leaves_equal(a.params, b.params)


def test_bfloat16_is_the_default_dtype(hf_checkpoints):
    m = jdet.load(hf_checkpoints["qwen3"])
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree_util.tree_leaves(m.params))
    assert m.params["layers"]["wq"].shape[0] == m.cfg.num_layers  # stacked on a layer axis


def test_orbax_round_trip_is_bitwise(hf_checkpoints, tmp_path):
    for dtype in ("float32", "bfloat16"):
        a = jdet.load(hf_checkpoints["qwen2"], dtype=dtype)
        jdet.save(a, tmp_path / dtype)
        b = jdet.load(tmp_path / dtype, dtype=dtype)
        assert b.cfg == a.cfg
        assert _leaves_equal(a.params, b.params)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        jdet.load(tmp_path / "nope")


def test_missing_config_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        jdet.load(tmp_path)


def test_unsupported_architecture_names_the_supported_ones(hf_checkpoints, tmp_path):
    raw = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    raw["model_type"] = "gpt2"
    with pytest.raises(ValueError, match="'gpt2' is not supported.*llama, mistral, qwen2, qwen3"):
        ModelConfig.from_hf(raw)


def test_missing_config_field_is_named(hf_checkpoints):
    raw = json.loads((hf_checkpoints["llama"] / "config.json").read_text())
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="'hidden_size' is missing"):
        ModelConfig.from_hf(raw)


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_truncated_tensor_file_is_named(hf_checkpoints, tmp_path):
    d = _copy(hf_checkpoints["qwen3"], tmp_path / "m")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        jdet.load(d)


def test_shape_mismatch_names_the_tensor(hf_checkpoints, tmp_path):
    d = _copy(hf_checkpoints["qwen3"], tmp_path / "m")
    t = load_file(d / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    t[name] = np.zeros((t[name].shape[0] + 1, t[name].shape[1]), np.float32)
    save_file(t, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight has shape"):
        jdet.load(d)


def test_missing_tensor_is_named(hf_checkpoints, tmp_path):
    d = _copy(hf_checkpoints["qwen3"], tmp_path / "m")
    t = load_file(d / "model.safetensors")
    del t["model.layers.0.self_attn.k_norm.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.k_norm.weight is missing"):
        jdet.load(d)
