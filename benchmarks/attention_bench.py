"""Paged attention vs XLA/cuDNN attention, side by side in one run; writes JSON.

Decode (bf16, head_dim 128, page 16): achieved bandwidth = bytes of K/V + Q + O over the time,
against the HBM copy bandwidth measured in the same run (device-to-device copy, read + write
bytes), and the time ratio to `jax.nn.dot_product_attention` (XLA) on the same shapes laid out
contiguously. Prefill (causal, one sequence): TFLOP/s and ratio to `jax.nn.dot_product_attention`
with implementation='cudnn' (falling back to XLA where cuDNN is unavailable).

Usage: PYTHONPATH=. python3 benchmarks/attention_bench.py [out_dir]
       [--knobs base,split_stages=2,kv_gather_2d=0+pages_ahead=0,...]
The plan sweep (block_rows, block_kv, num_warps, num_stages, with bit checks) is
benchmarks/attention_sweep.py.
`--knobs`: the decode attention alone in a layer loop at the 8B and 0.6B shapes, µs per layer,
per `AttentionConfig` setting (`knob_rows`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

import jax
import jax.numpy as jnp

from benchmarks.timing import median_seconds
from pallas_kernels.paged_attention import AttentionConfig, paged_attention

DECODE_CASES = [(1, 32, 8, 32768), (16, 32, 1, 4096), (64, 32, 8, 4096), (256, 32, 8, 1024)]
PREFILL_TOKENS = [2048, 8192]
E = 128
PAGE = 16


def _saved(out_dir: str, name: str, data: Any) -> Any:
    """Write `data` as JSON to out_dir/name and return it (every run of this benchmark)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as fh:
        json.dump(data, fh, indent=1)
    return data

def _time(fn, *args, iters: int = 20, reps: int = 3) -> float:
    """Median over `reps` of the mean time of `iters` back-to-back async dispatches (seconds)."""
    return median_seconds(fn, *args, iters=iters, reps=reps, warmup=2)


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Bytes/s of a large device-to-device copy-like pass (read + write counted)."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    f = jax.jit(lambda a: a * -1.0)
    t = _time(f, x, iters=10)
    return 2 * nbytes / t


def _paged_case(key, b, h, hkv, ctx, dtype=jnp.bfloat16):
    pages_per_seq = ctx // PAGE
    num_pages = b * pages_per_seq
    k1, k2, k3, k4 = jax.random.split(key, 4)
    kc = jax.random.normal(k1, (hkv, num_pages, PAGE, E), dtype)
    vc = jax.random.normal(k2, (hkv, num_pages, PAGE, E), dtype)
    pt = jax.random.permutation(k3, num_pages).reshape(b, pages_per_seq).astype(jnp.int32)
    q = jax.random.normal(k4, (b, h, E), dtype)
    return q, kc, vc, pt


def bench_decode(key, b, h, hkv, ctx, bw) -> dict:
    q, kc, vc, pt = _paged_case(key, b, h, hkv, ctx)
    lens = jnp.full((b,), ctx, jnp.int32)
    qs = jnp.arange(b + 1, dtype=jnp.int32)
    pos = jnp.full((b,), ctx - 1, jnp.int32)
    scale = E**-0.5
    f = jax.jit(lambda *a: paged_attention(*a, scale=scale))
    t_paged = _time(f, q, kc, vc, pt, lens, qs, pos)
    other = {}
    for st in ("split", "looped"):
        fs = jax.jit(lambda *a, st=st: paged_attention(*a, scale=scale, structure=st))
        other[f"{st}_ms"] = _time(fs, q, kc, vc, pt, lens, qs, pos) * 1e3
    nbytes = 2 * b * ctx * hkv * E * 2 + 2 * b * h * E * 2
    # XLA on the same shapes, contiguous [B, ctx, Hkv, E].
    kk = kc.reshape(hkv, b, ctx, E).transpose(1, 2, 0, 3)
    vv = vc.reshape(hkv, b, ctx, E).transpose(1, 2, 0, 3)
    g = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q[:, None], k, v, scale=scale))
    t_xla = _time(g, q, kk, vv)
    return {
        "B": b, "H": h, "H_kv": hkv, "ctx": ctx,
        "paged_ms": t_paged * 1e3, "xla_ms": t_xla * 1e3,
        "paged_GBps": nbytes / t_paged / 1e9, "xla_GBps": nbytes / t_xla / 1e9,
        "paged_frac_copy_bw": nbytes / t_paged / bw, "xla_frac_copy_bw": nbytes / t_xla / bw,
        "time_ratio_xla_over_paged": t_xla / t_paged, **other,
    }  # fmt: skip


