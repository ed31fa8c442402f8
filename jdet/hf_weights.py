"""Reading a Hugging Face checkpoint's weights: safetensors files (single or index-sharded) into
jdet's params tree (jdet/params.py `weight_specs`: per-layer tensors stacked in the scan layout).

Why a hand-rolled safetensors reader: the format is a JSON header plus raw little-endian bytes, so
`np.memmap` gives zero-copy views of every tensor (bf16 through ml_dtypes), the per-layer tensors
are stacked on the host into the scan layout, and each stacked weight goes to the device once.
Every inconsistency (missing, unexpected, wrong shape, truncated file, corrupt header, a bad shard
index) is a ValueError or FileNotFoundError naming the file, the tensor and what was expected.
(The `safetensors` library's numpy reader has no bfloat16, which most checkpoints use.)
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jdet.config import ModelConfig, read_json
from jdet.params import full_shape, set_path, weight_specs

_ST_DTYPES = {
    "BF16": ml_dtypes.bfloat16,
    "F16": np.float16,
    "F32": np.float32,
    "F64": np.float64,
}
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
