"""Loading a model: Hugging Face safetensors (single or sharded) or a native orbax checkpoint.

Why a hand-rolled safetensors reader: the format is a JSON header plus raw little-endian bytes, so
`np.memmap` gives zero-copy views of every tensor (bf16 through ml_dtypes), the per-layer tensors
are stacked on the host into the scan layout, and each stacked weight goes to the device once.
Every inconsistency (missing, unexpected, wrong shape, truncated file, corrupt header, bad JSON
in config.json / generation_config.json / the shard index, a tokenizer that will not load) is a
ValueError or FileNotFoundError naming the file, the tensor or field, and what was expected.
(The `safetensors` library's numpy reader has no bfloat16, which most checkpoints use.)
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jdet.config import ModelConfig, read_json, token_ids
from jdet.params import full_shape, set_path, weight_specs

_ST_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}
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


_MAX_HEADER = 100 << 20  # the format's own limit on the JSON header (100 MB)


class _SafetensorsFile:
    """One .safetensors file: its header checked entry by entry, tensors as memmap views."""

    def __init__(self, path: Path):
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(
                    f"{path}: not a safetensors file ({size} bytes, shorter than the 8-byte "
                    "header length); re-download or re-save it"
                )
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER:
                raise ValueError(
                    f"{path}: corrupt or truncated safetensors file: the header claims {n} bytes "
                    f"but the file has {size}"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{path}: corrupt safetensors header (not valid JSON: {e}); re-download or "
                "re-save the file"
            ) from None
        if not isinstance(header, dict):
            raise ValueError(f"{path}: corrupt safetensors header (not a JSON object)")
        header.pop("__metadata__", None)
        for name, info in header.items():
            self._check_entry(name, info, size - 8 - n)
        self.header = header
        self.data_start = 8 + n
        self.size = size
        self.mm = np.memmap(path, dtype=np.uint8, mode="r") if size > 8 + n else None

    def _check_entry(self, name: str, info: Any, data_bytes: int) -> None:
        bad = f"{self.path}: tensor {name!r} has a corrupt header entry"
        if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= set(info):
            raise ValueError(f"{bad} (expected dtype, shape and data_offsets), got {info!r:.200}")
        shape, offs = info["shape"], info["data_offsets"]
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise ValueError(f"{bad}: shape must be a list of non-negative ints, got {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1]
        ):
            raise ValueError(f"{bad}: data_offsets must be [begin, end], got {offs!r}")
        if offs[1] > data_bytes:
            raise ValueError(
                f"{self.path}: tensor {name} ends at byte {8 + offs[1]} of the data but the file "
                f"has {data_bytes} data bytes (truncated file?)"
            )

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in _ST_DTYPES:
            raise ValueError(
                f"{self.path}: tensor {name} has dtype {info['dtype']!r}, which jdet cannot load; "
                f"expected one of {sorted(_ST_DTYPES)}"
            )
        dt = np.dtype(_ST_DTYPES[info["dtype"]])
        b, e = info["data_offsets"]
        shape = tuple(info["shape"])
        if e - b != dt.itemsize * int(np.prod(shape)):
            raise ValueError(
                f"{self.path}: tensor {name} has {e - b} bytes but shape {shape} of "
                f"{info['dtype']} needs {dt.itemsize * int(np.prod(shape))}"
            )
        if e == b:
            return np.zeros(shape, dt)
        return self.mm[self.data_start + b : self.data_start + e].view(dt).reshape(shape)


def _open_safetensors(d: Path) -> dict[str, _SafetensorsFile]:
    """Map tensor name -> the file holding it (single file or index-sharded)."""
    index = d / "model.safetensors.index.json"
    files: dict[str, _SafetensorsFile] = {}
    if index.exists():
        raw = read_json(index, 'a shard index {"weight_map": {tensor: file}}')
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) for f in weight_map.values()
        ):
            raise ValueError(
                f"{index}: field 'weight_map' must map tensor names to file names, got "
                f"{weight_map!r:.200}"
            )
        opened: dict[str, _SafetensorsFile] = {}
        for name, fname in weight_map.items():
            if Path(fname).name != fname:
                raise ValueError(f"{index}: shard {fname!r} must be a file name in {d}")
            if fname not in opened:
                fp = d / fname
                if not fp.exists():
                    raise FileNotFoundError(f"{index} names shard {fname}, which is missing")
                opened[fname] = _SafetensorsFile(fp)
            if name not in opened[fname].header:
                raise ValueError(f"{index} places tensor {name} in {fname}, which lacks it")
            files[name] = opened[fname]
        return files
    paths = sorted(d.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    for p in paths:
        f = _SafetensorsFile(p)
        for name in f.header:
            files[name] = f
    return files


def load_hf_params(d: Path, cfg: ModelConfig, dtype: Any, progress: bool | None = None) -> dict:
    files = _open_safetensors(d)
    specs = weight_specs(cfg)
    expected = set()
    for s in specs:
        names = (
            [s.hf_name.format(i=i) for i in range(cfg.num_layers)] if s.per_layer else [s.hf_name]
        )
        expected.update(names)
    # Some checkpoints of tied models still carry lm_head.weight; it must equal the embedding.
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = sorted(
        n for n in files if n not in expected and n not in ignorable and "rotary_emb" not in n
    )
    if unexpected:
        raise ValueError(
            f"{d}: unexpected tensors for {cfg.model_type} (first: {unexpected[:3]}); the "
            "checkpoint does not match its config.json"
        )
    total = sum(cfg.num_layers if s.per_layer else 1 for s in specs)
    if progress is None:
        progress = sum(f.size for f in {id(f): f for f in files.values()}.values()) > 1 << 30
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total, desc=f"loading {d.name}", unit="tensor")
    params: dict = {}
    np_dtype = np.dtype(dtype)
    for s in specs:
        names = (
            [s.hf_name.format(i=i) for i in range(cfg.num_layers)] if s.per_layer else [s.hf_name]
        )
        want = tuple(reversed(s.shape)) if s.transpose else s.shape
        out = np.empty(full_shape(cfg, s), np_dtype)
        for i, name in enumerate(names):
            if name not in files:
                raise ValueError(f"{d}: tensor {name} is missing from the checkpoint")
            t = files[name].get(name)
            if t.shape != want:
                raise ValueError(
                    f"{d}: tensor {name} has shape {t.shape}, expected {want} from config.json"
                )
            t = t.T if s.transpose else t
            if s.per_layer:
                out[i] = t.astype(np_dtype)
            else:
                out[...] = t.astype(np_dtype)
            if bar is not None:
                bar.update(1)
        set_path(params, s.path, jnp.asarray(out))
    if bar is not None:
        bar.close()
    return params


def load_tokenizer(d: Path) -> Any:
    """The directory's tokenizer, or None if it has no tokenizer files at all."""
    files = ("tokenizer.json", "tokenizer_config.json")
    if not any((d / f).exists() for f in files):
        return None
    for f in (*files, "special_tokens_map.json"):
        if (d / f).exists():
            read_json(d / f, "a Hugging Face tokenizer file")
    from transformers import AutoTokenizer

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
    import orbax.checkpoint as ocp

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
        import shutil

        shutil.rmtree(target)
    ckpt.save(target, model.params)
    ckpt.wait_until_finished()
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(d))
    meta = {"format": "jdet-orbax", "version": 1, "dtype": str(model.dtype)}
    (d / NATIVE_MARKER).write_text(json.dumps(meta))
    return d


def _load_native(d: Path, dtype: Any) -> Model:
    import orbax.checkpoint as ocp

    d = d.absolute()  # orbax refuses relative paths
    raw = read_json(d / "config.json", "the config.json written by jdet.save()")
    cfg = ModelConfig.from_hf(d / "config.json")
    gen = _generation_config(d)
    cfg = _with_generation_eos(cfg, gen, d)
    from jdet.params import abstract_params

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
    from jdet.models import ARCHITECTURES

    arch = ARCHITECTURES[cfg.model_type].hf_class
    rope = {"rope_theta": cfg.rope_theta, "rope_type": "default", **dict(cfg.rope_scaling)}
    return {
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
