"""Loading a model: a Hugging Face directory (config.json, safetensors weights read by
jdet/hf_weights.py, the tokenizer) or a native orbax checkpoint written by `save`.

Every inconsistency (bad JSON in config.json / generation_config.json, a tokenizer that will not
load, a missing directory, and the weight errors of jdet/hf_weights.py) is a ValueError or
FileNotFoundError naming the file, the tensor or field, and what was expected.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.config import ModelConfig, read_json, token_ids
from jdet.hf_weights import load_hf_params
from jdet.models import ARCHITECTURES
from jdet.params import abstract_params
from jdet.tokenizer import fast_tokenizer

_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
NATIVE_MARKER = "jdet_checkpoint.json"
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"


@dataclasses.dataclass
class Model:
    """A loaded model: static config, params pytree (on device), tokenizer (or None)."""

    cfg: ModelConfig
    params: dict
    tokenizer: Any = None
    path: str | None = None
    hf_config: dict | None = None
    generation_config: dict | None = None  # generation_config.json as loaded (saved back too)

    @property
    def dtype(self) -> Any:
        return jax.tree_util.tree_leaves(self.params)[0].dtype

    @functools.cached_property
    def weights_hash(self) -> str:
        """Content hash of every weight (computed once, on demand: the fingerprint needs it)."""
        if any(getattr(x, "is_deleted", lambda: False)() for x in jax.tree.leaves(self.params)):
            raise ValueError(
                "this model's weights were given to an engine (donate_weights=True) and freed; "
                "read model.weights_hash before building the engine to fingerprint it"
            )
        h = hashlib.sha256()
        for path, leaf in sorted(
            jax.tree_util.tree_flatten_with_path(self.params)[0], key=lambda kv: str(kv[0])
        ):
            h.update(str(path).encode())
            h.update(np.asarray(jax.device_get(leaf)).tobytes())
        return h.hexdigest()[:16]


def resolve_dtype(dtype: Any) -> Any:
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not supported; use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    return dtype




def load_tokenizer(d: Path) -> Any:
    """The directory's tokenizer, or None if it has no tokenizer files at all."""
    files = ("tokenizer.json", "tokenizer_config.json")
    if not any((d / f).exists() for f in files):
        return None
    for f in (*files, "special_tokens_map.json"):
        if (d / f).exists():
            read_json(d / f, "a Hugging Face tokenizer file")
    fast = fast_tokenizer(d)  # same answers, without importing transformers (jdet/tokenizer.py)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer  # seconds to import: only where `tokenizers` cannot

    try:
        return AutoTokenizer.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; name the directory
        raise ValueError(
            f"{d}: the tokenizer files ({', '.join(f for f in files if (d / f).exists())}) do not "
            f"load ({type(e).__name__}: {str(e)[:300]}); fix or remove them (without tokenizer "
            "files the model takes token ids only)"
        ) from None


def load(
    path: str | Path | None = None, dtype: Any = "bfloat16", progress: bool | None = None
) -> Model:
    """Load a model directory: Hugging Face format or a jdet (orbax) checkpoint.

    With no path, the small model embedded in the package is returned.
    """
    d = Path(path) if path is not None else DEFAULT_MODEL_DIR
    if not d.exists():
        raise FileNotFoundError(f"model directory {d} does not exist")
    if not d.is_dir():
        raise NotADirectoryError(f"{d} is not a directory; pass the model's directory")
    dtype = resolve_dtype(dtype)
    if (d / NATIVE_MARKER).exists():
        return _load_native(d, dtype)
    if not (d / "config.json").exists():
        raise FileNotFoundError(
            f"{d} has no config.json: expected a Hugging Face model directory (config.json + "
            "*.safetensors) or a checkpoint written by jdet.save()"
        )
    raw = read_json(d / "config.json", "a Hugging Face config.json")
    gen = _generation_config(d)
    cfg = _with_generation_eos(ModelConfig.from_hf(d / "config.json"), gen, d)
    params = load_hf_params(d, cfg, dtype, progress)
    return Model(cfg=cfg, params=params, tokenizer=load_tokenizer(d), path=str(d), hf_config=raw,
                 generation_config=gen)  # fmt: skip


