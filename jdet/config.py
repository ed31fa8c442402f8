"""Model configuration read from a Hugging Face `config.json`.

Why a frozen dataclass: the config is static under `jax.jit` (hashable, compared by value), so every
shape the compiled step sees comes from here and from the bucketed batch, never from data.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def rope_type(self) -> str:
        return dict(self.rope_scaling).get("rope_type", "default")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def rope_inv_freq(self) -> tuple[np.ndarray, float]:
        """Inverse frequencies [E/2] (f32) and the cos/sin scale, as transformers computes them."""
        return rope_inv_freq(self)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["rope_scaling"] = dict(self.rope_scaling)
        return d

    @classmethod
    def from_hf(cls, path: str | Path | dict) -> ModelConfig:
        """Build from a checkpoint directory, a config.json path, or its parsed dict."""
        if isinstance(path, dict):
            raw = path
            where = "config dict"
        else:
            p = Path(path)
            f = p / "config.json" if p.is_dir() else p
            if not f.exists():
                raise FileNotFoundError(
                    f"no config.json in {p}: a Hugging Face model directory (config.json + "
                    "*.safetensors) or a jdet checkpoint saved with jdet.save() is expected"
                )
            raw = json.loads(f.read_text())
            where = str(f)
        return _from_dict(raw, where)


def _req(raw: dict, key: str, where: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"{where}: required field '{key}' is missing")
    return raw[key]


def _from_dict(raw: dict, where: str) -> ModelConfig:
    mt = raw.get("model_type")
    if mt not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type {mt!r} is not supported; jdet supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (LlamaForCausalLM, MistralForCausalLM, "
            "Qwen2ForCausalLM, Qwen3ForCausalLM)"
        )
    hidden = int(_req(raw, "hidden_size", where))
    heads = int(_req(raw, "num_attention_heads", where))
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = raw.get("head_dim") or hidden // heads
    if raw.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")

    # RoPE: transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` and
    # `rope_scaling` with `type` or `rope_type`.
    rp = dict(raw.get("rope_parameters") or {})
    if isinstance(rp, dict) and "full_attention" in rp:
        rp = dict(rp["full_attention"])
    scaling = dict(raw.get("rope_scaling") or {})
    rp = {**scaling, **rp}
    theta = float(rp.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rtype = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {rtype!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (dynamic NTK scaling changes with the batch's "
            "longest sequence and so cannot be batch-invariant)"
        )
    rope_scaling = tuple(sorted({"rope_type": rtype, **rp}.items())) if rtype != "default" else ()

    if mt == "qwen2":
        qkv_bias, o_bias = True, False
    elif mt == "mistral":
        qkv_bias = o_bias = False
    else:
        qkv_bias = o_bias = bool(raw.get("attention_bias", False))

    sliding = None
    if mt == "mistral" or raw.get("use_sliding_window"):
        sliding = raw.get("sliding_window")
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    return ModelConfig(
        model_type=mt,
        vocab_size=int(_req(raw, "vocab_size", where)),
        hidden_size=hidden,
        intermediate_size=int(_req(raw, "intermediate_size", where)),
        num_layers=int(_req(raw, "num_hidden_layers", where)),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=mt == "qwen3",
        rope_scaling=rope_scaling,
        sliding_window=int(sliding) if sliding else None,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(dtype),
    )


def rope_inv_freq(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """RoPE inverse frequencies and attention scale, matching transformers' ROPE_INIT_FUNCTIONS.

    Computed in float32 like transformers so the cos/sin tables agree bit for bit in spirit.
    """
    dim = cfg.head_dim
    base = cfg.rope_theta
    p = dict(cfg.rope_scaling)
    rtype = p.get("rope_type", "default")
    exps = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    pos_freqs = np.power(np.float32(base), exps, dtype=np.float32)
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    scale = 1.0
    if rtype == "linear":
        inv = (inv / np.float32(p["factor"])).astype(np.float32)
    elif rtype == "llama3":
        factor = p["factor"]
        low_ff, high_ff = p["low_freq_factor"], p["high_freq_factor"]
        old_ctx = p["original_max_position_embeddings"]
        low_wl, high_wl = old_ctx / low_ff, old_ctx / high_ff
        wavelen = (2 * math.pi / inv).astype(np.float32)
        inv_l = np.where(wavelen > low_wl, inv / factor, inv).astype(np.float32)
        smooth = (old_ctx / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        inv = np.where(medium, smoothed, inv_l).astype(np.float32)
    elif rtype == "yarn":
        factor = p.get("factor")
        orig = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
        if factor is None:
            factor = cfg.max_position_embeddings / orig
        att = p.get("attention_factor")
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")

        def get_mscale(s: float, m: float = 1.0) -> float:
            return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

        if att is None:
            att = (
                get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
                if mscale and mscale_all
                else get_mscale(factor)
            )
        beta_fast = p.get("beta_fast") or 32
        beta_slow = p.get("beta_slow") or 1

        def corr_dim(rot: float) -> float:
            return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

        low, high = corr_dim(beta_fast), corr_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dim - 1)
        if low == high:
            high += 0.001
        ramp = np.clip(
            (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1
        ).astype(np.float32)
        extra_factor = (1 - ramp).astype(np.float32)
        inv_interp = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
        inv = (inv_interp * (1 - extra_factor) + inv * extra_factor).astype(np.float32)
        scale = float(att)
    return inv.astype(np.float32), scale
