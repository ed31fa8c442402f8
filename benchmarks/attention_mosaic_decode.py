"""The Mosaic GPU split (decode) paged attention (pallas_kernels/paged_attention_mosaic_decode.py)
on Hopper: its bits against the looped Mosaic kernel, and decode time against the Triton
kernel's split path (the bar: docs/PREFILL_ATTENTION.md, "Decode runs the same code").

Stages, each alone in try/except, its row appended to attention_mosaic_decode.jsonl as it ends:
  bits    one sequence of --check-tokens on a stacked cache (layer 1, pages permuted): one-shot
          looped == one-shot split == two consumers == ragged chunks (split) == single decodes
          on and beside block/partition edges (split), np.array_equal; controls that must
          differ: the split merge folding partitions in decreasing order, the Triton kernel;
          allclose to paged_attention_reference. bits_sha: the looped one-shot rows' hash.
  time    per decode case BxCTX (--decode): ms and GB/s (K and V bytes read) of Mosaic split,
          Mosaic auto and the Triton kernel (structure split; its default auto), one jitted
          function each, the same inputs; x_triton = Triton split ms / Mosaic split ms.
Usage (GPU): PYTHONPATH=. python -m benchmarks.attention_mosaic_decode --out $OUT [--only time]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import traceback

PAGE = 16


def record(path: str, row: dict, body) -> dict:
    import jax

    row = {**row, "jax": jax.__version__}
    t0 = time.time()
    try:
        row.update(body())
    except Exception as exc:  # noqa: BLE001 - record and go on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:600]}"
        row["traceback"] = traceback.format_exc()[-6000:]
        print(row["traceback"][-1500:], file=sys.stderr, flush=True)
    row["wall_s"] = round(time.time() - t0, 2)
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def bits(a: argparse.Namespace, h: int, kh: int, e: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic
    from tests.pallas_kernels import mosaic_bits as mb

    n, ps, bk = a.check_tokens, a.partition_size, a.block_kv

    def mosaic(**kw):
        kw = dict(scale=e**-0.5, partition_size=ps, block_kv=bk, layer=jnp.int32(1)) | kw
        return jax.jit(lambda *args: paged_attention_mosaic(*args, **kw))

    case = mb.stacked_case(n, h, kh, e, seed=1)
    looped = mb.bits(mb.one_shot(mosaic(structure="looped"), case, n))
    split = mb.bits(mb.one_shot(mosaic(structure="split"), case, n))
    two = mb.bits(mb.one_shot(mosaic(consumers=2), case, n))
    c1, c2 = n // 3 + 5, 2 * n // 3 - 3
    chunks = [1, 15, 16, 17, c1 - 49, ps + 1, c2 - c1 - ps - 1, n - c2]
    pos = mb.boundary_positions(n, bk, ps, extra=6)
    ch, dec = mb.chunked_and_decodes(mosaic(structure="split"), case, chunks, pos)
    rev = mb.bits(mb.one_shot(mosaic(structure="split", reverse_merge=True), case, n))
    tri = jax.jit(lambda *x: paged_attention(*x, scale=e**-0.5, partition_size=ps,
                                             layer=jnp.int32(1)))  # fmt: skip
    triton = mb.bits(mb.one_shot(tri, case, n))
    ref = mb.one_shot(lambda q, k, v, *x: paged_attention_reference(q, k[1], v[1], *x,
                                                                    scale=e**-0.5), case, n)
    out32, ref32 = looped.view(jnp.bfloat16).astype(np.float32), np.asarray(ref, np.float32)
    err = float(np.max(np.abs(out32 - ref32)))
    res = {
        "split_eq_looped": bool(np.array_equal(split, looped)),
        "consumers2_eq_looped": bool(np.array_equal(two, looped)),
        "split_chunks_eq": bool(np.array_equal(mb.bits(ch), looped)),
        "split_decodes_eq": bool(np.array_equal(mb.bits(dec), looped[pos])),
        "control_reverse_merge_differs": not np.array_equal(rev, looped),
        "control_triton_differs": not np.array_equal(triton, looped),
        "max_abs_err": err,
        "allclose": bool(np.allclose(out32, ref32, atol=2e-2, rtol=2e-2)),
        "bits_sha": hashlib.sha256(looped.tobytes()).hexdigest()[:16],
        "chunks": chunks,
        "decode_positions": pos,
    }
    for k in ("split_eq_looped", "consumers2_eq_looped", "split_chunks_eq"):
        if not res[k]:
            other = {"split_eq_looped": split, "consumers2_eq_looped": two,
                     "split_chunks_eq": mb.bits(ch)}[k]  # fmt: skip
            res[k + "_rows_differing"] = int(np.sum(np.any(other != looped, axis=(1, 2))))
    return res


def decode_case(b: int, ctx: int, h: int, kh: int, e: int):
    import jax
    import jax.numpy as jnp

    pps = -(-ctx // PAGE)
    k = jax.random.split(jax.random.PRNGKey(b * 7919 + ctx), 4)
    kc = jax.random.normal(k[0], (kh, b * pps + 1, PAGE, e), jnp.bfloat16)
    vc = jax.random.normal(k[1], (kh, b * pps + 1, PAGE, e), jnp.bfloat16)
    pt = (jax.random.permutation(k[2], b * pps) + 1).reshape(b, pps).astype(jnp.int32)
    q = jax.random.normal(k[3], (b, h, e), jnp.bfloat16)
    return (q, kc, vc, pt, jnp.full((b,), ctx, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32),
            jnp.full((b,), ctx - 1, jnp.int32))  # fmt: skip


def timed(f, args) -> float:
    import jax

    from benchmarks.timing import median_seconds

    jax.block_until_ready(f(*args))
    return median_seconds(f, *args, iters=50, reps=5, warmup=1)


def decode_time(a: argparse.Namespace, impl: str, b: int, ctx: int, h: int, kh: int,
                e: int) -> dict:  # fmt: skip
    import jax

    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    ps, bk = a.partition_size, a.block_kv
    if impl.startswith("mosaic"):
        st = impl.split("_")[1]
        f = jax.jit(lambda *x: paged_attention_mosaic(*x, scale=e**-0.5, partition_size=ps,
                                                      block_kv=bk, structure=st))  # fmt: skip
    else:
        st = impl.split("_")[1]
        f = jax.jit(lambda *x: paged_attention(*x, scale=e**-0.5, partition_size=ps,
                                               block_kv=bk, structure=st))  # fmt: skip
    t = timed(f, decode_case(b, ctx, h, kh, e))
    nbytes = 2 * b * ctx * kh * e * 2 + 2 * b * h * e * 2
    return {"ms": t * 1e3, "GBps": nbytes / t / 1e9}


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--heads", default="32,8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--partition-size", type=int, default=256)
    p.add_argument("--block-kv", type=int, default=64)
    p.add_argument("--check-tokens", type=int, default=2048)
    p.add_argument("--decode", default="1x8192,32x1024", help="decode cases BxCTX")
    p.add_argument("--impls", default="triton_split,mosaic_split,mosaic_auto,triton_auto")
    p.add_argument("--only", default="bits,time")
    a = p.parse_args(argv)
    h, kh = (int(x) for x in a.heads.split(","))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "attention_mosaic_decode.jsonl")
    base = {"ps": a.partition_size, "bk": a.block_kv}
    if "bits" in a.only:
        record(path, {**base, "stage": "bits", "tokens": a.check_tokens},
               lambda: bits(a, h, kh, a.head_dim))  # fmt: skip
    if "time" not in a.only:
        return
    for case in a.decode.split(","):
        b, ctx = (int(x) for x in case.split("x"))
        ms = {}
        for impl in a.impls.split(","):
            r = record(path, {**base, "stage": "time", "impl": impl, "case": f"B{b} ctx{ctx}"},
                       lambda impl=impl, b=b, ctx=ctx: decode_time(a, impl, b, ctx, h, kh,
                                                                   a.head_dim))
            ms[impl] = r.get("ms")
        if ms.get("triton_split") and ms.get("mosaic_split"):
            record(path, {**base, "stage": "ratio", "case": f"B{b} ctx{ctx}"},
                   lambda ms=ms: {"x_triton": ms["triton_split"] / ms["mosaic_split"]})


if __name__ == "__main__":
    main(sys.argv[1:])
