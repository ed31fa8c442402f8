"""Start-up of a default engine, and what one process keeps between two engines.

    PYTHONPATH=. python -m benchmarks.start_bench [--shape llama3-8b] [--out DIR] [--smoke]

Rows (start_bench.json; random bf16 weights of the named shape, `jdet.LLM(model)` defaults):
- start, cold and warm: a fresh process builds the engine and generates one token (warm-up of
  every step shape included), first on an empty cache directory, then on the one it wrote
  (jdet's executable cache); seconds to the engine and to the token, executables made, the
  cache's loads and writes;
- step, split and fused: in one more process on the warm cache, batch-1 greedy decode ms/token
  through `LLM.generate` (ctx 1024) with the step as two programs (`step_programs="split"`, as
  the starts run it unless `--step-programs` says otherwise) and as one (`"fused"`, a GPU's
  default; shapes compiled as met), the two engines one after the other; the first engine's
  build (a restart's, on the warm cache) under cProfile: its costliest calls;
- second engine: between them, the device arrays and bytes the deleted first engine left, and
  the second engine's pool against the first's (a holder of the first's memory shrinks it). On
  a CPU a bf16 model's weights keep a copy of each matmul weight that the engine's host-side
  layout read through `np.asarray` (JAX's own cache, freed with the model, not the engine);
- failed tries: the second engine's pool re-allocated from twice its pages
  (serving/engine/memory.py `allocate_to_fit`): the tries that fail must free their arrays, so
  it ends within 10 % of the pages that fit.
`--smoke`: the tiny shape on a CPU (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import logging
import os
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.user_bench import _decode_ms, _engine_row, _model, environment


def _child_rows(cmd: list[str], part: str, env: dict) -> list[dict]:
    """The JSON rows a fresh process printed, and a row with its stderr's tail if it failed
    (a run that dies halfway keeps what it measured and says why it stopped)."""
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode != 0 or not rows:
        rows.append({"part": part, "returncode": p.returncode, "error": p.stderr[-3000:]})
    return rows


def _top_calls(prof: cProfile.Profile, n: int = 30) -> list[str]:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(n)
    return [ln.rstrip() for ln in buf.getvalue().splitlines() if ln.strip()][-n:]


def _start_child(shape: str, max_len: int, step_programs: str = "auto") -> None:
    """One start, in this (fresh) process: prints its JSON row."""
    t0 = time.perf_counter()
    import jax

    import jdet
    from jdet import exec_cache

    model = _model(shape, max_len)
    jax.block_until_ready(model.params)
    t1 = time.perf_counter()
    llm = jdet.LLM(model, step_programs=step_programs)
    t2 = time.perf_counter()
    llm.generate([[1, 2, 3, 4]], jdet.SamplingParams(max_tokens=1, temperature=0.0))
    t3 = time.perf_counter()
    runner = llm.engine.runner
    print(json.dumps(_engine_row(
        llm, part="start", import_and_weights_s=t1 - t0, engine_s=t2 - t1,
        first_token_after_engine_s=t3 - t2, ready_s=t3 - t1, step=type(runner.step_fn).__name__,
        shapes=len(runner.shapes.all()), variants=len(runner.variants),
        exec_cache=exec_cache.stats())), flush=True)  # fmt: skip


def _budget(llm: Any) -> str | None:
    b = llm.engine.memory_budget
    return None if b is None else b.describe()


def _device_state() -> dict:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    live = jax.live_arrays()
    return {"live_arrays": len(live), "live_bytes": sum(a.nbytes for a in live),
            **{k: stats.get(k) for k in ("bytes_in_use", "largest_free_block_bytes",
                                         "bytes_limit")}}  # fmt: skip


def _step_child(shape: str, max_len: int, smoke: bool) -> None:
    """Split then fused decode, the second engine and the failed tries, in this process."""
    import numpy as np

    import jdet
    from serving.engine import memory

    model = _model(shape, max_len)
    steps, ctx = (8, 64) if smoke else (128, 1024)
    base = _device_state()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    llm = jdet.LLM(model, step_programs="split")
    prof.disable()
    engine_s = time.perf_counter() - t0
    ms, _ = _decode_ms(llm, ctx, np.random.default_rng(0), steps=steps)
    first = _engine_row(llm, part="step", step="split", ctx=ctx, decode_ms=ms,
                        budget=_budget(llm), profiled_engine_s=engine_s,
                        engine_calls=_top_calls(prof))  # fmt: skip
    print(json.dumps(first), flush=True)
    del llm
    gc.collect()
    after = _device_state()
    t0 = time.perf_counter()
    # the fused step's shapes compile as they are met
    llm = jdet.LLM(model, warmup=False, step_programs="fused")
    second = {"engine_s": time.perf_counter() - t0}
    ms, _ = _decode_ms(llm, ctx, np.random.default_rng(0), steps=steps)
    print(json.dumps(_engine_row(llm, part="step", step="fused", ctx=ctx, decode_ms=ms,
                                 budget=_budget(llm))), flush=True)  # fmt: skip
    print(json.dumps({"part": "second_engine", "before_first": base, "after_first_deleted": after,
                      "first_pages": first["num_pages"],
                      "second_pages": llm.engine.page_manager.num_pages, **second}),
          flush=True)  # fmt: skip
    runner, budget = llm.engine.runner, llm.engine.memory_budget
    if budget is not None:  # a device with a memory limit: the pool was sized
        pages = runner.num_pages
        tries: list[str] = []  # each failed try's line (the allocator's error, in-use, block)
        catch = logging.Handler()
        catch.emit = lambda rec: tries.append(rec.getMessage()[:400])  # type: ignore[method-assign]
        logging.getLogger(memory.__name__).addHandler(catch)
        t0 = time.perf_counter()
        got = memory.allocate_to_fit(runner, 2 * pages, keep_free=budget.peak)
        print(json.dumps({"part": "failed_tries", "fits": pages, "asked": 2 * pages, "got": got,
                          "within_10pct": got >= 0.9 * pages, "s": time.perf_counter() - t0,
                          "tries": tries, "device": _device_state()}), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--max-len", type=int, default=8192, help="the model's max positions")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on a CPU: checks the script")
    ap.add_argument("--step-programs", default="split", choices=("auto", "split", "fused"),
                    help="the step the starts run (EngineConfig.step_programs; 'auto' is a "
                         "user's default)")  # fmt: skip
    ap.add_argument("--child", choices=("start", "step"), help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    shape = "tiny" if a.smoke else a.shape
    if a.child == "start":
        _start_child(shape, a.max_len, a.step_programs)
        return 0
    if a.child == "step":
        _step_child(shape, a.max_len, a.smoke)
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"shape": shape, "env": environment(), "rows": []}
    me = [sys.executable, "-m", "benchmarks.start_bench", "--shape", shape,
          "--max-len", str(a.max_len), "--step-programs", a.step_programs,
          ] + (["--smoke"] if a.smoke else [])  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="jdet-start-bench-") as cache:
        env = {**os.environ, "JDET_CACHE_DIR": cache, "JDET_WARMUP": "1"}
        runs = [("start", "cold"), ("start", "warm"), ("step", "warm")]
        for child, which in runs:
            for row in _child_rows([*me, "--child", child], child, env):
                result["rows"].append({**row, "cache": which})
                print(json.dumps(result["rows"][-1])[:3000], flush=True)
            (out / "start_bench.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
