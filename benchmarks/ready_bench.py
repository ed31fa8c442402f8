"""Time-to-ready and the price of a bounded shape set; writes `ready_bench.json` to --out.

1. Time-to-ready of three starts, each a fresh process, from the interpreter's start to an
   engine whose every step shape is compiled (what `jdet serve` does before /health says 200):
   imports, random weights of the shape, the engine (KV pool), `Engine.warmup()`.
   - first start: empty caches (it writes JAX's persistent XLA cache and jdet's executable cache);
   - second start, XLA cache only (JDET_EXEC_CACHE=0): compiles are cache loads, but every shape
     is still traced and lowered;
   - second start, executable cache (the default): each shape's executable is loaded from jdet's
     cache (jdet/exec_cache.py), nothing traced.
   Also reported: the warm-up alone, shapes, compilations, cache hits, step tracings, executable
   cache loads/writes. A table on stdout, the JSON in --out.
2. With --padding, in the last start: device time of representative steps at the shape-set
   bucket the engine would pick against the exact (unpadded) shape (compiled once just for this),
   same data, same run. Rows: decode at batch 1, 8 and 64 (ctx 1024), one prefill chunk, a mixed
   decode+prefill step.

Weights are random with the shapes of Qwen3-0.6B/8B (benchmarks/serve_bench.py), drawn on the
device (`--host-weights`: numpy on the host as serve_bench does, 140 s a start on the 8B shape).
On a CPU `--smoke` runs the tiny shape in seconds. On one H100, 8B shape (< 5 minutes without
--padding):

    PYTHONPATH=. python -m benchmarks.ready_bench --out $OUT --shape 8b [--padding] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

_T0 = time.perf_counter()  # the child's clock starts at its import of this module


def engine_settings(a: argparse.Namespace) -> dict:
    return dict(
        invariance=a.mode, max_num_batched_tokens=a.budget, max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len, page_size=a.page_size, num_pages=a.num_pages,
    )  # fmt: skip


# ---------------------------------------------------------------------- 1. one start (child)
def start(a: argparse.Namespace) -> dict:
    """One start from scratch in this process; the padding rows when asked for."""
    from jdet import compile_cache as cc
    from jdet import exec_cache

    cc.enable(a.cache_dir)  # before the weights are made: their compiles are cached too
    cc.install_counter()
    import jax

    from benchmarks.serve_bench import random_model
    from serving.engine.engine import Engine

    t_imp = time.perf_counter() - _T0
    model = random_model(a.shape, a.dtype, max_len=max(a.max_model_len, 4096),
                         on_device=not a.host_weights)  # fmt: skip
    jax.block_until_ready(model.params)
    t_model = time.perf_counter() - _T0
    eng = Engine(model, **engine_settings(a), compile_cache=a.cache_dir)
    t_engine = time.perf_counter() - _T0
    s0, traced0 = cc.stats(), cc.traced()
    warm = eng.warmup("step", progress=False)
    ready = time.perf_counter() - _T0
    s, traced = cc.stats(), cc.traced()
    res = {
        "time_to_ready_s": ready, "imports_s": t_imp, "model_s": t_model - t_imp,
        "engine_s": t_engine - t_model, "warmup_s": warm,
        "shapes": len(eng.runner.shapes.all()), "shape_set": {
            "tokens": eng.runner.shapes.tokens, "pages": eng.runner.shapes.pages,
            "max_seqs": eng.runner.shapes.max_seqs},
        "compiles": s.compiles, "compile_s": s.seconds, "cache_hits": s.cache_hits,
        "warmup_compiles": s.compiles - s0.compiles, "warmup_compile_s": s.seconds - s0.seconds,
        "warmup_cache_hits": s.cache_hits - s0.cache_hits,
        "warmup_traces": s.traces - s0.traces, "warmup_lowerings": s.lowerings - s0.lowerings,
        "warmup_trace_lower_s": s.trace_seconds - s0.trace_seconds,
        "step_traces": traced.get("step", 0) - traced0.get("step", 0),
        "exec_cache": exec_cache.stats(), "exec_cache_on": exec_cache.enabled_by_env(),
        "device": jax.devices()[0].device_kind, "jax": jax.__version__,
    }  # fmt: skip
    if a.padding:
        res["padding"] = padding(eng, a)
        res["engine_decode_b1"] = engine_decode(eng, a)
        eng.async_scheduling = True  # the same, each step dispatched before the last one's tokens
        res["engine_decode_b1_async"] = engine_decode(eng, a, rid="b1-async")
        res["engine_decode_b1_async"]["steps_ahead"] = eng.num_steps_ahead
    return res


def engine_decode(eng: Any, a: argparse.Namespace, rid: str = "b1") -> dict:
    """Batch-1 greedy decode at ctx `decode_ctx` through `Engine.step()` (host work included):
    median step time, to set against the device-only step of the same shape (padding rows)."""
    ids = np.random.default_rng(1).integers(1, eng.cfg.vocab_size, a.decode_ctx - 1).tolist()
    eng.add_request(rid, ids, dict(temperature=0.0, max_tokens=a.decode_steps, ignore_eos=True))
    times = []
    while eng.has_unfinished():
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    return {"ctx": a.decode_ctx, "steps": len(times),
            "engine_step_s": float(np.median(times[4:])) if len(times) > 8 else None}  # fmt: skip


# ---------------------------------------------------------------------- 2. padding cost
def _batch(seqs: list[tuple[int, int]], page_size: int, pad: tuple[int, int, int] | None,
           vocab: int, num_pages: int) -> tuple[Any, Any]:  # fmt: skip
    """(new tokens, start position) per sequence -> StepBatch + greedy SamplingInputs, padded to
    `pad` (T, S, Pmax) or exact (None). Sequence i reads pages i * 64, ... (mod the pool): junk
    K/V, only the time matters."""
    from jdet.batch import build_batch
    from jdet.step import SamplingInputs

    rng = np.random.default_rng(0)
    items = []
    for i, (n, start) in enumerate(seqs):
        pages = [(i * 64 + j) % num_pages for j in range(-(-(start + n) // page_size))]
        items.append((rng.integers(1, vocab, n).tolist(), start, pages))
    T, S = sum(n for n, _ in seqs), len(seqs)
    Tp, Sp, Pp = pad or (T, S, max(len(p) for _, _, p in items))
    batch, _ = build_batch(items, page_size, pad_tokens=Tp, pad_seqs=Sp, pad_pages=Pp)
    rows = np.zeros(Sp, np.int32)
    rows[:S] = batch.logits_rows
    batch.logits_rows = rows
    pos = np.zeros(Sp, np.int32)
    pos[:S] = [start + n for n, start in seqs]
    z = np.zeros(Sp, np.float32)
    sampling = SamplingInputs(temperature=z, top_k=np.zeros(Sp, np.int32), top_p=z + 1,
                              seed=np.zeros(Sp, np.uint32), position=pos)  # fmt: skip
    return batch, sampling


def padding(eng: Any, a: argparse.Namespace) -> list[dict]:
    import jax

    r = eng.runner
    B, V = r.page_size, r.cfg.vocab_size
    ctx = a.decode_ctx
    cases = {
        "decode b=1": [(1, ctx)],
        "decode b=8": [(1, ctx)] * 8,
        "decode b=64": [(1, ctx)] * 64,
        "prefill 300": [(300, 0)],
        "mixed 32 decodes + 200 prefill": [(1, ctx)] * 32 + [(200, 0)],
    }
    rows = []
    for name, seqs in cases.items():
        T, S = sum(n for n, _ in seqs), len(seqs)
        if T > a.budget or S > a.max_num_seqs:
            continue
        P = -(-(max(n + s for n, s in seqs)) // B)
        fixed = r.shapes.fit(T, S, P)
        row: dict[str, Any] = {"case": name, "exact": (T, S, P), "fixed": fixed}
        for label, pad in (("exact", None), ("fixed", fixed)):
            batch, sampling = _batch(seqs, B, pad, V, eng.page_manager.num_pages)
            t0 = time.perf_counter()
            r.kv, out = r.step_fn(r.params, r.kv, batch, sampling)  # compile (exact) or not
            jax.block_until_ready(out)
            row[f"{label}_first_call_s"] = time.perf_counter() - t0
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    r.kv, out = r.step_fn(r.params, r.kv, batch, sampling)
                jax.block_until_ready(out)
                times.append((time.perf_counter() - t0) / a.iters)
            row[f"{label}_step_s"] = float(np.median(times))
        row["fixed_over_exact"] = row["fixed_step_s"] / row["exact_step_s"]
        if name.startswith("decode") and fixed[2] != r.shapes.pages[-1]:
            # the same step with the page table at its largest bucket: what one Pmax would cost
            big = (fixed[0], fixed[1], r.shapes.pages[-1])
            batch, sampling = _batch(seqs, B, big, V, eng.page_manager.num_pages)
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                for _ in range(a.iters):
                    r.kv, out = r.step_fn(r.params, r.kv, batch, sampling)
                jax.block_until_ready(out)
                times.append((time.perf_counter() - t0) / a.iters)
            row["pmax_max"] = big
            row["pmax_max_step_s"] = float(np.median(times))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


# ---------------------------------------------------------------------- driver
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ready_bench", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shape", default="8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--mode", default="tp")
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument(
        "--num-pages", type=int, default=3600,
        help="pinned, since a pool size is a shape (8B: below the kernel's 2**31-element cap)",
    )  # fmt: skip
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cache-dir", default=None, help="default: a fresh temporary directory")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--padding", action="store_true", help="padding-cost rows, in the last start")
    p.add_argument("--host-weights", action="store_true", help="numpy weights (slow, as before)")
    p.add_argument("--smoke", action="store_true", help="tiny model on a CPU")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    if a.smoke:
        a.shape, a.dtype, a.budget, a.max_num_seqs = "tiny", "float32", 32, 16
        a.max_model_len, a.page_size, a.num_pages, a.decode_ctx = 128, 8, 600, 40
        a.iters, a.reps, a.decode_steps = 2, 2, 12
    if a.child:
        print("RESULT " + json.dumps(start(a)), flush=True)
        return 0
    cache = a.cache_dir or tempfile.mkdtemp(prefix="jdet-ready-")
    base = [sys.executable, "-m", "benchmarks.ready_bench", "--child", "--cache-dir", cache]
    base += [x for x in argv if x not in ("--child", "--padding")]
    res: dict[str, Any] = {"settings": vars(a), "commit": os.environ.get("JDET_COMMIT")}
    os.makedirs(a.out, exist_ok=True)
    starts = (
        ("first_start", "first start (empty caches)", {}, []),
        ("second_start_xla", "second start, XLA cache only", {"JDET_EXEC_CACHE": "0"}, []),
        ("second_start_exec", "second start, executable cache", {"JDET_EXEC_CACHE": "1"},
         ["--padding"] if a.padding else []),
    )  # fmt: skip
    for name, _, env, extra in starts:
        p = subprocess.run(
            base + extra, capture_output=True, text=True, check=False, env={**os.environ, **env}
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            res[name + "_error"] = (p.stdout + p.stderr)[-4000:]
            print(res[name + "_error"], file=sys.stderr)
            break
        res[name] = json.loads(line[-1][len("RESULT ") :])
        warned = [x for x in p.stderr.splitlines() if "jdet exec cache" in x]
        res[name]["exec_cache_warnings"] = warned[:5]  # e.g. a JAX that cannot serialize
        for x in warned[:5]:
            print(f"{name}: {x}", flush=True)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "padding"}),
              flush=True)  # fmt: skip
        with open(os.path.join(a.out, "ready_bench.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    if "first_start" in res:
        f = res["first_start"]
        for name, _, _, _ in starts[1:]:
            if name in res:
                s = res[name]
                res[name]["ready_over_first"] = s["time_to_ready_s"] / f["time_to_ready_s"]
                res[name]["warmup_over_first"] = s["warmup_s"] / f["warmup_s"]
        print(table(res, starts))
    with open(os.path.join(a.out, "ready_bench.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    return 0


def table(res: dict, starts: tuple) -> str:
    """The starts side by side (markdown)."""
    cols = [
        ("time to ready s", "time_to_ready_s", "{:.1f}"), ("weights s", "model_s", "{:.1f}"),
        ("warm-up s", "warmup_s", "{:.1f}"), ("warm-up / first", "warmup_over_first", "{:.3f}"),
        ("ready / first", "ready_over_first", "{:.3f}"),
        ("compiles (cache hits)", None, None), ("trace+lower s", "warmup_trace_lower_s", "{:.1f}"),
        ("step traces", "step_traces", "{}"), ("exec loads/writes", None, None),
    ]  # fmt: skip
    f = res.get("first_start", {})
    head = f"{res['settings']['shape']} shape, {f.get('shapes')} step shapes, {f.get('device')}"
    lines = [head, "| start | " + " | ".join(c for c, _, _ in cols) + " |",
             "|---" * (len(cols) + 1) + "|"]  # fmt: skip
    for name, label, _, _ in starts:
        r = res.get(name)
        if r is None:
            continue
        cells = []
        for c, k, fmt in cols:
            if c.startswith("compiles"):
                cells.append(f"{r['warmup_compiles']} ({r['warmup_cache_hits']})")
            elif c.startswith("exec"):
                cells.append(f"{r['exec_cache']['loads']}/{r['exec_cache']['writes']}")
            else:
                cells.append(fmt.format(r[k]) if k in r else "—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
