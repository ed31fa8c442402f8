"""How XLA runs a small-M dot on a weight sliced from a layer stack inside `lax.scan`.

Why: the "none" mode (XLA's own matmuls) must be the fastest non-invariant path, and its decode
step was 2.3x slower than "tp" on the H100: XLA copied every layer's weights out of the stack
before its Triton GEMM read them (benchmarks/profile_step.py). This probe times a scan of L
layers of x[M, K] @ w[l][K, N] for each (output dtype, compiler options) and counts the copies
and converts in the compiled HLO, so the choice in jdet/step.py `xla_options` and jdet/ops.py
rests on a measurement.

    PYTHONPATH=. python -m benchmarks.scan_dot_probe --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

CONFIGS = {
    "default": {},
    "triton_off": {"xla_gpu_enable_triton_gemm": False},
    "dsf_on": {"xla_gpu_enable_dynamic_slice_fusion": True},
    "triton_off_dsf_on": {"xla_gpu_enable_triton_gemm": False,
                          "xla_gpu_enable_dynamic_slice_fusion": True},
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--n", type=int, default=14336)
    p.add_argument("--m", default="1,8")
    a = p.parse_args(argv)
    import jax
    import jax.numpy as jnp

    from benchmarks.timing import median_seconds

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    w = jax.random.normal(jax.random.PRNGKey(0), (a.layers, a.k, a.n), jnp.bfloat16)
    w2 = jax.random.normal(jax.random.PRNGKey(1), (a.layers, a.n, a.k), jnp.bfloat16)
    wbytes = 2 * w.nbytes
    rows = []
    for m in [int(x) for x in a.m.split(",")]:
        x = jax.random.normal(jax.random.PRNGKey(2), (m, a.k), jnp.bfloat16)
        for out_name in ("f32_then_cast", "bf16"):
            for cname, opts in CONFIGS.items():

                def body(h, ws, out_name=out_name):  # noqa: ANN001, ANN202
                    wa, wb = ws
                    if out_name == "bf16":
                        g = jnp.dot(h, wa)
                        y = jnp.dot(jax.nn.silu(g), wb)
                    else:
                        g = jnp.dot(h, wa, preferred_element_type=jnp.float32).astype(h.dtype)
                        y = jnp.dot(jax.nn.silu(g), wb, preferred_element_type=jnp.float32)
                        y = y.astype(h.dtype)
                    return h + y, None

                def f(h, wa, wb):  # noqa: ANN001, ANN202
                    return jax.lax.scan(body, h, (wa, wb))[0]

                row = {"m": m, "out": out_name, "config": cname}
                try:
                    jf = jax.jit(f, compiler_options=opts) if opts else jax.jit(f)
                    txt = jf.lower(x, w, w2).compile().as_text()
                    row["copies"] = len(re.findall(r" copy\(", txt))
                    row["converts_fusions"] = len(re.findall(r"convert_fusion", txt))
                    row["dynamic_slice_fusions"] = len(re.findall(r"dynamic_slice_fusion", txt))
                    row["gemm_fusions"] = len(re.findall(r"gemm_fusion_dot", txt))
                    row["cublas"] = len(re.findall(r"cublas", txt))
                    s = median_seconds(jf, x, w, w2, iters=5, reps=5, warmup=2)
                    row.update(ms=s * 1e3, GBps=wbytes / s / 1e9)
                except Exception as e:  # noqa: BLE001
                    row["error"] = str(e)[:400]
                rows.append(row)
                print(json.dumps(row), flush=True)
    (out / "scan_dot_probe.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
