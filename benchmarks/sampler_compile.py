"""What the sampler costs to compile on a CPU (issue 17: compiles are ~3/4 of the CPU test suite).

On a CPU an engine compiles the sampler once per (rows, vocabulary, variant) (serving/
host_inputs.py `SplitStep`); the "none" mode's one-program step holds it too. XLA CPU compiles
each fusion of a program through its own emitter pipeline (~10 ms apiece on the 2-core CI
machine), so a construction with many small fusions is slow to compile however cheap it runs.
Measured here, one process, each program compiled `--reps` times afresh (`lower().compile()`,
no cache), the median, and its run time at those shapes:
- the top-p filter's cumulative sums: `lax.associative_scan` (what the sampler used everywhere
  before, still its GPU path), `xla_fixed.prefix_sum` (its CPU path now), `jnp.cumsum` (XLA's
  reduce-window rewrite, for reference: its order is XLA's choice);
- the top-p filter's descending sort: XLA CPU's float sort against `xla_fixed.sort_descending`
  (the same values sorted as int32 keys);
- the FULL / LEAN / GREEDY samplers (serving/engine/sampler_variants.py) with rows that filter
(top-k 40, top-p 0.9, temperature 0.8), and FULL again with the associative scan put back, then also
  the float sort ("full_before": the CPU sampler as it was), so before and after are side by
  side.

    python -m benchmarks.sampler_compile [--rows 8] [--vocab 8192] [--reps 3] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def _measure(fn, args: tuple, reps: int, iters: int = 50) -> dict:
    import jax

    compiles = []
    for _ in range(reps):
        jax.clear_caches()  # else the trace, lowering and executable of the last rep are reused
        lowered = jax.jit(fn).lower(*args)
        t0 = time.perf_counter()
        exe = lowered.compile()
        compiles.append(time.perf_counter() - t0)
    jax.block_until_ready(exe(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = exe(*args)
    jax.block_until_ready(out)
    run_ms = (time.perf_counter() - t0) / iters * 1e3
    return {"compile_s": statistics.median(compiles), "run_ms": run_ms}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)  # the embedded model's
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jdet import sampling
    from jdet.ops import Ops
    from pallas_kernels import xla_fixed
    from serving.engine.sampler_variants import FULL, GREEDY, LEAN

    jax.config.update("jax_enable_compilation_cache", False)  # a compile, never a disk load
    n, v = a.rows, a.vocab
    probs = jnp.asarray(np.random.default_rng(0).random((n, v), np.float32) / v)
    rows: dict = {"backend": jax.default_backend(), "rows": n, "vocab": v, "jax": jax.__version__}
    scans = {
        "associative_scan": lambda p: jax.lax.associative_scan(jnp.add, p, axis=-1),
        "prefix_sum": xla_fixed.prefix_sum,
        "jnp.cumsum": lambda p: jnp.cumsum(p, axis=-1),
    }
    rows["cumulative"] = {k: _measure(f, (probs,), a.reps) for k, f in scans.items()}
    sorts = {"float_sort": lambda x: -jnp.sort(-x, axis=-1),
             "int32_keys": xla_fixed.sort_descending}  # fmt: skip
    rows["descending_sort"] = {k: _measure(f, (probs,), a.reps) for k, f in sorts.items()}

    ops = Ops(invariance="tp")
    logits = jnp.asarray(np.random.default_rng(1).standard_normal((n, v), np.float32))

    def inputs(variant) -> sampling.SamplingInputs:
        u = 128  # a penalty width (the step's Pmax * page_size)
        li = sampling.LogitsInputs(
            min_p=jnp.zeros(n), presence=jnp.zeros(n), frequency=jnp.zeros(n),
            repetition=jnp.ones(n), pen_ids=-jnp.ones((n, u), jnp.int32),
            pen_counts=jnp.zeros((n, u), jnp.int32),
            bias_ids=-jnp.ones((n, sampling.MAX_LOGIT_BIAS), jnp.int32),
            bias_vals=jnp.zeros((n, sampling.MAX_LOGIT_BIAS)),
            mask=-jnp.ones((n, -(-v // 32)), jnp.int32),
        )  # fmt: skip
        return sampling.SamplingInputs(
            temperature=jnp.full(n, 0.8), top_k=jnp.full(n, 40, jnp.int32),
            top_p=jnp.full(n, 0.9), seed=jnp.arange(n, dtype=jnp.uint32),
            position=jnp.arange(n, dtype=jnp.int32), logits=li if variant.transforms else None,
            **variant.fields(),
        )  # fmt: skip

    def sampler(variant):
        inp = inputs(variant)
        return _measure(lambda lg, i: sampling.sample(lg, i, ops).tokens, (logits, inp), a.reps)

    rows["sampler"] = {name: sampler(var) for name, var in
                       (("full", FULL), ("lean", LEAN), ("greedy", GREEDY))}  # fmt: skip
    current = sampling._cumulative, sampling._descending
    try:  # the CPU filter as it was: the GPU's associative scan, then also its float sort
        sampling._cumulative = scans["associative_scan"]
        rows["sampler"]["full_with_associative_scan"] = sampler(FULL)
        sampling._descending = lambda x: -jnp.sort(-x, axis=-1)
        rows["sampler"]["full_before"] = sampler(FULL)
    finally:
        sampling._cumulative, sampling._descending = current
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sampler_compile.json").write_text(json.dumps(rows, indent=2))
    print(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
