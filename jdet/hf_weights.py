"""Reading a Hugging Face checkpoint's weights: safetensors files (single or index-sharded) into
jdet's params tree (jdet/params.py `weight_specs`: per-layer tensors stacked in the scan layout).

The files are read by the `safetensors` library (`safe_open(framework="numpy")`: it validates the
header, memory-maps the file and copies out one tensor at a time; bfloat16 arrives as ml_dtypes'
bfloat16, which numpy knows once ml_dtypes is imported, safetensors >= 0.5). The per-layer tensors
are stacked on the host into the scan layout, and each stacked weight goes to the device once.
Every inconsistency (missing, unexpected, wrong shape or dtype, a file the library refuses: a
truncated file, a corrupt header, a bad shard index) is a ValueError or FileNotFoundError naming
the file, the tensor where there is one, and what was expected.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for safetensors' numpy reader)
import numpy as np
from safetensors import SafetensorError, safe_open
from tqdm import tqdm

from jdet.config import ModelConfig, read_json
from jdet.params import WeightSpec, full_shape, set_path, spec_layers, weight_specs

_ST_DTYPES = ("BF16", "F16", "F32", "F64")  # the float dtypes a checkpoint's weights may have


class _SafetensorsFile:
    """One .safetensors file opened by the library; its errors name the file and say what to do."""

    def __init__(self, path: Path):
        self.path = path
        self.size = path.stat().st_size
        try:
            self._f = safe_open(str(path), framework="numpy")
            self.names = set(self._f.keys())
        except SafetensorError as e:
            raise ValueError(
                f"{path}: not a valid safetensors file ({e}); re-download or re-save it"
            ) from None

    def get(self, name: str) -> np.ndarray:
        dtype = self._f.get_slice(name).get_dtype()
        if dtype not in _ST_DTYPES:
            raise ValueError(
                f"{self.path}: tensor {name} has dtype {dtype!r}, which jdet cannot load; "
                f"expected one of {sorted(_ST_DTYPES)}"
            )
        return self._f.get_tensor(name)


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
            if name not in opened[fname].names:
                raise ValueError(f"{index} places tensor {name} in {fname}, which lacks it")
            files[name] = opened[fname]
        return files
    paths = sorted(d.glob("*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no *.safetensors files in {d}")
    for p in paths:
        f = _SafetensorsFile(p)
        for name in f.names:
            files[name] = f
    return files


def _stack_names(cfg: ModelConfig, s: WeightSpec) -> list[list[str]]:
    """Per stack position, the HF tensor names it is read from (one per expert for experts)."""
    if not s.per_layer:
        return [[s.hf_name]]
    return [
        [s.hf_name.format(i=i, e=e) for e in range(s.experts)] if s.experts
        else [s.hf_name.format(i=i)]
        for i in spec_layers(cfg, s)
    ]  # fmt: skip


def _fused_names(cfg: ModelConfig, s: WeightSpec) -> list[str]:
    return [s.fused_hf[0].format(i=i) for i in spec_layers(cfg, s)] if s.fused_hf else []


def _read(files: dict, d: Path, name: str, want: tuple[int, ...]) -> np.ndarray:
    if name not in files:
        raise ValueError(f"{d}: tensor {name} is missing from the checkpoint")
    t = files[name].get(name)
    if t.shape != want:
        raise ValueError(
            f"{d}: tensor {name} has shape {t.shape}, expected {want} from config.json"
        )
    return t


def _layer_tensor(files: dict, d: Path, s: WeightSpec, names: list[str], fused: str | None
                  ) -> np.ndarray:  # fmt: skip
    """One stack position of `s` in jdet's layout: read whole, per expert, or sliced from
    transformers' fused expert tensor (`WeightSpec.fused_hf`) when the checkpoint holds that."""
    if fused is not None and fused in files and names[0] not in files:
        _, part, parts = s.fused_hf
        per = tuple(reversed(s.shape[-2:])) if s.transpose else s.shape[-2:]
        lead = s.shape[:-2]
        t = _read(files, d, fused, (*lead, per[0] * parts, per[1]))
        t = t[..., part * per[0] : (part + 1) * per[0], :]
        return np.swapaxes(t, -1, -2) if s.transpose else t
    shape = s.shape[1:] if s.experts else s.shape
    want = tuple(reversed(shape)) if s.transpose else shape
    ts = [_read(files, d, n, want) for n in names]
    ts = [t.T if s.transpose else t for t in ts]
    return np.stack(ts) if s.experts else ts[0]


def load_hf_params(d: Path, cfg: ModelConfig, dtype: Any, progress: bool | None = None) -> dict:
    files = _open_safetensors(d)
    specs = weight_specs(cfg)
    expected = set()
    for s in specs:
        expected.update(n for names in _stack_names(cfg, s) for n in names)
        expected.update(_fused_names(cfg, s))
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
    total = sum(len(_stack_names(cfg, s)) for s in specs)
    if progress is None:
        progress = sum(f.size for f in {id(f): f for f in files.values()}.values()) > 1 << 30
    bar = None
    if progress:
        bar = tqdm(total=total, desc=f"loading {d.name}", unit="tensor")
    params: dict = {}
    np_dtype = np.dtype(dtype)
    for s in specs:
        out = np.empty(full_shape(cfg, s), np_dtype)
        fused = _fused_names(cfg, s) or [None] * len(out)
        for i, names in enumerate(_stack_names(cfg, s)):
            t = _layer_tensor(files, d, s, names, fused[i] if s.per_layer else None)
            if s.per_layer:
                out[i] = t.astype(np_dtype)
            else:
                out[...] = t.astype(np_dtype)
            if bar is not None:
                bar.update(1)
        # device_put, not jnp.asarray: the latter compiles a copy program per weight shape
        # (a compile for each of the embedded model's 8 shapes in a cold `jdet generate`)
        set_path(params, s.path, jax.device_put(out))
    if bar is not None:
        bar.close()
    return params
