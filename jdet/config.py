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

from jdet.models import ARCHITECTURES

SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)  # jdet/models: where a new architecture goes
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
    # Mixture of experts (num_experts 0: a dense model). The layers in `sparse_layers` run the
    # expert FFN (num_experts experts of moe_intermediate_size, num_experts_per_tok per token,
    # top-k probabilities renormalised to sum 1 when norm_topk_prob); the others the dense MLP
    # of intermediate_size. `moe` names the checkpoint's expert layout (jdet/models).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    moe: str | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.num_experts and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                f"[1, num_experts={self.num_experts}]"
            )
        if any(not 0 <= i < self.num_layers for i in self.sparse_layers):
            raise ValueError(f"sparse_layers {self.sparse_layers} must be layers of the model")

    @property
    def is_moe(self) -> bool:
        """Whether any layer runs the expert FFN."""
        return bool(self.sparse_layers)

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """The layers whose FFN is the dense MLP (every layer of a dense model)."""
        return tuple(i for i in range(self.num_layers) if i not in self.sparse_layers)

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
        if not self.is_moe:  # a dense model's dict (and fingerprint) as before MoE existed
            for k in MOE_FIELDS:
                d.pop(k)
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
            raw = read_json(f, "a Hugging Face config.json")
            where = str(f)
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(raw).__name__}")
        return _from_dict(raw, where)


INT32_MAX = 2**31 - 1  # positions and token ids travel as int32
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "sparse_layers", "moe")  # fmt: skip


def read_json(f: Path, what: str) -> Any:
    """Parse a JSON file; a broken one is an error naming the file and saying what it should be."""
    try:
        return json.loads(f.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: not valid JSON ({e}); expected {what}") from None


def _req(raw: dict, key: str, where: str) -> Any:
    if raw.get(key) is None:
        raise ValueError(f"{where}: required field '{key}' is missing")
    return raw[key]


def _int(raw: dict, key: str, where: str, default: Any = None, lo: int = 1) -> int:
    """A whole-number field (an integral float such as 4096.0 is accepted), at least `lo`."""
    v = _req(raw, key, where) if default is None else raw.get(key, default)
    if v is None:
        v = default
    ok = isinstance(v, int) and not isinstance(v, bool)
    if isinstance(v, float) and v.is_integer():
        v, ok = int(v), True
    if not ok or not lo <= v <= INT32_MAX:
        raise ValueError(
            f"{where}: field '{key}' must be an integer in [{lo}, {INT32_MAX}], got {v!r}"
        )
    return v


def _num(raw: dict, key: str, where: str, default: float, positive: bool = True) -> float:
    v = raw.get(key, default)
    if v is None:
        v = default
    if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or (
        positive and v <= 0
    ):
        raise ValueError(f"{where}: field '{key}' must be a finite number > 0, got {v!r}")
    return float(v)


def _bool(raw: dict, key: str, where: str, default: bool) -> bool:
    v = raw.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ValueError(f"{where}: field '{key}' must be true or false, got {v!r}")
    return v


def token_ids(v: Any, key: str, where: str) -> tuple[int, ...]:
    """An `eos_token_id`-style field: null, one id or a list of ids (each a non-negative int)."""
    items = v if isinstance(v, list) else ([] if v is None else [v])
    for t in items:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t <= INT32_MAX:
            raise ValueError(
                f"{where}: field '{key}' must be a token id or a list of token ids, got {v!r}"
            )
    return tuple(items)


_ROPE_NEEDS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (),
}


