"""The Mosaic GPU looped paged attention (pallas_kernels/paged_attention_mosaic.py) on Hopper:
accuracy, the bit invariance the engine needs, and speed against cuDNN flash attention.

Per variant (block_kv, partition_size, mask_all, consumer warpgroups), each stage alone in
try/except, its row appended to attention_mosaic.jsonl as it ends (a hang loses only what
follows; run one variant per process under `timeout`, as probes/h_attn.sh does):
  check   allclose to `paged_attention_reference` on a --check-tokens prefill (atol 2e-2)
  bits    that prefill's rows one-shot == the same rows as three ragged chunks in one batch ==
          single-token decodes at positions on and beside partition/block edges (np.array_equal),
          with a control that must differ (XLA's attention); bits_sha of the one-shot output so
          two variants can be compared across processes
  time    TFLOP/s (causal: 4*H*E*n(n+1)/2) at each --tokens length, and x_cudnn (cuDNN's ms /
          ours: 1.0 is cuDNN's speed) where --cudnn measured cuDNN (cudnn rows, one process)
Usage (GPU): PYTHONPATH=. python -m benchmarks.attention_mosaic --out $OUT --variant 64,256,1
CPU check:   PYTHONPATH=. python -m benchmarks.attention_mosaic --tiny (Mosaic GPU interpreter)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

from benchmarks.attention_mosaic_decode import record

PAGE = 16


def _case(n: int, h: int, kh: int, e: int, seed: int = 0):
    import jax
    import jax.numpy as jnp

    k = jax.random.split(jax.random.PRNGKey(n + seed), 4)
    pps = n // PAGE
    kc = jax.random.normal(k[0], (kh, pps + 3, PAGE, e), jnp.bfloat16)
    vc = jax.random.normal(k[1], (kh, pps + 3, PAGE, e), jnp.bfloat16)
    pt = (jax.random.permutation(k[2], pps) + 3)[None].astype(jnp.int32)  # pages 0-2 unused
    q = jax.random.normal(k[3], (n, h, e), jnp.bfloat16)
    return (q, kc, vc, pt, jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32),
            jnp.arange(n, dtype=jnp.int32))  # fmt: skip


class Bench:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.h, self.kh = (int(x) for x in a.heads.split(","))
        self.e = a.head_dim
        self.scale = self.e**-0.5
        bk, ps, mask_all, cons = ([int(x) for x in a.variant.split(",")] + [1])[:4]
        self.kw = dict(scale=self.scale, partition_size=ps, block_kv=bk, mask_all=bool(mask_all),
                       steps=a.steps, consumers=cons, structure=a.structure)  # fmt: skip
        if a.tiny:
            self.kw["interpret"] = True
        self.name = f"bk{bk}|ps{ps}|mask_all{mask_all}|consumers{cons}|steps{a.steps}"
        if a.structure != "looped":
            self.name += f"|{a.structure}"
        os.makedirs(a.out, exist_ok=True)
        self.path = os.path.join(a.out, "attention_mosaic.jsonl")

    def fn(self):
        """One jitted function for the whole run (each shape compiles once)."""
        import jax

        from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

        if not hasattr(self, "_fn"):
            self._fn = jax.jit(lambda *args: paged_attention_mosaic(*args, **self.kw))
        return self._fn

    def record(self, stage: str, body) -> dict:
        return record(self.path, {"variant": self.name, "stage": stage}, body)

    def check(self) -> dict:
        import jax.numpy as jnp

        from pallas_kernels.paged_attention import paged_attention_reference

        args = _case(self.a.check_tokens, self.h, self.kh, self.e)
        out = self.fn()(*args).astype(jnp.float32)
        ref = paged_attention_reference(*args, scale=self.scale).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(out - ref)))
        ok = bool(jnp.allclose(out, ref, atol=2e-2, rtol=2e-2))
        if not ok:  # (JAX's own attention refuses causal masks on CUDA 12.8.0-12.9.0: ptxas)
            raise AssertionError(f"not allclose to paged_attention_reference: max |err| {err}, "
                                 f"CUDA runtime {_cuda_runtime()}")  # fmt: skip
        return {"allclose": ok, "max_abs_err": err, "tokens": self.a.check_tokens,
                "cuda_runtime": _cuda_runtime()}

    def bits(self) -> dict:
        import jax.numpy as jnp
        import numpy as np

        from pallas_kernels.paged_attention import paged_attention_xla

        n = self.a.check_tokens
        q, kc, vc, pt, _, _, _ = args = _case(n, self.h, self.kh, self.e)
        full = np.asarray(self.fn()(*args)).view(np.uint16)
        c1, c2 = n // 3 + 5, 2 * n // 3 - 3  # three ragged chunks of one sequence, one batch
        chunk = (q, kc, vc, jnp.repeat(pt, 3, axis=0), jnp.array([c1, c2, n], jnp.int32),
                 jnp.array([0, c1, c2, n], jnp.int32), jnp.arange(n, dtype=jnp.int32))  # fmt: skip
        chunks = np.asarray(self.fn()(*chunk)).view(np.uint16)
        ps, bk = self.kw["partition_size"], self.kw["block_kv"]
        rng = np.random.default_rng(0)
        fixed = [0, 1, bk - 1, bk, bk + 1, ps - 1, ps, ps + 1, n // 2 + 7, n - 2, n - 1]
        pos = np.unique(np.clip(np.r_[fixed, rng.integers(0, n, 8)], 0, n - 1)).astype(np.int32)
        d = len(pos)
        dec = (q[pos], kc, vc, jnp.repeat(pt, d, axis=0), jnp.asarray(pos + 1),
               jnp.arange(d + 1, dtype=jnp.int32), jnp.asarray(pos))  # fmt: skip
        decs = np.asarray(self.fn()(*dec)).view(np.uint16)
        xla = np.asarray(paged_attention_xla(*args, scale=self.scale)).view(np.uint16)
        res = {
            "bits_chunked": bool(np.array_equal(chunks, full)),
            "bits_decode": bool(np.array_equal(decs, full[pos])),
            "control_xla_differs": not np.array_equal(xla, full),
            "bits_sha": hashlib.sha256(full.tobytes()).hexdigest()[:16],
            "decode_positions": pos.tolist(),
        }
        if not res["bits_chunked"]:
            res["chunk_rows_differing"] = int(np.sum(np.any(chunks != full, axis=(1, 2))))
        if not res["bits_decode"]:
            res["decode_rows_differing"] = int(np.sum(np.any(decs != full[pos], axis=(1, 2))))
        return res

    def timed(self, f, args) -> float:
        import jax

        from benchmarks.timing import median_seconds

        jax.block_until_ready(f(*args))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        once = time.perf_counter() - t0
        iters = max(1, min(20, int(0.2 / max(once, 1e-6))))
        return median_seconds(f, *args, iters=iters, reps=3, warmup=0)

    def flops(self, n: int) -> float:
        return 4 * self.h * self.e * n * (n + 1) / 2

    def cudnn(self, n: int) -> dict:
        import jax

        q, kc, vc, pt = _case(n, self.h, self.kh, self.e)[:4]

        def seq(c):  # [1, n, K, E] in position order
            return c[:, pt[0]].reshape(self.kh, n, self.e).transpose(1, 0, 2)[None]

        k, v = seq(kc), seq(vc)
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
            q[None], k, v, scale=self.scale, is_causal=True, implementation="cudnn"))  # fmt: skip
        t = self.timed(f, (q, k, v))
        return {"impl": "cudnn", "tokens": n, "ms": t * 1e3, "TFLOPs": self.flops(n) / t / 1e12}

    def time(self, n: int) -> dict:
        args = _case(n, self.h, self.kh, self.e)
        t = self.timed(self.fn(), args)
        row = {"tokens": n, "ms": t * 1e3, "TFLOPs": self.flops(n) / t / 1e12}
        cud = _cudnn_ms(self.path, n)
        if cud:
            row["x_cudnn"] = cud / row["ms"]
        return row


def _cuda_runtime() -> int | None:
    try:
        from jax._src.lib import cuda_versions

        return int(cuda_versions.cuda_runtime_get_version())
    except Exception:  # noqa: BLE001 - a CPU build, or the module moved
        return None


def _cudnn_ms(path: str, n: int) -> float | None:
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        for line in fh:
            r = json.loads(line)
            if r.get("impl") == "cudnn" and r.get("tokens") == n and "ms" in r:
                return r["ms"]
    return None


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--variant", default="64,256,0",
                   help="block_kv,partition_size,mask_all[,consumers (1, 2)]")
    p.add_argument("--steps", type=int, default=2, help="pipeline slots (not bits)")
    p.add_argument("--structure", default="looped", help="looped, split or auto (not bits)")
    p.add_argument("--heads", default="32,8")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--check-tokens", type=int, default=2048)
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--cudnn", action="store_true", help="measure cuDNN at --tokens first")
    p.add_argument("--tiny", action="store_true", help="CPU: interpreter, tiny shapes")
    a = p.parse_args(argv)
    if a.tiny:
        a.heads, a.head_dim, a.check_tokens, a.tokens = "4,1", 64, 160, ""
        a.variant = a.variant if a.variant != "64,256,0" else "64,128,0"
    b = Bench(a)
    tokens = [int(x) for x in a.tokens.split(",") if x]
    if a.cudnn:
        b.name = "cudnn"
        for n in tokens:
            b.record("cudnn", lambda n=n: b.cudnn(n))
        return
    ok = b.record("check", b.check)
    b.record("bits", b.bits)
    if "error" in ok:
        return  # a wrong kernel reports no speed
    for n in tokens:
        b.record("time", lambda n=n: b.time(n))


if __name__ == "__main__":
    main(sys.argv[1:])
