"""Paged attention on the step shapes an engine runs, every kernel family and launch side by side
(Hopper): which Mosaic GPU launch (`structure`, `consumers`) and which block_kv to run where,
against the Triton kernel the other GPUs run.

Cases (Llama-3-8B heads: 32 query, 8 KV, E 128; pages of 16; one stacked-cache layer):
decodes B x ctx, one prompt chunk at a late context, a chunk beside 32 decodes (a stall-free
step), a one-shot prefill. Per case every implementation is one jitted function on the same
inputs, timed interleaved (median of rounds; each round the median of `iters` calls), so clock
drift hits them alike. Each row: ms, and the ratio to the Triton kernel's own launch ("auto").
Mosaic launches of one block_kv give one set of bits (benchmarks/attention_mosaic*.py check it);
block_kv 64 and 128 are two plans.

Usage (GPU): PYTHONPATH=. python -m benchmarks.attention_steps --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

PAGE = 16
# name: ([(new tokens, context after them), ...] per sequence, padded to the engine's bucket)
CASES = {
    "decode B1 ctx1k": ([(1, 1024)], True),
    "decode B1 ctx8k": ([(1, 8192)], True),
    "decode B1 ctx8k unpadded": ([(1, 8192)], False),
    "decode B32 ctx1k": ([(1, 1024)] * 32, True),
    "decode B64 ctx2k": ([(1, 2048)] * 64, True),
    "chunk 512 at ctx 8k": ([(512, 8192)], False),
    "chunk 512 at ctx 8k S256": ([(512, 8192)], True),
    "chunk 480 + 32 decodes": ([(480, 2048)] + [(1, 1024)] * 32, True),
    "prefill 2k": ([(2048, 2048)], False),
    "prefill 8k": ([(8192, 8192)], False),
}
IMPLS = ["triton"] + [f"mosaic bk{bk} {s}" for bk in (64, 128)
                      for s in ("split", "looped1", "looped2")]  # fmt: skip


def engine_shapes():
    """The buckets of a default GPU engine with a 32k max_model_len (serving/engine/shapes.py):
    16-token minimum, stall-free budget 512, max_num_batched_tokens 8192, 256 sequences."""
    from serving.engine.shapes import ShapeSet

    return ShapeSet.build(max_num_batched_tokens=8192, max_num_seqs=256,
                          max_pages=32768 // PAGE, min_tokens_bucket=16,
                          stall_free_budget=512)  # fmt: skip


def case_inputs(seqs: list, pad: bool, h: int = 32, kh: int = 8, e: int = 128, seed: int = 0):
    """The case's operands; `pad`: T, S and Pmax padded to the engine's bucket
    (`ShapeSet.fit`: empty sequences, padding tokens after the last one, wider page table),
    else the case's own S and Pmax, T at least the smallest token bucket."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    pages = [-(-ctx // PAGE) for _, ctx in seqs]
    t, s, pmax = sum(n for n, _ in seqs), len(seqs), max(pages)
    shapes = engine_shapes()
    if pad:
        t, s, pmax = shapes.fit(t, s, pmax)
    t = max(t, shapes.tokens[0])  # no step runs fewer tokens than the smallest bucket
    num_pages = sum(pages) + 1
    k = jax.random.split(jax.random.PRNGKey(seed), 3)
    kc = jax.random.normal(k[0], (1, kh, num_pages, PAGE, e), jnp.bfloat16)
    vc = jax.random.normal(k[1], (1, kh, num_pages, PAGE, e), jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(num_pages - 1) + 1
    pt = np.zeros((s, pmax), np.int32)
    ctx_lens = np.zeros(s, np.int32)
    pos, qs, at = [], [0], 0
    for i, ((n, ctx), p) in enumerate(zip(seqs, pages, strict=True)):
        pt[i, :p] = perm[at:at + p]
        ctx_lens[i] = ctx
        at += p
        pos += list(range(ctx - n, ctx))
        qs.append(qs[-1] + n)
    qs += [qs[-1]] * (s - len(seqs))  # empty sequences
    pos += [0] * (t - len(pos))  # padding tokens
    q = jax.random.normal(k[2], (t, h, e), jnp.bfloat16)
    return (q, kc, vc, jnp.asarray(pt), jnp.asarray(ctx_lens), jnp.asarray(qs, jnp.int32),
            jnp.asarray(pos, jnp.int32))  # fmt: skip


def impl_fn(name: str, e: int = 128):
    import jax
    import jax.numpy as jnp

    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    kw = dict(scale=e**-0.5, partition_size=256, layer=jnp.int32(0))
    if name == "triton":
        return jax.jit(lambda *x: paged_attention(*x, **kw))
    _, bk, launch = name.split()
    structure = "split" if launch == "split" else "looped"
    consumers = 2 if launch == "looped2" else 1
    return jax.jit(lambda *x: paged_attention_mosaic(
        *x, block_kv=int(bk[2:]), structure=structure, consumers=consumers, **kw))


def main(argv: list[str]) -> None:
    import jax
    import numpy as np

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--impls", default=",".join(IMPLS))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=20)
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "attention_steps.jsonl")
    for case in a.cases.split(","):
        args = case_inputs(*CASES[case])
        fns, err = {}, {}
        for name in a.impls.split(","):
            try:
                fns[name] = impl_fn(name)
                jax.block_until_ready(fns[name](*args))
            except Exception as exc:  # noqa: BLE001 - record and go on
                err[name] = f"{type(exc).__name__}: {str(exc)[:300]}"
                fns.pop(name, None)
        times: dict = {n: [] for n in fns}
        for _ in range(a.rounds):
            for n, f in fns.items():
                jax.block_until_ready(f(*args))
                ts = []
                for _ in range(a.iters):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    ts.append(time.perf_counter() - t0)
                times[n].append(float(np.median(ts)))
        ms = {n: 1e3 * float(np.median(v)) for n, v in times.items()}
        base = ms.get("triton")
        for n in a.impls.split(","):
            row = {"case": case, "impl": n, "jax": jax.__version__}
            if n in ms:
                row["ms"] = round(ms[n], 4)
                if base:
                    row["x_triton"] = round(ms[n] / base, 3)
            else:
                row["error"] = err.get(n, "not run")
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