def _from_dict(raw: dict, where: str) -> ModelConfig:
    mt = raw.get("model_type")
    if mt not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{where}: model_type {mt!r} is not supported; jdet supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} "
            f"({', '.join(a.hf_class for a in ARCHITECTURES.values())})"
        )
    arch = ARCHITECTURES[mt]
    hidden = _int(raw, "hidden_size", where)
    heads = _int(raw, "num_attention_heads", where)
    kv_heads = _int(raw, "num_key_value_heads", where, default=heads)
    if raw.get("head_dim") is None and hidden % heads:
        raise ValueError(
            f"{where}: hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
            "and no head_dim is given"
        )
    head_dim = _int(raw, "head_dim", where, default=hidden // heads)
    if heads % kv_heads:
        raise ValueError(
            f"{where}: num_attention_heads ({heads}) must be a multiple of "
            f"num_key_value_heads ({kv_heads})"
        )
    if _bool(raw, "mlp_bias", where, False):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    if raw.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")

    # RoPE: transformers 5 writes `rope_parameters` (theta inside); older configs `rope_theta` and
    # `rope_scaling` with `type` or `rope_type`.
    for key in ("rope_parameters", "rope_scaling"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{where}: field '{key}' must be an object, got {raw[key]!r}")
    rp = dict(raw.get("rope_parameters") or {})
    if isinstance(rp.get("full_attention"), dict):
        rp = dict(rp["full_attention"])
    scaling = dict(raw.get("rope_scaling") or {})
    rp = {**scaling, **rp}
    theta = _num({"rope_theta": rp.pop("rope_theta", None) or raw.get("rope_theta")},
                 "rope_theta", where, 10000.0)  # fmt: skip
    rtype = rp.pop("rope_type", None) or rp.pop("type", None) or "default"
    rp.pop("type", None)
    if rtype not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {rtype!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)} (dynamic NTK scaling changes with the batch's "
            "longest sequence and so cannot be batch-invariant)"
        )
    for k in _ROPE_NEEDS.get(rtype, ()):
        _req(rp, k, f"{where} (rope {rtype})")
        _num(rp, k, f"{where} (rope {rtype})", 1.0)
    for k in ("factor", "attention_factor", "beta_fast", "beta_slow"):
        if k in rp and rp[k] is not None:
            _num(rp, k, f"{where} (rope {rtype})", 1.0)
    try:
        items = sorted({"rope_type": rtype, **rp}.items())
        rope_scaling = tuple(items) if rtype != "default" else ()
        hash(rope_scaling)
    except TypeError:
        raise ValueError(f"{where}: rope parameters must be numbers, got {rp!r}") from None

    qkv_bias, o_bias = arch.qkv_bias, arch.o_bias
    if qkv_bias is None or o_bias is None:
        bias = _bool(raw, "attention_bias", where, False)
        qkv_bias = bias if qkv_bias is None else qkv_bias
        o_bias = bias if o_bias is None else o_bias

    sliding = None
    if arch.sliding_window or raw.get("use_sliding_window"):
        sliding = _int(raw, "sliding_window", where, default=0, lo=0) or None
    eos_ids = token_ids(raw.get("eos_token_id"), "eos_token_id", where)
    bos = token_ids(raw.get("bos_token_id"), "bos_token_id", where)
    if len(bos) > 1:
        raise ValueError(f"{where}: field 'bos_token_id' must be one token id, got {bos!r}")
    dtype = raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"
    if not isinstance(dtype, str):
        raise ValueError(f"{where}: field 'torch_dtype' must be a string, got {dtype!r}")
    num_layers = _int(raw, "num_hidden_layers", where)
    moe = _moe_fields(raw, arch.moe, num_layers, where) if arch.moe else {}
    return ModelConfig(
        model_type=mt,
        vocab_size=_int(raw, "vocab_size", where),
        hidden_size=hidden,
        intermediate_size=_int(raw, "intermediate_size", where),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_num(raw, "rms_norm_eps", where, 1e-6),
        rope_theta=theta,
        max_position_embeddings=_int(raw, "max_position_embeddings", where, default=2048),
        tie_word_embeddings=_bool(raw, "tie_word_embeddings", where, False),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=arch.qk_norm,
        rope_scaling=rope_scaling,
        sliding_window=sliding,
        bos_token_id=bos[0] if bos else None,
        eos_token_ids=eos_ids,
        torch_dtype=dtype,
        **moe,
    )


def _moe_fields(raw: dict, layout: str, num_layers: int, where: str) -> dict[str, Any]:
    """The expert fields of a Qwen3-MoE or Mixtral config.json. Qwen3-MoE: layer i is sparse
    unless it is in `mlp_only_layers`, and only every `decoder_sparse_step`-th layer ((i + 1) %
    step == 0), as transformers' Qwen3MoeDecoderLayer decides; Mixtral: every layer, top-k
    always renormalised."""
    key = "num_local_experts" if layout == "mixtral" else "num_experts"
    if raw.get(key) is None:  # transformers 5 writes Qwen3-MoE's count as num_local_experts too
        key = "num_local_experts" if key == "num_experts" else "num_experts"
    experts = _int(raw, key, where, default=0, lo=0)
    top_k = _int(raw, "num_experts_per_tok", where, default=2 if layout == "mixtral" else 8)
    if layout == "mixtral":
        sparse = tuple(range(num_layers)) if experts else ()
        return dict(num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True,
                    moe_intermediate_size=_int(raw, "intermediate_size", where),
                    sparse_layers=sparse, moe=layout)  # fmt: skip
    step = _int(raw, "decoder_sparse_step", where, default=1)
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise ValueError(f"{where}: field 'mlp_only_layers' must be a list of layer indices")
    sparse = tuple(
        i for i in range(num_layers) if i not in only and experts > 0 and (i + 1) % step == 0
    )
    return dict(
        num_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_int(raw, "moe_intermediate_size", where),
        norm_topk_prob=_bool(raw, "norm_topk_prob", where, False),
        sparse_layers=sparse,
        moe=layout,
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
