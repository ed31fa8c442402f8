"""Decode-shaped projections as the step runs them: which split of the tree matmul is fastest?

Each projection of a model shape runs in a `lax.scan` over L stacked weights (so every layer's
weight streams from HBM and is read in place, as in the step), on 64 padded rows (`Ops.row_pad` at
batch 1). Variants: XLA's dot (no XLA options: in a scan it copies each weight first, see
jdet/step.py `xla_options`, so not a fair "none"), the BIO kernel, and the Mosaic tree kernel at
every leaf-group size (`subtree` 1..num_leaves on the 64-row decode CTA) plus `tree_strategy`'s own
choice. Per layer: wall time and, from a device trace, kernel busy time (which includes the
probe's two small add fusions, ~2.5 us). The tree variants' bits are compared: the group size
moves work between CTAs, never an addition, so they must be equal.

    PYTHONPATH=. python -m benchmarks.split_probe [--models 8b,0.6b] [--out OUT]  (Hopper only)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import numpy as np

SHAPES = {
    "8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
           ("down", 14336, 4096)],
    "0.6b": [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144),
             ("down", 3072, 1024)],
}  # fmt: skip
LAYERS = {"8b": 32, "0.6b": 28}
ROWS = 64


def variants(k: int, n: int) -> tuple[dict, object]:
    import jax.numpy as jnp

    from pallas_kernels import matmul_mosaic, tree_mosaic
    from pallas_kernels.tree_matmul import tree_plan

    plan = tree_plan(k, jnp.dtype(jnp.bfloat16))
    bf16 = jnp.bfloat16
    out = {
        "xla": lambda a, w: jnp.dot(a, w, preferred_element_type=jnp.float32).astype(a.dtype),
        "bio": lambda a, w: matmul_mosaic.matmul(a, w, bf16),
    }
    s = 1
    while s <= plan.num_leaves:
        out[f"tree_s{s}"] = functools.partial(
            tree_mosaic.tree_matmul, out_dtype=bf16, k_total=k, num_leaves=plan.num_leaves,
            subtree=s, small=True,
        )  # fmt: skip
        s *= 2
    out["tree_default"] = lambda a, w: tree_mosaic.tree_matmul(
        a, w, bf16, k_total=k, num_leaves=plan.num_leaves
    )
    return out, plan


def measure(f, a, w_stack, layers: int) -> dict:
    import jax
    import jax.numpy as jnp
    from jax import lax

    from benchmarks.profile_step import trace_loop

    def scan(a, ws):
        def body(c, w):
            return c + f(a, w)[:, :128].astype(jnp.float32), None

        return lax.scan(body, jnp.zeros((a.shape[0], 128), jnp.float32), ws)[0]

    g = jax.jit(scan)
    jax.block_until_ready(g(a, w_stack))
    ts = []
    for _ in range(7):
        t0 = time.perf_counter()
        jax.block_until_ready(g(a, w_stack))
        ts.append(time.perf_counter() - t0)
    tr = trace_loop(lambda: jax.block_until_ready(g(a, w_stack)), 3)
    busy = tr["device"]["busy_ms_per_step"] / layers * 1e3
    top = [(t["name"][:50], round(t["us_per_step"] / layers, 2)) for t in tr["top_kernels"][:4]]
    return {"wall_us": round(float(np.median(ts)) / layers * 1e6, 2), "busy_us": round(busy, 2),
            "top": top}  # fmt: skip


def probe(models: list[str], out_dir: str) -> dict:
    import jax
    import jax.numpy as jnp

    res: dict = {"jax": jax.__version__, "device": jax.devices()[0].device_kind, "rows": ROWS,
                 "shapes": []}  # fmt: skip
    for model in models:
        for name, k, n in SHAPES[model]:
            layers = LAYERS[model]
            ws = jax.random.normal(jax.random.PRNGKey(k + n), (layers, k, n), jnp.bfloat16) * 0.02
            a = jax.random.normal(jax.random.PRNGKey(1), (ROWS, k), jnp.bfloat16)
            fns, plan = variants(k, n)
            row = {"model": model, "proj": name, "k": k, "n": n, "layers": layers,
                   "bytes_per_layer": k * n * 2, "leaves": plan.num_leaves, "v": {}}  # fmt: skip
            ref = None
            for vn, f in fns.items():
                try:
                    rec = measure(f, a, ws, layers)
                    rec["tbps_busy"] = round(k * n * 2 / (rec["busy_us"] * 1e-6) / 1e12, 3)
                    if vn.startswith("tree"):
                        y = np.asarray(jax.jit(f)(a, ws[3]))
                        ref = y if ref is None else ref
                        rec["bits_equal_other_trees"] = bool(np.array_equal(ref, y))
                except Exception as e:  # noqa: BLE001 - a config the kernel cannot build
                    rec = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                row["v"][vn] = rec
                print(model, name, vn, json.dumps(rec), flush=True)
            res["shapes"].append(row)
            del ws
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "split_probe.json"), "w") as fh:
                json.dump(res, fh, indent=1)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="8b,0.6b")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args(argv)
    probe(a.models.split(","), a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
