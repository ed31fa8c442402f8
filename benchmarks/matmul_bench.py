"""matmul (BIO) and tree_matmul (TBIK) vs XLA's `a @ b` on Qwen3-8B layer shapes, one run.

For every (K, N) of Qwen3-8B and M in {1, 16, 128, 1024, 8192}: median time of XLA, matmul and
tree_matmul (bf16 in, bf16 out), their ratio to XLA's throughput, achieved TFLOP/s and GB/s
(A + B + C bytes), and the measured ceilings: XLA bf16 TFLOP/s on an 8192^3 product and HBM copy
GB/s. Writes `matmul_bench.json` into out_dir. Run: `python benchmarks/matmul_bench.py OUT_DIR`.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds

SHAPES = {  # name: (K, N)
    "qkv": (4096, 6144),
    "o": (4096, 4096),
    "gate_up": (4096, 24576),
    "down": (12288, 4096),
    "lm_head": (4096, 151936),
}
M_SIZES = (1, 16, 128, 1024, 8192)


def _time(fn, *args, iters: int = 20, reps: int = 5) -> float:
    """Median seconds per call (benchmarks.timing); every output of a batch stays alive."""
    return median_seconds(fn, *args, iters=iters, reps=reps, keep_outputs=True)


def _time_op(op, a, b, out_bytes: int) -> float:
    """Seconds per op(a, b), timed as one jitted program of R independent calls.

    Every call gets its own copy of a and b: no operand is shared (XLA's dot merger cannot batch
    them) and each call streams its weight from HBM like a real layer. R shrinks for big arrays.
    """
    r = int(min(16, 3e9 // max(out_bytes, 1), 8e9 // (a.nbytes + b.nbytes)))
    r = max(2, r)
    xs = [jax.random.normal(jax.random.PRNGKey(100 + i), a.shape, a.dtype) for i in range(r)]
    ys = [b + jnp.asarray(i, b.dtype) for i in range(r)]
    many = jax.jit(lambda xs, ys: [op(x, y) for x, y in zip(xs, ys, strict=True)])
    t = _time(many, xs, ys, iters=3, reps=5) / r
    del xs, ys
    return t


def ceilings(n: int = 8192, copy_elems: int = 1 << 29) -> dict:
    """XLA bf16 matmul TFLOP/s (n^3) and HBM copy GB/s (1 GiB read + 1 GiB write by default);
    smaller sizes give a CPU's figures in seconds (a smoke run's)."""
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    t = _time(jax.jit(lambda x, y: x @ y), a, a, iters=10)
    x = jax.random.normal(jax.random.PRNGKey(1), (copy_elems,), jnp.bfloat16)
    tc = _time(jax.jit(lambda v: v + jnp.bfloat16(1)), x, iters=10)
    return {"xla_bf16_tflops": 2 * n**3 / t / 1e12, "copy_gbps": 2 * x.nbytes / tc / 1e9}


def run(out_dir: str, shapes: dict | None = None, m_sizes=M_SIZES) -> dict:
    from pallas_kernels.matmul import matmul, resolve_backend
    from pallas_kernels.tree_matmul import tree_matmul

    dev = jax.devices()[0]
    result = {
        "device": dev.device_kind,
        "jax": jax.__version__,
        "backend": resolve_backend(None),
        "ceilings": ceilings(),
        "rows": [],
    }
    ceil = result["ceilings"]
    print(
        f"{dev.device_kind} jax {jax.__version__} backend={result['backend']} "
        f"ceilings: {ceil['xla_bf16_tflops']:.0f} TFLOP/s, {ceil['copy_gbps']:.0f} GB/s",
        flush=True,
    )
    fns = {
        "xla": jax.jit(lambda x, y: x @ y),
        "matmul": jax.jit(lambda x, y: matmul(x, y)),
        "tree_matmul": jax.jit(lambda x, y: tree_matmul(x, y)),
    }
    for name, (k, n) in (shapes or SHAPES).items():
        b = jax.random.normal(jax.random.PRNGKey(2), (k, n), jnp.bfloat16)
        for m in m_sizes:
            a = jax.random.normal(jax.random.PRNGKey(3), (m, k), jnp.bfloat16)
            flops, nbytes = 2 * m * k * n, 2 * (m * k + k * n + m * n)
            row = {"shape": name, "M": m, "K": k, "N": n}
            for impl, fn in fns.items():
                if impl == "tree_matmul" and 8 * m * n * 4 > (8 << 30):
                    row[impl] = {"skipped": "f32 leaf partials would exceed 8 GiB"}
                    continue
                try:
                    t = _time_op(fn, a, b, 2 * m * n)
                except Exception as e:  # noqa: BLE001 - record and go on
                    row[impl] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                row[impl] = {"us": t * 1e6, "tflops": flops / t / 1e12, "gbps": nbytes / t / 1e9}
            for impl in ("matmul", "tree_matmul"):
                if "us" in row.get(impl, {}) and "us" in row["xla"]:
                    row[impl]["vs_xla"] = row["xla"]["us"] / row[impl]["us"]
            result["rows"].append(row)
            print(_line(row, ceil), flush=True)
            del a
        del b
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "matmul_bench.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def _line(row: dict, ceil: dict) -> str:
    def cell(impl):
        r = row.get(impl, {})
        if "us" not in r:
            return f"{impl}: {next(iter(r.values()), '?')[:60]}"
        extra = f" x{r['vs_xla']:.2f}" if "vs_xla" in r else ""
        return (
            f"{impl} {r['us']:8.1f}us {r['tflops']:6.1f}TF "
            f"({r['tflops'] * 1e12 / (ceil['xla_bf16_tflops'] * 1e12):.2f} of peak) "
            f"{r['gbps']:6.0f}GB/s ({r['gbps'] / ceil['copy_gbps']:.2f} of copy){extra}"
        )

    return f"{row['shape']:8s} M={row['M']:5d} K={row['K']} N={row['N']}: " + " | ".join(
        cell(i) for i in ("xla", "matmul", "tree_matmul")
    )


def probe() -> None:
    """Smoke check of every kernel variant on one realistic shape: error, M=1 vs M=300 bits."""
    import numpy as np

    from pallas_kernels import tree_mosaic
    from pallas_kernels.matmul import matmul
    from pallas_kernels.tree_matmul import tree_matmul, tree_plan

    k, n = 4096, 6144
    a = jax.random.normal(jax.random.PRNGKey(0), (300, k), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (k, n), jnp.bfloat16)
    ref = np.asarray(a, np.float32) @ np.asarray(b, np.float32)
    leaves = tree_plan(k, jnp.bfloat16).num_leaves
    variants = {
        "pallas matmul": lambda x: matmul(x, b, backend="pallas"),
        "pallas tree": lambda x: tree_matmul(x, b, backend="pallas"),
        "mosaic matmul": lambda x: matmul(x, b, backend="mosaic"),
    }
    for sub in (1, 2, 4):
        variants[f"mosaic tree sub={sub}"] = lambda x, sub=sub: tree_mosaic.tree_matmul(
            x, b, jnp.bfloat16, k_total=k, num_leaves=leaves, subtree=sub
        )
    outs = {}
    for name, f in variants.items():
        try:
            c = np.asarray(f(a).astype(jnp.float32))
            c1 = np.asarray(f(a[:1]).astype(jnp.float32))
            outs[name] = c
            t = _time(jax.jit(f), a, iters=10)
            print(
                f"{name}: rel err {np.abs(c - ref).max() / np.abs(ref).max():.2e} "
                f"M=1 vs M=300 row bits equal: {np.array_equal(c[:1], c1)}  {t * 1e6:.0f}us",
                flush=True,
            )
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"{name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
    trees = [v for name, v in outs.items() if "mosaic tree" in name]
    print("mosaic tree variants bitwise equal:", all(np.array_equal(trees[0], t) for t in trees))


TUNE_VARIANTS = ((4, 128, False), (8, 128, False), (8, 128, True), (4, 128, True), (2, 128, True))


def tune(out_dir: str, m_sizes=(1024, 8192), variants=TUNE_VARIANTS) -> dict:
    """Time the Mosaic variants (BIO CTA width, tree subtree depth and tile) against XLA, and check
    that the tree variants agree bitwise (they must: same additions, same order)."""
    import numpy as np

    from pallas_kernels import matmul_mosaic as mm
    from pallas_kernels import tree_mosaic as tm
    from pallas_kernels.tree_matmul import tree_plan

    rows = []
    for name in ("qkv", "down"):
        k, n = SHAPES[name]
        leaves = tree_plan(k, jnp.bfloat16).num_leaves
        b = jax.random.normal(jax.random.PRNGKey(2), (k, n), jnp.bfloat16)
        v = {"xla": lambda x, y: x @ y}
        for cta_n in (256,):
            if n % cta_n == 0:
                v[f"bio{cta_n}"] = lambda x, y, c=cta_n: mm.matmul(x, y, jnp.bfloat16, cta_n=c)
        for sub, tn, w in variants:
            v[f"tree{sub}x{tn}{'w' if w else ''}"] = (
                lambda x, y, s=sub, t=tn, w=w, kt=k, nl=leaves: tm.tree_matmul(
                    x, y, jnp.bfloat16, k_total=kt, num_leaves=nl, subtree=s, tile_n=t, wide=w
                )
            )
        for m in m_sizes:
            a = jax.random.normal(jax.random.PRNGKey(3), (m, k), jnp.bfloat16)
            row, bits = {"shape": name, "M": m}, {}
            for key, f in v.items():
                try:
                    row[key] = round(_time_op(f, a, b, 2 * m * n) * 1e6, 1)
                    bits[key] = np.asarray(jax.jit(f)(a, b).astype(jnp.float32))
                except Exception as e:  # noqa: BLE001
                    row[key] = f"{type(e).__name__}: {str(e)[:200]}"
            trees = [x for kk, x in bits.items() if kk.startswith("tree")]
            row["trees_equal"] = all(np.array_equal(trees[0], t) for t in trees)
            bios = [x for kk, x in bits.items() if kk.startswith("bio")]
            row["bio_cta_equal"] = all(np.array_equal(bios[0], t) for t in bios)
            print(row, flush=True)
            rows.append(row)
    with open(os.path.join(out_dir, "matmul_tune.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return {"rows": rows}


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        probe()
    elif sys.argv[1:2] == ["--tune"]:
        tune(sys.argv[2] if len(sys.argv) > 2 else ".")
    else:
        run(sys.argv[1] if len(sys.argv) > 1 else ".")