def bench_prefill(key, n, h=32, hkv=8) -> dict:
    q, kc, vc, pt = _paged_case(key, 1, h, hkv, n)
    q = jax.random.normal(key, (n, h, E), jnp.bfloat16)
    lens = jnp.array([n], jnp.int32)
    qs = jnp.array([0, n], jnp.int32)
    pos = jnp.arange(n, dtype=jnp.int32)
    scale = E**-0.5
    f = jax.jit(lambda *a: paged_attention(*a, scale=scale))
    t_paged = _time(f, q, kc, vc, pt, lens, qs, pos, iters=5)
    fs = jax.jit(lambda *a: paged_attention(*a, scale=scale, structure="split"))
    t_split = _time(fs, q, kc, vc, pt, lens, qs, pos, iters=5)
    flops = 4 * h * E * n * (n + 1) / 2
    kk = kc.reshape(hkv, 1, n, E).transpose(1, 2, 0, 3)
    vv = vc.reshape(hkv, 1, n, E).transpose(1, 2, 0, 3)
    res = {"tokens": n, "H": h, "H_kv": hkv, "paged_ms": t_paged * 1e3,
           "paged_TFLOPs": flops / t_paged / 1e12, "split_ms": t_split * 1e3}  # fmt: skip
    for impl in ("cudnn", "xla"):
        try:
            g = jax.jit(
                lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
                    q[None], k, v, scale=scale, is_causal=True, implementation=impl
                )
            )
            t = _time(g, q, kk, vv, iters=5)
            res[f"{impl}_ms"] = t * 1e3
            res[f"{impl}_TFLOPs"] = flops / t / 1e12
            res[f"ratio_paged_over_{impl}_speed"] = t / t_paged
        except Exception as exc:  # noqa: BLE001 - record and go on: cuDNN may be missing
            res[f"{impl}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return res


def run(out_dir: str) -> dict:
    """Run every case, write `attention_bench.json` under out_dir, return the results."""
    dev = jax.devices()[0]
    results: dict = {"device": dev.device_kind, "jax": jax.__version__, "decode": [],
                     "prefill": []}  # fmt: skip
    bw = copy_bandwidth()
    results["copy_GBps"] = bw / 1e9
    key = jax.random.PRNGKey(0)
    for case in DECODE_CASES:
        try:
            r = bench_decode(key, *case, bw)
        except Exception as exc:  # noqa: BLE001
            r = {"case": case, "error": traceback.format_exc()[-2000:]}
            print(exc, file=sys.stderr)
        print(json.dumps(r), flush=True)
        results["decode"].append(r)
    for n in PREFILL_TOKENS:
        try:
            r = bench_prefill(key, n)
        except Exception as exc:  # noqa: BLE001
            r = {"tokens": n, "error": traceback.format_exc()[-2000:]}
            print(exc, file=sys.stderr)
        print(json.dumps(r), flush=True)
        results["prefill"].append(r)
    return _saved(out_dir, "attention_bench.json", results)


# Decode shapes of the model's layer loop: (name, layers, q heads, kv heads), head dim 128,
# page 16, partition 256 (Ops.attn_partition), batch 1 at context 1024, decode_bench's page-table
# width there (128 pages: 4 of its 8 partitions are sentinels, as in the engine).
LAYER_CASES = [("llama3-8b", 32, 32, 8), ("qwen3-0.6b", 28, 16, 8)]


def layer_loop_us(layers: int, h: int, hkv: int, ctx: int = 1024, pmax: int = 128,
                  config: AttentionConfig | None = None) -> float:  # fmt: skip
    """Microseconds per layer of the attention as the model calls it inside its layer loop
    (stacked cache read at the loop's layer, `meta` once per step, 64 output rows written by the
    merge itself), batch 1: a fori_loop over the layers whose next query is the last output's
    first row (one small XLA fusion a layer besides the kernels; the same for every variant)."""
    from jax import lax

    from pallas_kernels.paged_attention_pallas import attention_meta

    key = jax.random.PRNGKey(3)
    used = ctx // PAGE
    num_pages = used + 8
    shape = (layers, hkv, num_pages, PAGE, E)
    kc = jax.random.normal(key, shape, jnp.bfloat16)
    vc = jax.random.normal(jax.random.fold_in(key, 1), shape, jnp.bfloat16)
    q = jax.random.normal(jax.random.fold_in(key, 2), (1, h, E), jnp.bfloat16)
    cols = jnp.minimum(jnp.arange(pmax, dtype=jnp.int32), used - 1)
    pt, lens = cols[None], jnp.array([ctx], jnp.int32)
    qs, pos = jnp.array([0, 1], jnp.int32), jnp.array([ctx - 1], jnp.int32)
    ps = 256

    @jax.jit
    def step(q, kc, vc):
        meta = attention_meta(pt, lens, qs, pos, t=1, g=h // hkv, num_pages=num_pages,
                              page_size=PAGE, partition_size=ps)  # fmt: skip

        def body(i, q):
            out = paged_attention(q, kc, vc, pt, lens, qs, pos, scale=E**-0.5,
                                  partition_size=ps, layer=i, meta=meta, out_rows=64,
                                  structure="split", direct_out=True,
                                  config=config or AttentionConfig())  # fmt: skip
            return out[:1]

        return lax.fori_loop(0, layers, body, q)

    return _time(step, q, kc, vc, iters=20, reps=5) / layers * 1e6


def knob_rows(out_dir: str, variants: list[str]) -> list:
    """`layer_loop_us` per variant: `AttentionConfig` fields ('kv_gather_2d=0+split_stages=2';
    'base' = the defaults); the output bits of each variant are compared with the first's."""
    import numpy as np

    rows, first = [], {}
    for v in variants:
        fields = {} if v == "base" else dict(kv.split("=") for kv in v.split("+"))
        for name, layers, h, hkv in LAYER_CASES:
            row = {"variant": v, "shape": name}
            try:
                config = AttentionConfig(**{k: int(x) for k, x in fields.items()})
                row["us_per_layer"] = layer_loop_us(layers, h, hkv, config=config)
                bits = np.asarray(_one_layer_bits(h, hkv, config=config)).view(np.uint16)
                if name not in first:
                    first[name] = bits
                row["same_bits_as_first"] = bool(np.array_equal(bits, first[name]))
            except Exception:  # noqa: BLE001 - keep the other variants
                row["error"] = traceback.format_exc()[-2000:]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return _saved(out_dir, "attention_knobs.json", rows)


def _one_layer_bits(h: int, hkv: int, ctx: int = 1000,
                    config: AttentionConfig | None = None) -> jax.Array:  # fmt: skip
    """One decode attention at a context that ends inside a partition (so a static block loop
    runs blocks past the end), for the bit comparison of `knob_rows`."""
    q, kc, vc, pt = _paged_case(jax.random.PRNGKey(4), 1, h, hkv, 1024)
    lens, qs = jnp.array([ctx], jnp.int32), jnp.array([0, 1], jnp.int32)
    pos = jnp.array([ctx - 1], jnp.int32)
    return paged_attention(q, kc, vc, pt, lens, qs, pos, scale=E**-0.5, partition_size=256,
                           structure="split", config=config or AttentionConfig())  # fmt: skip


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    out = args[0] if args else os.environ.get("OUT", "out")
    if "--knobs" in sys.argv:  # --knobs base,FIELD=1+FIELD2=3,...
        knob_rows(out, sys.argv[sys.argv.index("--knobs") + 1].split(","))
    else:
        run(out)
