"""Paged-attention plan sweep: prefill and decode time per kernel plan and launch setting, against
cuDNN flash attention in the same run, each candidate's bits checked against the decode path.

Why: the reduction plan (pallas_kernels/paged_attention.py) fixes block_rows (the MMA's M),
block_kv, partition_size and num_warps. Another plan changes the bits (golden records are then
re-recorded) but keeps prefill, chunked prefill and decode equal by construction; this measures
which plan is fastest and confirms that property for what Triton compiled: the middle prefill
length's one-shot rows must equal the same rows scored as a ragged batch of three chunks (same
launch) and as single-token decodes (split layout, the decode launch of the same plan).
Launch settings (num_stages, structure, `AttentionConfig`) must not change bits at all:
`bits_plan_ref` compares a launch's output with its plan's first launch on the same case.

Stages, in this order while the budget lasts (each candidate alone in try/except):
  anchor    cuDNN flash (and XLA where it fits) at every prefill length and decode case
  baseline  the current plan (64 rows, block_kv 64, 4 warps) at every case
  prefill   every plan x num_stages, looped, at the middle prefill length (+ the bit check)
  top       the fastest `--top` launches of `prefill` at every prefill length, split layout,
            and `AttentionConfig` variants
  decode    every plan x num_stages, split, at the decode cases
A parent process runs the sweep in a child and restarts it past a candidate that kills it
(a Triton crash, say), until the budget is spent; candidates already measured are not rerun.

Usage (GPU): PYTHONPATH=. python -m benchmarks.attention_sweep --out $OUT --budget-s 500
             [--only decode --stages 2,3] (a second call: the stages the first one's budget cut)
CPU check:   JDET_PALLAS_INTERPRET=1 PYTHONPATH=. python -m benchmarks.attention_sweep --tiny
Writes attention_sweep.json (settings, rows) under --out and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
import traceback

PAGE = 16
CONFIGS = {  # AttentionConfig variants (never bits); "base" is the defaults
    "base": {},
    "kv2d0": {"kv_gather_2d": False},
    "ahead0": {"pages_ahead": False},
    "static0": {"static_blocks": False},
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One candidate: a plan (rows, bk, warps, ps) and how it is launched (the rest)."""

    rows: int
    bk: int
    warps: int
    ps: int
    stages: int | None = None  # None: the kernel's default for the structure
    structure: str = "looped"
    config: str = "base"

    @property
    def plan(self) -> tuple:
        return (self.rows, self.bk, self.warps, self.ps)

    def name(self) -> str:
        return (f"{self.structure}|r{self.rows}|bk{self.bk}|w{self.warps}|s{self.stages}|"
                f"ps{self.ps}|{self.config}")  # fmt: skip


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--budget-s", type=float, default=480.0, help="total wall time, all children")
    p.add_argument("--heads", default="32,8", help="H,H_kv")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", default="2048,8192,32768", help="prefill lengths (one sequence)")
    p.add_argument("--decode", default="1x8192,32x1024", help="decode cases BxCTX")
    p.add_argument("--partitions", default="256", help="partition sizes (the engine's: 256)")
    p.add_argument("--rows", default="64,128")
    p.add_argument("--block-kv", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="1,2,3,4")
    p.add_argument("--configs", default="kv2d0,ahead0,static0", help=f"of {list(CONFIGS)}")
    p.add_argument("--top", type=int, default=3)
    p.add_argument("--only", default="anchor,baseline,prefill,top,decode", help="stages to run")
    p.add_argument("--tiny", action="store_true", help="CPU interpret-mode check of the script")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--progress", default="", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    return p


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _tiny(a: argparse.Namespace) -> None:
    a.heads, a.head_dim, a.tokens, a.decode = "8,2", 32, "64,160", "1x96,3x48"
    a.partitions, a.rows, a.block_kv, a.warps, a.stages = "64", "64", "16,32", "4", "2"
    a.configs, a.top = "kv2d0", 1


# ---------------------------------------------------------------- child: the measurements


