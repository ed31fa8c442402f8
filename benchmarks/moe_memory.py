"""Device memory of the MoE benchmark, computed on the CPU from shapes only (jax.eval_shape):
does the Qwen3-30B-A3B shape fit one GPU in "tp" mode, whose layout pads every expert's width?

Terms, in bytes, of the bf16 model as a GPU engine holds it:
- `caller`: the weights as loaded (`jdet.params.abstract_params`);
- `engine`: the plan's layout (jdet/plan.py `pad_params`, `expand_kv_heads`, `fuse_projections`
  on Hopper; `matmul_weights` changes nothing on a GPU), from `jax.eval_shape`;
- `layout_peak_donated`: the largest live total while the engine lays the weights out with
  `donate_weights`, replayed in `prepare_params`' order: each new weight exists beside the
  model until the old one is released (jdet/plan.py `releaser`);
- `layout_peak_kept`: the same without donation: caller + engine for every replaced weight;
- `kv`: the KV pool the benchmark allocates.

    PYTHONPATH=. python -m benchmarks.moe_memory [--shape qwen3-30b-a3b] [--pages N]

`--step [MODE ...]` instead compiles a 16-token decode step on this device against abstract
weights and reports XLA's temporaries in GiB (`step_temp`): a step that would need more memory
than the weights leave shows here without allocating the model.

    PYTHONPATH=. python -m benchmarks.moe_memory --step tp none [--layers N]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

GB = 1e9
GiB = 1 << 30


def _nbytes(tree: Any, itemsize: int) -> dict[str, int]:
    import jax

    return {
        jax.tree_util.keystr(p): int(x.size) * itemsize
        for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def layout_bytes(cfg: Any, tp: int = 1, fuse: bool = True, itemsize: int = 2) -> dict:
    """The terms of the module docstring for `cfg` at `tp` (fuse: Hopper's layout)."""
    import jax
    import jax.numpy as jnp

    from jdet.params import abstract_params
    from jdet.plan import fuse_projections, pad_params
    from jdet.tp_layout import expand_kv_heads

    src = abstract_params(cfg, jnp.bfloat16)

    def layout(p: dict) -> dict:
        p = expand_kv_heads(pad_params(p, cfg), cfg, tp)
        return fuse_projections(p, tp) if fuse else p

    dst = jax.eval_shape(layout, src)
    a, b = _nbytes(src, itemsize), _nbytes(dst, itemsize)
    # prepare_params' order: the FFN pads (gate, up, down; dense then experts), lm_head,
    # the replicated kv heads, then the fused projections, each releasing what it replaced
    order = [n for n in ("w_gate", "w_up", "w_down", "expert_gate", "expert_up", "expert_down")
             if f"['layers']['{n}']" in a]  # fmt: skip
    steps = []  # (new bytes, released bytes)
    for n in order:
        k = f"['layers']['{n}']"
        if b.get(k, a[k]) != a[k]:
            steps.append((b[k], a[k]))
    if "['lm_head']" in a and b["['lm_head']"] != a["['lm_head']"]:
        steps.append((b["['lm_head']"], a["['lm_head']"]))
    elif "['lm_head']" not in a:  # tied: a new padded transpose, the embedding stays
        steps.append((b["['lm_head']"], 0))
    fused = {"wqkv": ("wq", "wk", "wv"), "w_gate_up": ("w_gate", "w_up")}
    for new, parts in fused.items():
        if f"['layers']['{new}']" in b:
            old = sum(b.get(f"['layers']['{p}']", a[f"['layers']['{p}']"]) for p in parts)
            steps.append((b[f"['layers']['{new}']"], old))
    live = peak = sum(a.values())
    for new, old in steps:
        peak = max(peak, live + new)
        live += new - old
    caller, engine = sum(a.values()), sum(b.values())
    shared = caller - sum(old for _, old in steps)  # kept as they are: one copy either way
    return {"caller": caller, "engine": engine, "layout_peak_donated": peak,
            "layout_peak_kept": caller + engine - shared, "after_layout_donated": live}  # fmt: skip


def plan(shape: str, num_pages: int, page: int = 16, fractions: tuple = (0.75, 0.9)) -> dict:
    """The memory plan of the benchmark's model and pool, with what fits a 141 GB H200."""
    from benchmarks.moe_bench import SHAPES
    from jdet.config import ModelConfig
    from jdet.kv_cache import kv_bytes_per_token

    raw = dict(SHAPES[shape], max_position_embeddings=1 << 15, torch_dtype="bfloat16")
    cfg = ModelConfig.from_hf(raw)
    out: dict = layout_bytes(cfg)
    out["kv"] = kv_bytes_per_token(cfg, "bfloat16") * num_pages * page
    out["steady_donated"] = out["after_layout_donated"] + out["kv"]
    device = 143_771 * (1 << 20)  # an H200's memory as CUDA reports it (MiB)
    for f in fractions:
        limit = int(device * f)
        out[f"fits_at_{f}"] = {
            "limit": limit,
            "donated": max(out["layout_peak_donated"], out["steady_donated"]) <= limit,
            "kept": out["layout_peak_kept"] + out["kv"] <= limit,
        }
    return out


def step_temp(shape: str, mode: str, tokens: int = 16, layers: int | None = None) -> dict:
    """XLA's memory analysis of one `tokens`-token decode step (batch 1, padded to `tokens`
    rows) of `shape` in `mode` on this process's device, compiled against abstract weights and
    pool (nothing allocated): its temporaries, which the engine's pool sizing counts
    (serving/engine/memory.py). `layers`: fewer layers than the shape's (a faster compile)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks import decode_bench as db
    from benchmarks.moe_bench import SHAPES
    from jdet.config import ModelConfig
    from jdet.params import abstract_params
    from jdet.plan import Plan, prepare_params
    from jdet.step import make_step_fn
    from sharding.mesh import make_tp_mesh
    from sharding.tp import make_tp_step

    raw = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    cfg = ModelConfig.from_hf(raw)
    params, plan_ = abstract_params(cfg, jnp.bfloat16), Plan(cfg, mode, 1)
    sb, si = db.decode_inputs(cfg, 1, 1024, db.pages_for(1024, 32), pad_tokens=tokens)
    spec = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), t)  # noqa: E731
    if plan_.sharded:
        params = jax.eval_shape(lambda p: prepare_params(p, cfg, 1, blocked=plan_.blocked),
                                params)  # fmt: skip
        fn = make_tp_step(cfg, mode, make_tp_mesh(1))
    else:
        fn = make_step_fn(cfg, plan_.ops())
    pool = (cfg.num_layers, cfg.num_kv_heads, db.pages_used(1024) + 64, db.PAGE, cfg.head_dim)
    kv = {n: jax.ShapeDtypeStruct(pool, jnp.bfloat16) for n in "kv"}
    m = fn.lower(params, kv, spec(sb), spec(si)).compile().memory_analysis()
    return {"mode": mode, "tokens": tokens, "layers": cfg.num_layers,
            "temp": int(m.temp_size_in_bytes),
            "weights": int(m.argument_size_in_bytes)}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="qwen3-30b-a3b")
    p.add_argument("--pages", type=int, default=5000)
    p.add_argument("--step", nargs="*", metavar="MODE",
                   help="instead: compile a 16-token decode step per mode (step_temp)")
    p.add_argument("--layers", type=int, help="with --step: fewer layers")
    a = p.parse_args()
    if a.step is not None:
        for mode in a.step or ["tp", "none"]:
            r = step_temp(a.shape, mode, layers=a.layers)
            print(json.dumps({k: round(v / GiB, 3) if k in ("temp", "weights") else v
                              for k, v in r.items()}), flush=True)  # fmt: skip
        return
    r = plan(a.shape, a.pages)
    print(json.dumps({k: (round(v / GB, 2) if isinstance(v, int) else v) for k, v in r.items()},
                     indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
