"""Broken checkpoints: each is a clear exception naming the file and the field or tensor, and
saying what was expected (never a bare JSONDecodeError, `int()` or numpy message).

Each case copies a good tiny checkpoint, breaks one thing, and loads it. The control: the
unbroken copy loads (`test_the_unbroken_copies_load`), so every failure below is the break's.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jdet

ST = "model.safetensors"


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory) -> Path:
    """The serving tests' tiny Qwen3 with a BPE tokenizer and a chat template."""
    from tests.serving.conftest import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tok") / "m")


def _config(d: Path, **changes) -> None:
    raw = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is _DEL:
            raw.pop(k, None)
        else:
            raw[k] = v
    (d / "config.json").write_text(json.dumps(raw))


_DEL = object()


def _header(d: Path, edit: Callable[[dict], None]) -> None:
    """Rewrite the safetensors header (same data bytes) after `edit` changed it."""
    f = d / ST
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h)) + h + data[8 + n :])


def _first_tensor(h: dict) -> str:
    return sorted(k for k in h if k != "__metadata__")[0]


def _tensors(d: Path, edit: Callable[[dict], None]) -> None:
    t = load_file(d / ST)
    edit(t)
    save_file(t, d / ST)


def _shard(d: Path, weight_map: object) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


# (case id, break the directory d, exception, regex the message must match: file + field)
CASES: list[tuple[str, Callable[[Path], None], type, str]] = [
    ("config_not_json", lambda d: (d / "config.json").write_text("{oops"), ValueError,
     r"config\.json: not valid JSON.*expected a Hugging Face config\.json"),
    ("config_not_object", lambda d: (d / "config.json").write_text("[1, 2]"), ValueError,
     r"config\.json: expected a JSON object"),
    ("hidden_size_string", lambda d: _config(d, hidden_size="abc"), ValueError,
     r"config\.json: field 'hidden_size' must be an integer.*'abc'"),
    ("vocab_size_negative", lambda d: _config(d, vocab_size=-5), ValueError,
     r"config\.json: field 'vocab_size' must be an integer in \[1, .*-5"),
    ("layers_zero", lambda d: _config(d, num_hidden_layers=0), ValueError,
     r"config\.json: field 'num_hidden_layers' must be an integer in \[1"),
    ("intermediate_size_float", lambda d: _config(d, intermediate_size=95.5), ValueError,
     r"config\.json: field 'intermediate_size' must be an integer.*95\.5"),
    ("max_positions_too_big", lambda d: _config(d, max_position_embeddings=2**40), ValueError,
     r"config\.json: field 'max_position_embeddings' must be an integer in \[1, 2147483647\]"),
    ("heads_not_multiple_of_kv", lambda d: _config(d, num_key_value_heads=3), ValueError,
     r"num_attention_heads \(4\) must be a multiple of num_key_value_heads \(3\)"),
    ("tie_embeddings_string", lambda d: _config(d, tie_word_embeddings="yes"), ValueError,
     r"config\.json: field 'tie_word_embeddings' must be true or false"),
    ("eps_negative", lambda d: _config(d, rms_norm_eps=-1e-6), ValueError,
     r"config\.json: field 'rms_norm_eps' must be a finite number > 0"),
    ("eos_string", lambda d: _config(d, eos_token_id="</s>"), ValueError,
     r"config\.json: field 'eos_token_id' must be a token id or a list of token ids"),
    ("rope_llama3_without_factor",
     lambda d: _config(d, rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
     ValueError, r"config\.json \(rope llama3\): required field 'factor' is missing"),
    ("rope_parameters_not_object", lambda d: _config(d, rope_parameters=[1]), ValueError,
     r"config\.json: field 'rope_parameters' must be an object"),
    ("hidden_size_missing", lambda d: _config(d, hidden_size=_DEL), ValueError,
     r"config\.json: required field 'hidden_size' is missing"),
    ("model_type_unsupported", lambda d: _config(d, model_type="gpt2"), ValueError,
     r"config\.json: model_type 'gpt2' is not supported; jdet supports llama"),
    ("safetensors_header_not_json",
     lambda d: (d / ST).write_bytes(struct.pack("<Q", 6) + b"{oops}" + b"\0" * 64), ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*invalid JSON in header"),
    ("safetensors_header_length_absurd",
     lambda d: (d / ST).write_bytes(struct.pack("<Q", 2**60) + b"{}"), ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*header too large"),
    ("safetensors_shorter_than_8_bytes", lambda d: (d / ST).write_bytes(b"abc"), ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*header too small"),
    ("safetensors_truncated",
     lambda d: (d / ST).write_bytes((d / ST).read_bytes()[:-100]), ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*not fully covered"),
    ("safetensors_entry_without_dtype",
     lambda d: _header(d, lambda h: h[_first_tensor(h)].pop("dtype")), ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*missing field `dtype`"),
    ("safetensors_offsets_reversed",
     lambda d: _header(d, lambda h: h[_first_tensor(h)].update(data_offsets=[8, 4])),
     ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*invalid offset for tensor `.+`"),
    ("safetensors_negative_dim",
     lambda d: _header(d, lambda h: h[_first_tensor(h)].update(shape=[-1, 4])),
     ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*integer `-1`, expected usize"),
    ("safetensors_shape_disagrees_with_bytes",
     lambda d: _header(d, lambda h: h["model.norm.weight"].update(shape=[3])), ValueError,
     r"model\.safetensors: not a valid safetensors file \(.*invalid shape, data type, or offset"),
    ("safetensors_unsupported_dtype",
     lambda d: _tensors(d, lambda t: t.update({"model.norm.weight": np.arange(64)})),
     ValueError, r"model\.safetensors: tensor model\.norm\.weight has dtype 'I64'.*expected one"),
    ("tensor_shape_mismatch",
     lambda d: _tensors(d, lambda t: t.update({"model.norm.weight": np.ones(65, np.float32)})),
     ValueError, r"tensor model\.norm\.weight has shape \(65,\), expected \(64,\)"),
    ("tensor_missing", lambda d: _tensors(d, lambda t: t.pop("model.norm.weight")), ValueError,
     r"tensor model\.norm\.weight is missing from the checkpoint"),
    ("tensor_unexpected",
     lambda d: _tensors(d, lambda t: t.update({"model.extra.weight": np.ones(2, np.float32)})),
     ValueError, r"unexpected tensors for qwen3 .*model\.extra\.weight"),
    ("no_safetensors", lambda d: (d / ST).unlink(), FileNotFoundError,
     r"no \*\.safetensors files in"),
    ("index_not_json",
     lambda d: (d / "model.safetensors.index.json").write_text("nope"), ValueError,
     r"model\.safetensors\.index\.json: not valid JSON.*weight_map"),
    ("index_weight_map_wrong_type", lambda d: _shard(d, ["a"]), ValueError,
     r"model\.safetensors\.index\.json: field 'weight_map' must map tensor names"),
    ("index_names_missing_shard", lambda d: _shard(d, {"model.norm.weight": "gone.safetensors"}),
     FileNotFoundError, r"model\.safetensors\.index\.json names shard gone\.safetensors"),
    ("generation_config_not_json",
     lambda d: (d / "generation_config.json").write_text("{"), ValueError,
     r"generation_config\.json: not valid JSON.*generation_config\.json"),
    ("generation_config_eos_wrong_type",
     lambda d: (d / "generation_config.json").write_text('{"eos_token_id": [0, "x"]}'),
     ValueError, r"generation_config\.json: field 'eos_token_id' must be a token id"),
]


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(("case", "breaker", "exc", "pattern"), CASES, ids=[c[0] for c in CASES])
def test_a_broken_checkpoint_names_file_and_field(hf_checkpoints, tmp_path, case, breaker, exc,
                                                   pattern):  # fmt: skip
    d = _copy(hf_checkpoints["qwen3"], tmp_path / "m")
    breaker(d)
    with pytest.raises(exc, match=pattern) as e:
        jdet.load(d)
    assert str(d) in str(e.value)  # the message names the file (by its path)


TOKENIZER_CASES = [
    ("tokenizer_json_not_json", "tokenizer.json", "{broken",
     r"tokenizer\.json: not valid JSON.*expected a Hugging Face tokenizer file"),
    ("tokenizer_config_not_json", "tokenizer_config.json", "[",
     r"tokenizer_config\.json: not valid JSON"),
    ("tokenizer_json_wrong_content", "tokenizer.json", '{"model": 5}',
     r"the tokenizer files \(tokenizer\.json, tokenizer_config\.json\) do not load"),
]


@pytest.mark.parametrize(("case", "name", "text", "pattern"), TOKENIZER_CASES,
                         ids=[c[0] for c in TOKENIZER_CASES])  # fmt: skip
def test_a_broken_tokenizer_names_the_file(with_tokenizer, tmp_path, case, name, text, pattern):
    d = _copy(with_tokenizer, tmp_path / "m")
    (d / name).write_text(text)
    with pytest.raises(ValueError, match=pattern) as e:
        jdet.load(d)
    assert str(d) in str(e.value)


def test_an_unsupported_dtype_argument_names_the_choices(hf_checkpoints):
    with pytest.raises(ValueError, match=r"dtype 'int8' is not supported; use one of"):
        jdet.load(hf_checkpoints["qwen3"], dtype="int8")


NATIVE_CASES = [
    ("marker_not_json", lambda d: (d / "jdet_checkpoint.json").write_text("{"), ValueError,
     r"jdet_checkpoint\.json: not valid JSON"),
    ("marker_bad_dtype", lambda d: (d / "jdet_checkpoint.json").write_text('{"dtype": "int4"}'),
     ValueError, r"jdet_checkpoint\.json: field 'dtype' must be one of"),
    ("params_missing", lambda d: shutil.rmtree(d / "params"), FileNotFoundError,
     r"params is missing: the checkpoint's weights are gone"),
    ("config_disagrees_with_saved_weights", lambda d: _config(d, intermediate_size=128),
     ValueError, r"params: the saved weights do not match .*config\.json"),
]


@pytest.fixture(scope="module")
def native_ckpt(hf_checkpoints, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("native") / "ckpt"
    jdet.save(jdet.load(hf_checkpoints["qwen3"], dtype="float32"), d)
    return d


@pytest.mark.parametrize(("case", "breaker", "exc", "pattern"), NATIVE_CASES,
                         ids=[c[0] for c in NATIVE_CASES])  # fmt: skip
def test_a_broken_jdet_checkpoint_names_file_and_field(native_ckpt, tmp_path, case, breaker, exc,
                                                       pattern):  # fmt: skip
    d = _copy(native_ckpt, tmp_path / "c")
    breaker(d)
    with pytest.raises(exc, match=pattern) as e:
        jdet.load(d)
    assert str(d) in str(e.value)


def test_the_unbroken_copies_load(hf_checkpoints, with_tokenizer, native_ckpt, tmp_path):
    """The control: the same copy without the break loads, so each failure above is the
    break's and not the copy's."""
    for i, src in enumerate([hf_checkpoints["qwen3"], with_tokenizer, native_ckpt]):
        m = jdet.load(_copy(src, tmp_path / str(i)), dtype="float32")
        assert m.params["embed"].shape[0] == m.cfg.vocab_size


def test_there_are_at_least_twenty_broken_checkpoint_cases():
    assert len(CASES) + len(TOKENIZER_CASES) + len(NATIVE_CASES) + 1 >= 20
