"""Whether XLA CPU's dot of fewer rows gives the bits of the same rows of the CPU plan's 8-row dot.

Why: pallas_kernels/xla_fixed.py runs every matmul as [BM = 8, leaf_k] x [leaf_k, BN = 128] dots
(`tree_subtree`), so a batch-1 decode computes 8 rows for one token: the dots are most of the
embedded model's "tp" decode step, compute-bound at 8 rows. A 1-row block for a 1-token step
would cut that work 8x, but the plan may only choose the row block from M if every row's bits
are the same either way (DESIGN §4; docs/ARCHITECTURE.md "Where M may enter"). This probe
measures that on the machine it runs on: for each leaf_k, random f32 [m, leaf_k] x [leaf_k, BN]
dots with the plan's batch dimensions (leaf, n block), compiled with the invariant step's CPU
options (jdet/step.py `CPU_XLA_OPTIONS`) and with XLA's defaults, m = 1..7 against the rows of
the m = 8 dot, several draws each (a different accumulation order rounds differently for almost
every random input, so equal bits over the draws mean the same order). It decides nothing by
itself: it is the evidence a row block chosen from M would need, per machine.

    python -m benchmarks.row_block_probe [--ks 64,128,256,384,512,1024] [--draws 5]
        [--out row_block_probe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform


def probe(ks: list[int], draws: int, options: dict) -> dict[int, dict]:
    """{leaf_k: {"mismatched_rows_of": [m, ...], "cases": n}} for dots compiled with `options`."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from pallas_kernels.xla_fixed import BM, BN

    dims = (((3,), (2,)), ((0, 1), (0, 1)))  # tree_subtree's: batch (leaf, n block), contract K

    def dot(x, w):
        return lax.dot_general(x, w, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=jnp.float32)  # fmt: skip

    fn = jax.jit(dot, compiler_options=options) if options else jax.jit(dot)
    rng = np.random.default_rng(0)
    out: dict[int, dict] = {}
    for k in ks:
        bad, cases = set(), 0
        for _ in range(draws):
            for g in (1, 2, 4):  # n blocks per dot call, as blocked_products groups them
                a = rng.standard_normal((1, g, BM, k)).astype(np.float32)
                w = rng.standard_normal((1, g, k, BN)).astype(np.float32)
                full = np.asarray(fn(a, w))
                for m in range(1, BM):
                    cases += 1
                    if not np.array_equal(np.asarray(fn(a[:, :, :m], w)), full[:, :, :m]):
                        bad.add(m)
        out[k] = {"mismatched_rows_of": sorted(bad), "cases": cases}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ks", default="64,128,256,384,512,1024")
    p.add_argument("--draws", type=int, default=5)
    p.add_argument("--out", default="row_block_probe.json")
    a = p.parse_args(argv)
    import jax

    from jdet.step import CPU_XLA_OPTIONS

    if jax.default_backend() != "cpu":
        raise SystemExit(f"row_block_probe measures XLA CPU dots; the backend here is "
                         f"{jax.default_backend()!r} (run it with JAX_PLATFORMS=cpu)")  # fmt: skip
    ks = [int(k) for k in a.ks.split(",")]
    res = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
           "jax": jax.__version__, "what": "rows m < 8 of [m, K] x [K, 128] f32 dots vs the "
           "same rows of the 8-row dot, bitwise",
           "step_options": probe(ks, a.draws, CPU_XLA_OPTIONS),
           "xla_defaults": probe(ks, a.draws, {})}  # fmt: skip
    for name in ("step_options", "xla_defaults"):
        for k, r in res[name].items():
            bad = r["mismatched_rows_of"]
            verdict = f"differ (m = {bad})" if bad else "equal"
            print(f"{name:13s} leaf_k={k:5d}: {verdict} over {r['cases']} cases")
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