def save(model: Model, path: str | Path) -> Path:
    """Save natively: orbax params + config.json + generation_config.json (the EOS ids, which
    change where generation stops) + tokenizer files with the chat template; `load(path)` reads
    it back to a model with the same bits and the same `system_fingerprint`. Relative paths
    are fine (orbax wants absolute ones; they are resolved here)."""
    import orbax.checkpoint as ocp  # a slow import: native checkpoints only

    d = Path(path).absolute()
    d.mkdir(parents=True, exist_ok=True)
    raw = model.hf_config or _hf_config_from(model.cfg)
    (d / "config.json").write_text(json.dumps(raw, indent=2))
    gen = dict(model.generation_config or {})
    cfg_eos = list(ModelConfig.from_hf(raw).eos_token_ids)
    if list(model.cfg.eos_token_ids) != cfg_eos or gen:
        # what load() merges back into cfg.eos_token_ids: config.json's ids, then these
        gen["eos_token_id"] = list(model.cfg.eos_token_ids)
        (d / "generation_config.json").write_text(json.dumps(gen, indent=2))
    ckpt = ocp.StandardCheckpointer()
    target = d / "params"
    if target.exists():
        shutil.rmtree(target)
    ckpt.save(target, model.params)
    ckpt.wait_until_finished()
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(d))
    meta = {"format": "jdet-orbax", "version": 1, "dtype": str(model.dtype)}
    (d / NATIVE_MARKER).write_text(json.dumps(meta))
    return d


def _load_native(d: Path, dtype: Any) -> Model:
    import orbax.checkpoint as ocp  # a slow import: native checkpoints only

    d = d.absolute()  # orbax refuses relative paths
    raw = read_json(d / "config.json", "the config.json written by jdet.save()")
    cfg = ModelConfig.from_hf(d / "config.json")
    gen = _generation_config(d)
    cfg = _with_generation_eos(cfg, gen, d)
    meta = read_json(d / NATIVE_MARKER, "the marker jdet.save() writes")
    saved_dtype = meta.get("dtype", "bfloat16") if isinstance(meta, dict) else None
    if saved_dtype not in _DTYPES:
        raise ValueError(
            f"{d / NATIVE_MARKER}: field 'dtype' must be one of {sorted(_DTYPES)}, got "
            f"{saved_dtype!r}"
        )
    if not (d / "params").is_dir():
        raise FileNotFoundError(f"{d / 'params'} is missing: the checkpoint's weights are gone")
    target = abstract_params(cfg, jnp.dtype(saved_dtype))
    try:
        params = ocp.StandardCheckpointer().restore(d / "params", target)
    except Exception as e:  # noqa: BLE001 - orbax raises many kinds; name the checkpoint
        raise ValueError(
            f"{d / 'params'}: the saved weights do not match {d / 'config.json'} or are damaged "
            f"({type(e).__name__}: {str(e)[:300]})"
        ) from None
    if jnp.dtype(saved_dtype) != jnp.dtype(dtype):
        params = jax.tree_util.tree_map(lambda x: x.astype(dtype), params)
    return Model(cfg=cfg, params=params, tokenizer=load_tokenizer(d), path=str(d), hf_config=raw,
                 generation_config=gen)  # fmt: skip


def _generation_config(d: Path) -> dict | None:
    f = d / "generation_config.json"
    if not f.exists():
        return None
    gen = read_json(f, "a Hugging Face generation_config.json")
    if not isinstance(gen, dict):
        raise ValueError(f"{f}: expected a JSON object, got {type(gen).__name__}")
    token_ids(gen.get("eos_token_id"), "eos_token_id", str(f))
    return gen


def _with_generation_eos(cfg: ModelConfig, gen: dict | None, d: Path) -> ModelConfig:
    """Add generation_config.json's eos ids (HF models often keep the chat EOS only there)."""
    if not gen:
        return cfg
    extra = token_ids(gen.get("eos_token_id"), "eos_token_id", str(d / "generation_config.json"))
    ids = tuple(dict.fromkeys([*cfg.eos_token_ids, *extra]))
    return dataclasses.replace(cfg, eos_token_ids=ids)


def _hf_config_from(cfg: ModelConfig) -> dict:
    arch = ARCHITECTURES[cfg.model_type].hf_class
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **dict(cfg.rope_scaling)}
    return {
        **_moe_config_from(cfg),
        "architectures": [arch],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.qkv_bias,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": list(cfg.eos_token_ids) if cfg.eos_token_ids else None,
    }


def _moe_config_from(cfg: ModelConfig) -> dict:
    """The expert fields of config.json that give back `cfg`'s (jdet/config.py `_moe_fields`):
    Qwen3-MoE's sparse layers as every layer but `mlp_only_layers`."""
    if not cfg.is_moe:
        return {}
    if cfg.moe == "mixtral":  # its experts are intermediate_size wide
        return {"num_local_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.num_experts_per_tok}  # fmt: skip
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(cfg.dense_layers),
    }
