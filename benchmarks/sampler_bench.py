"""What the lean sampler saves (issue 11): the full sampler (top-k/top-p filter and top-20
log-probs, what every step ran before serving/engine/sampler_variants.py) against the lean one
(neither), side by side in one process, alternating, for greedy rows (which need neither: same
bits).

Rows, per batch size B:
- `sampler`: the jitted `jdet.sampling.sample` alone on random f32 logits [B, V];
- `device`: the decode step at context --ctx (decode_bench.decode_inputs), steps back to back;
- `engine` (B = 1): greedy generation through `Engine.step`, median step after the prefill, the
  engine held to the full variant (as before) vs its own choice (lean), synchronous and async.
Each figure is the median (and min) over --reps alternating rounds.

    PYTHONPATH=. python -m benchmarks.sampler_bench --shape llama3-8b --out OUT   # a GPU
    python -m benchmarks.sampler_bench --shape embedded --ctx 256                # this CPU
Writes `sampler_bench.json` to --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def _alternate(fns: dict, reps: int) -> dict:
    """Median and min seconds of each callable (one timed round each, in turn, `reps` times)."""
    got: dict = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            got[k].append(f())
    return {k: {"median_s": statistics.median(v), "min_s": min(v)} for k, v in got.items()}


def _timed(fn: Any, iters: int) -> Any:
    import jax

    def one() -> float:
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / iters

    jax.block_until_ready(fn())  # compile
    return one


def sampler_rows(vocab: int, batch: int, mode: str, reps: int) -> dict:
    import jax
    import jax.numpy as jnp

    from jdet.ops import Ops
    from jdet.sampling import SamplingInputs, sample
    from jdet.step import xla_options
    from serving.engine.sampler_variants import FULL, LEAN

    ops = Ops(invariance=mode)
    fn = jax.jit(lambda lg, inp: sample(lg, inp, ops), compiler_options=xla_options(ops) or None)
    lg = jax.random.normal(jax.random.PRNGKey(0), (batch, vocab), jnp.float32) * 3
    z = np.zeros(batch, np.float32)
    base = jax.device_put(
        SamplingInputs(
            z,
            np.zeros(batch, np.int32),
            z + 1,
            np.zeros(batch, np.uint32),
            np.zeros(batch, np.int32),
        )
    )
    inputs = {"full": dataclasses.replace(base, **FULL.fields()),
              "lean": dataclasses.replace(base, **LEAN.fields())}  # fmt: skip
    return _alternate({k: _timed(lambda i=i: fn(lg, i), 20) for k, i in inputs.items()}, reps)


def device_rows(runner: Any, batch: int, ctx: int, reps: int) -> dict:
    from benchmarks.decode_bench import decode_inputs, pages_for
    from serving.engine.sampler_variants import FULL, LEAN

    # host arrays, as the engine passes them (its step packs them: serving/engine/host_inputs.py)
    sb, si = decode_inputs(runner.cfg, batch, ctx, pages_for(ctx, 32))
    sb = runner.place_tokens(sb)
    inputs = {"full": dataclasses.replace(si, **FULL.fields()),
              "lean": dataclasses.replace(si, **LEAN.fields())}  # fmt: skip

    def step(si: Any) -> Any:
        runner.kv, out = runner.step_fn(runner.params, runner.kv, sb, si)
        return out.tokens

    return _alternate({k: _timed(lambda s=s: step(s), 8) for k, s in inputs.items()}, reps)


def engine_rows(eng: Any, ctx: int, steps: int, reps: int) -> dict:
    from benchmarks.decode_bench import engine_step
    from serving.engine.sampler_variants import FULL

    default = eng.runner.variants
    got: dict = {}
    n = 0
    for r in range(reps):
        for async_ in (False, True):
            eng.async_scheduling = async_
            for name, variants in (("full", (FULL,)), ("lean", default)):
                eng.runner.variants = variants  # this engine held to the full sampler
                try:
                    s = engine_step(eng, ctx, steps, rid=f"r{n}")["engine_step_s"]
                finally:
                    eng.runner.variants = default
                n += 1
                if r:  # the first round compiles
                    got.setdefault(f"{name}_{'async' if async_ else 'sync'}", []).append(s)
    return {k: {"median_s": statistics.median(v), "min_s": min(v)} for k, v in got.items()}


def load(shape: str, max_len: int) -> Any:
    if shape == "embedded":
        import jdet

        return jdet.load()
    from benchmarks.decode_bench import random_model

    return random_model(shape, max_len)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shape", default="llama3-8b", help="decode_bench shape, or 'embedded'")
    p.add_argument("--mode", default="tp")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32, help="engine steps timed per generation")
    p.add_argument("--reps", type=int, default=7)
    a = p.parse_args(argv)
    import jax

    from benchmarks.decode_bench import make_engine, pages_for, pages_used

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    res: dict = {"args": vars(a), "device": jax.devices()[0].device_kind,
                 "load_avg": os.getloadavg(), "rows": []}  # fmt: skip
    model = load(a.shape, a.ctx + a.steps + 64)
    eng = make_engine(
        model,
        a.mode,
        a.ctx + a.steps + 64,
        max(batches) * pages_used(a.ctx) + pages_for(a.ctx, a.steps) + 8,
    )
    for b in batches:
        row = {"batch": b, "sampler": sampler_rows(model.cfg.vocab_size, b, a.mode, a.reps),
               "device": device_rows(eng.runner, b, a.ctx, a.reps)}  # fmt: skip
        if b == 1:
            row["engine"] = engine_rows(eng, a.ctx, a.steps, max(2, a.reps // 2))
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    res["load_avg_end"] = os.getloadavg()
    (out / "sampler_bench.json").write_text(json.dumps(res, indent=1, default=str))
    for row in res["rows"]:
        for part in ("sampler", "device", "engine"):
            r = row.get(part, {})
            print(f"B={row['batch']} {part}: " + ", ".join(
                f"{k} {v['median_s'] * 1e3:.3f} ms (min {v['min_s'] * 1e3:.3f})"
                for k, v in r.items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