class Sweep:
    """The child's state: cases' arrays, reference bits, finished rows (from the progress file)."""

    def __init__(self, a: argparse.Namespace):
        import jax

        jax.config.update("jax_enable_compilation_cache", False)
        self.a = a
        self.h, self.hkv = _ints(a.heads)
        self.e = a.head_dim
        self.scale = self.e**-0.5
        self.tokens = _ints(a.tokens)
        self.mid = self.tokens[len(self.tokens) // 2]
        self.decodes = [tuple(int(x) for x in c.split("x")) for c in a.decode.split(",") if c]
        self.done: dict[str, dict] = {}
        if a.progress and os.path.exists(a.progress):
            with open(a.progress) as fh:
                for line in fh:
                    rec = json.loads(line)
                    if "row" in rec:
                        self.done[rec["row"]["id"]] = rec["row"]
        self.data: dict = {}
        self.plan_ref: dict = {}  # (plan, case) -> output bits of the plan's first launch
        self.skipped = 0

    # -- inputs
    def case(self, kind: str, *dims: int):
        key = (kind, *dims)
        if key not in self.data:
            self.data[key] = self._make(kind, *dims)
        return self.data[key]

    def _make(self, kind: str, *dims: int):
        import jax
        import jax.numpy as jnp

        bf = jnp.bfloat16
        k = jax.random.split(jax.random.PRNGKey(sum(dims) + len(kind)), 4)
        if kind == "prefill":
            (n,) = dims
            b, ctx, t = 1, n, n
        else:
            b, ctx = dims
            t = b
        pps = -(-ctx // PAGE)
        kc = jax.random.normal(k[0], (self.hkv, b * pps, PAGE, self.e), bf)
        vc = jax.random.normal(k[1], (self.hkv, b * pps, PAGE, self.e), bf)
        pt = jax.random.permutation(k[2], b * pps).reshape(b, pps).astype(jnp.int32)
        q = jax.random.normal(k[3], (t, self.h, self.e), bf)
        if kind == "prefill":
            rest = (jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32),
                    jnp.arange(n, dtype=jnp.int32))  # fmt: skip
        else:
            rest = (jnp.full((b,), ctx, jnp.int32), jnp.arange(b + 1, dtype=jnp.int32),
                    jnp.full((b,), ctx - 1, jnp.int32))  # fmt: skip
        return (q, kc, vc, pt, *rest)

    def contiguous(self, kind: str, *dims: int):
        """q, k, v as [B, T, H(_kv), E] for jax.nn.dot_product_attention."""
        q, kc, vc, pt = self.case(kind, *dims)[:4]
        b, pps = pt.shape

        def seqs(c):
            return c[:, pt].reshape(self.hkv, b, pps * PAGE, self.e).transpose(1, 2, 0, 3)

        qq = q[None] if kind == "prefill" else q[:, None]
        return qq, seqs(kc), seqs(vc)

    # -- calls
    def fn(self, ln: Launch):
        import jax

        from pallas_kernels.paged_attention import AttentionConfig, paged_attention

        kw = dict(scale=self.scale, partition_size=ln.ps, block_kv=ln.bk, structure=ln.structure,
                  block_rows=ln.rows, num_warps=ln.warps, num_stages=ln.stages, backend="pallas",
                  config=AttentionConfig(**CONFIGS[ln.config]),
                  direct_out=ln.structure == "split")  # fmt: skip
        return jax.jit(lambda *args, meta: paged_attention(*args, meta=meta, **kw))

    def meta(self, ln: Launch, args):
        from pallas_kernels.paged_attention_pallas import attention_meta

        q, kc, _, pt, lens, qs, pos = args
        return attention_meta(pt, lens, qs, pos, t=q.shape[0], g=self.h // self.hkv,
                              num_pages=kc.shape[1], page_size=PAGE, partition_size=ln.ps,
                              block_rows=ln.rows)  # fmt: skip

    def timed(self, f, args) -> tuple[float, object]:
        import jax

        from benchmarks.timing import median_seconds

        out = jax.block_until_ready(f(*args))  # compile and first run
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        once = time.perf_counter() - t0
        iters = max(1, min(50, int(0.05 / max(once, 1e-6))))
        return median_seconds(f, *args, iters=iters, reps=3, warmup=0), out

    # -- rows
    def record(self, rid: str, body) -> dict | None:
        """Run `body()` (a dict of fields) unless done or past the deadline; log it."""
        if rid in self.done:
            return self.done[rid]
        if rid != "device" and rid.split("|")[0] not in self.a.only.split(","):
            return None
        if time.time() > self.a.deadline:
            self.skipped += 1
            return None
        self._log({"start": rid})
        t0 = time.time()
        try:
            row = {"id": rid, **body()}
        except Exception as exc:  # noqa: BLE001 - record and go on (cannot compile, OOM, ...)
            row = {"id": rid, "error": f"{type(exc).__name__}: {str(exc)[:400]}"}
            row["traceback"] = traceback.format_exc()[-1500:]
            print(f"{rid}: {row['error'][:200]}", file=sys.stderr, flush=True)
        row["wall_s"] = round(time.time() - t0, 2)
        self._log({"row": row})
        self.done[rid] = row
        print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
        return row

    def _log(self, rec: dict) -> None:
        if self.a.progress:
            with open(self.a.progress, "a") as fh:
                fh.write(json.dumps(rec) + "\n")

    def anchor(self, impl: str, kind: str, *dims: int) -> None:
        import jax

        def body():
            q, k, v = self.contiguous(kind, *dims)
            f = jax.jit(
                lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, scale=self.scale, is_causal=kind == "prefill", implementation=impl
                )
            )
            t, _ = self.timed(f, (q, k, v))
            return {"stage": "anchor", "impl": impl, **self._measures(kind, dims, t)}

        self.record(f"anchor|{impl}|{kind}{'x'.join(map(str, dims))}", body)

    def _measures(self, kind: str, dims: tuple, t: float) -> dict:
        if kind == "prefill":
            (n,) = dims
            flops = 4 * self.h * self.e * n * (n + 1) / 2
            return {"case": f"prefill {n}", "ms": t * 1e3, "TFLOPs": flops / t / 1e12}
        b, ctx = dims
        nbytes = 2 * b * ctx * self.hkv * self.e * 2 + 2 * b * self.h * self.e * 2
        return {"case": f"decode B{b} ctx{ctx}", "ms": t * 1e3, "GBps": nbytes / t / 1e9}

    def run_case(self, stage: str, ln: Launch, kind: str, *dims: int) -> dict | None:
        import numpy as np

        def body():
            args = self.case(kind, *dims)
            f = functools.partial(self.fn(ln), meta=self.meta(ln, args))
            t, out = self.timed(f, args)
            row = {"stage": stage, **dataclasses.asdict(ln), **self._measures(kind, dims, t)}
            cud = self.done.get(f"anchor|cudnn|{kind}{'x'.join(map(str, dims))}", {})
            if "ms" in cud:
                row["x_cudnn"] = cud["ms"] / row["ms"]  # > 1: faster than cuDNN
            bits = np.asarray(out).view(np.uint16)
            ref = self.plan_ref.setdefault((ln.plan, kind, dims), bits)
            row["bits_plan_ref"] = bool(np.array_equal(bits, ref))
            first = (ln.plan, "check") not in self.plan_ref
            if kind == "prefill" and dims == (self.mid,) and first:
                self.plan_ref[(ln.plan, "check")] = True
                row.update(self.check(ln, out))
            return row

        return self.record(f"{stage}|{kind}{'x'.join(map(str, dims))}|{ln.name()}", body)

    def check(self, ln: Launch, full) -> dict:
        """One-shot prefill rows == ragged chunks (same launch) == decodes (split, default)."""
        import jax.numpy as jnp
        import numpy as np

        q, kc, vc, pt, _, _, _ = self.case("prefill", self.mid)
        n = self.mid
        full = np.asarray(full).view(np.uint16)
        c1, c2 = n // 3 + 5, 2 * n // 3 - 3
        chunk_args = (
            q,
            kc,
            vc,
            jnp.repeat(pt, 3, axis=0),
            jnp.array([c1, c2, n], jnp.int32),
            jnp.array([0, c1, c2, n], jnp.int32),
            jnp.arange(n, dtype=jnp.int32),
        )
        chunks = self.fn(ln)(*chunk_args, meta=self.meta(ln, chunk_args))
        rng = np.random.default_rng(0)
        fixed = [0, 1, ln.ps - 1, ln.ps, ln.ps + 1, n // 2 + 7, n - 2, n - 1]
        pos = np.unique(np.clip(np.r_[fixed, rng.integers(0, n, 8)], 0, n - 1)).astype(np.int32)
        d = len(pos)
        dec_ln = dataclasses.replace(ln, structure="split", stages=None, config="base")
        dec_args = (q[pos], kc, vc, jnp.repeat(pt, d, axis=0), jnp.asarray(pos + 1),
                    jnp.arange(d + 1, dtype=jnp.int32), jnp.asarray(pos))  # fmt: skip
        dec = self.fn(dec_ln)(*dec_args, meta=self.meta(dec_ln, dec_args))
        res = {
            "bits_chunked": bool(np.array_equal(np.asarray(chunks).view(np.uint16), full)),
            "bits_decode": bool(np.array_equal(np.asarray(dec).view(np.uint16), full[pos])),
        }
        base = self.plan_ref.get("baseline_full")
        if base is None:
            self.plan_ref["baseline_full"] = base = full
            # negative control: XLA's one-softmax attention must differ from the kernel's bits
            from pallas_kernels.paged_attention import paged_attention_xla

            xla = paged_attention_xla(*self.case("prefill", n), scale=self.scale)
            res["control_xla_differs"] = not np.array_equal(np.asarray(xla).view(np.uint16), full)
        res["bits_equal_baseline_plan"] = bool(np.array_equal(full, base))
        return res

    # -- the stages
    def plans(self) -> list[tuple]:
        a = self.a
        return [(r, bk, w, ps) for ps in _ints(a.partitions) for r in _ints(a.rows)
                for bk in _ints(a.block_kv) for w in _ints(a.warps)
                if ps % bk == 0 and bk % PAGE == 0]  # fmt: skip

    def run(self) -> None:
        import jax

        mid = self.mid
        self.record("device", lambda: {"device": jax.devices()[0].device_kind,
                                       "jax": jax.__version__})  # fmt: skip
        for n in self.tokens:
            self.anchor("cudnn", "prefill", n)
        for b, ctx in self.decodes:
            self.anchor("cudnn", "decode", b, ctx)
            self.anchor("xla", "decode", b, ctx)
        self.anchor("xla", "prefill", min(self.tokens))
        ps0 = _ints(self.a.partitions)[0]
        base = Launch(64, 64 if ps0 % 64 == 0 else _ints(self.a.block_kv)[0], 4, ps0)
        self.run_case("baseline", base, "prefill", mid)  # first: the bit check's baseline
        split = dataclasses.replace(base, structure="split")
        for n in self.tokens:
            self.run_case("baseline", base, "prefill", n)
            if n <= mid:  # split partials grow as n^2 / partition (32k: ~69 GB)
                self.run_case("baseline", split, "prefill", n)
        for b, ctx in self.decodes:
            self.run_case("baseline", split, "decode", b, ctx)
        stages = _ints(self.a.stages)
        order = sorted(stages, key=lambda s: [2, 3, 4, 1].index(s) if s in (1, 2, 3, 4) else s)
        for s in order:  # every plan at num_stages 2 first (their bit checks), then the rest
            for plan in self.plans():
                self.run_case("prefill", Launch(*plan, stages=s), "prefill", mid)
        timed = [r for r in self.done.values() if r.get("stage") == "prefill" and "ms" in r
                 and r.get("bits_plan_ref", True)]  # fmt: skip
        best = sorted(timed, key=lambda r: r["ms"])[: self.a.top]
        for r in best:
            ln = Launch(r["rows"], r["bk"], r["warps"], r["ps"], r["stages"])
            for n in self.tokens:
                self.run_case("top", ln, "prefill", n)
            self.run_case("top", dataclasses.replace(ln, structure="split"), "prefill", mid)
            for cfg in [c for c in self.a.configs.split(",") if c]:
                self.run_case("top", dataclasses.replace(ln, config=cfg), "prefill", mid)
        for plan in self.plans():
            for s in [None, *stages]:
                for b, ctx in self.decodes:
                    ln = Launch(*plan, stages=s, structure="split")
                    self.run_case("decode", ln, "decode", b, ctx)
        if self.skipped:
            print(f"{self.skipped} candidates skipped: past the budget", flush=True)


# ---------------------------------------------------------------- parent: budget and restarts


def _read(progress: str) -> tuple[list[dict], str | None]:
    rows, open_id = [], None
    if os.path.exists(progress):
        with open(progress) as fh:
            for line in fh:
                rec = json.loads(line)
                if "start" in rec:
                    open_id = rec["start"]
                else:
                    rows.append(rec["row"])
                    open_id = None if rec["row"]["id"] == open_id else open_id
    return rows, open_id


def parent(a: argparse.Namespace, argv: list[str]) -> dict:
    os.makedirs(a.out, exist_ok=True)
    progress = os.path.join(a.out, "attention_sweep.progress.jsonl")
    if os.path.exists(progress):
        os.remove(progress)
    t0 = time.time()
    deadline = t0 + a.budget_s
    env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
    crashes = []
    while time.time() < deadline:
        cmd = [sys.executable, "-m", "benchmarks.attention_sweep", *argv, "--child",
               "--progress", progress, "--deadline", str(deadline)]  # fmt: skip
        try:
            rc = subprocess.run(cmd, env=env, timeout=deadline - time.time() + 60).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        if rc == 0:
            break
        _, open_id = _read(progress)
        if open_id is None:
            crashes.append({"id": "child", "error": f"child exited {rc} between candidates"})
            break
        row = {"id": open_id, "error": f"killed the child process (exit {rc})"}
        crashes.append(row)
        with open(progress, "a") as fh:  # the restarted child skips it
            fh.write(json.dumps({"row": row}) + "\n")
        if rc == "timeout":
            break
    rows, _ = _read(progress)
    dev = next((r for r in rows if r["id"] == "device"), {})
    result = {"device": dev.get("device"), "jax": dev.get("jax"), "settings": vars(a),
              "wall_s": round(time.time() - t0, 1), "crashes": crashes, "rows": rows}  # fmt: skip
    with open(os.path.join(a.out, "attention_sweep.json"), "w") as fh:
        json.dump(result, fh, indent=1)
    print(table(rows))
    return result


def table(rows: list[dict]) -> str:
    """Per case, fastest first: time, rate, ratio to cuDNN, bit checks."""
    cols = ["stage", "structure", "rows", "bk", "warps", "stages", "ps", "config", "ms",
            "TFLOPs", "GBps", "x_cudnn", "bits_plan_ref", "bits_chunked", "bits_decode",
            "bits_equal_baseline_plan"]  # fmt: skip
    out = []
    for case in dict.fromkeys(r.get("case") for r in rows if "case" in r):
        out.append(f"\n== {case}")
        out.append(" ".join(f"{c[:10]:>10}" for c in ["impl", *cols]))
        for r in sorted((r for r in rows if r.get("case") == case), key=lambda r: r["ms"]):
            cells = [r.get("impl", "jdet"), *(r.get(c, "") for c in cols)]
            out.append(" ".join(f"{c:>10.4g}" if isinstance(c, float) else f"{str(c)[:10]:>10}"
                                for c in cells))  # fmt: skip
    errs = [r for r in rows if "error" in r]
    if errs:
        out.append(f"\n{len(errs)} candidates failed (errors in the JSON), e.g.:")
        out += [f"  {r['id']}: {r['error'][:160]}" for r in errs[:8]]
    return "\n".join(out)


def main(argv: list[str]) -> None:
    a = parser().parse_args(argv)
    if a.tiny:
        _tiny(a)
    if a.child:
        Sweep(a).run()
    else:
        parent(a, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
