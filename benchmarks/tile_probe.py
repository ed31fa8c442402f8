"""Tile probe for the Hopper matmul kernels: do other CTA shapes give the same bits, and how fast?

For each weight shape (K, N) and row count M, every candidate `MosaicConfig` of the BIO kernel (and
of the TBIK kernel's split-K path) is run on the same operands; the probe records whether its rows
are bitwise equal to the default config's and its time against XLA's `a @ b`. This is the evidence
behind choosing a CTA shape per M bucket (DESIGN §4 as amended): a shape may be used only if it
never changes a bit.

    PYTHONPATH=. python -m benchmarks.tile_probe --out OUT   (Hopper GPU only)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import traceback

import numpy as np

SHAPES = [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096),
          (1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # fmt: skip
MS = [1, 16, 64]


def bio_configs(n: int) -> dict:
    """The 128-row plan, the 64-row decode plan (`mosaic_config(m=1)`) and a wider 64-row CTA."""
    import jax.numpy as jnp

    from pallas_kernels import matmul_mosaic as mm

    out = jnp.bfloat16
    cfgs = {
        "base": mm.mosaic_config(n, out),
        "decode64x128": mm.mosaic_config(n, out, m=1),
        "cta64x256": mm.MosaicConfig(tile_m=64, tile_n=128, tile_k=mm.BLOCK_K,
                                     max_concurrent_steps=mm._stages(64, 256, 64, 128, out)),
        # deeper pipelines for decode: a 64-row CTA streams its K range alone, so the bytes in
        # flight per SM (stages x tile) bound its bandwidth; 8 stages is what SMEM holds
        "decode_s8": dataclasses.replace(mm.mosaic_config(n, out, m=1), max_concurrent_steps=8),
        "cta64x64_s12": mm.MosaicConfig(tile_m=64, tile_n=32, tile_k=mm.BLOCK_K,
                                        max_concurrent_steps=12, epi_tile_n=32),
        # one consumer warpgroup (DecodeTiles.cta_n = 64): twice the CTAs of decode64x128; 128-wide
        # K steps (DecodeTiles.tile_k = 128): half the pipeline steps per CTA
        "d64x64": _decode(64, 64),
        "d64x64_k128": _decode(64, 128),
        "d64x128_k128": _decode(128, 128),
    }  # fmt: skip
    return {k: c for k, c in cfgs.items() if n % c.cta_n == 0}


def _decode(cta_n: int, tile_k: int, subtree: int = 1):
    """`decode_config` with these CTA columns and K step (the module's defaults aside)."""
    import jax.numpy as jnp

    from pallas_kernels import matmul_mosaic as mm

    out = jnp.float32 if subtree > 1 else jnp.bfloat16
    return mm.decode_config(out, subtree, cta_n=cta_n, tile_k=tile_k)


def tree_configs() -> dict:
    import jax.numpy as jnp

    from pallas_kernels import matmul_mosaic as mm

    f32 = jnp.float32
    return {
        "narrow": mm.tree_config(4, mm.TREE_TILE_N, f32, False),
        "decode64x128": mm.tree_config(4, mm.TREE_TILE_N, f32, False, small=True),
        "decode_s8": dataclasses.replace(
            mm.tree_config(4, mm.TREE_TILE_N, f32, False, small=True), max_concurrent_steps=8
        ),
        "d64x64": _decode(64, 64, 4),
        "d64x64_k128": _decode(64, 128, 4),
        "d64x128_k128": _decode(128, 128, 4),
    }


def operands(m: int, k: int, n: int):
    """Values spread over many binades, so a changed summation order shows in the bits."""
    import jax.numpy as jnp

    rng = np.random.default_rng(m * 7 + k + n)
    a = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, k)))
    b = rng.standard_normal((k, n)) * np.exp(rng.standard_normal((k, n))) / np.sqrt(k)
    return jnp.asarray(a, jnp.bfloat16), jnp.asarray(b, jnp.bfloat16)


def _bio_fn(cfg, m: int):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import matmul_mosaic as mm

    return jax.jit(lambda a, b: mm._leaf_products(a, b, jnp.dtype(jnp.bfloat16), 1, cfg)[0, :m])


def _tree_fn(cfg, m: int, num_leaves: int):
    import jax
    import jax.numpy as jnp

    from pallas_kernels import matmul_mosaic as mm
    from pallas_kernels.tree_matmul import combine_tree

    def f(a, b):
        p = mm._leaf_products(a, b, jnp.dtype(jnp.float32), num_leaves, cfg)
        return combine_tree([p[j, :m] for j in range(p.shape[0])]).astype(jnp.bfloat16)

    return jax.jit(f)


def _measure(f, a, b, t_xla: float, ref: np.ndarray | None) -> tuple[dict, np.ndarray | None]:
    """(record, reference): the first config that runs becomes the reference of the others."""
    from benchmarks.matmul_bench import _time_op

    try:
        y = np.asarray(f(a, b))
        ref = y if ref is None else ref
        t = _time_op(f, a, b, y.nbytes)
        rec = {"us": t * 1e6, "x_xla": t_xla / t, "bits_equal_base": bool(np.array_equal(y, ref))}
        return rec, ref
    except Exception as e:  # noqa: BLE001 - a config the kernel cannot build
        return {"error": f"{type(e).__name__}: {str(e)[:400]}"}, ref


def probe(out_dir: str, shapes=SHAPES, ms=MS) -> dict:
    import jax
    import jax.numpy as jnp

    from benchmarks.matmul_bench import _time_op
    from pallas_kernels.tree_matmul import tree_plan

    rows = []
    for k, n in shapes:
        plan = tree_plan(k, jnp.dtype(jnp.bfloat16))
        for m in ms:
            a, b = operands(m, k, n)
            t_xla = _time_op(lambda a, b: a @ b, a, b, m * n * 2)
            row = {"k": k, "n": n, "m": m, "xla_us": t_xla * 1e6, "bio": {}, "tree": {}}
            ref = None
            for name, cfg in bio_configs(n).items():
                row["bio"][name], ref = _measure(_bio_fn(cfg, m), a, b, t_xla, ref)
            ref = None
            for name, cfg in tree_configs().items():
                if n % cfg.cta_n == 0 and plan.num_leaves >= 4:
                    f = _tree_fn(cfg, m, plan.num_leaves)
                    row["tree"][name], ref = _measure(f, a, b, t_xla, ref)
            rows.append(row)
            recs = {**row["bio"], **{"tree:" + t: v for t, v in row["tree"].items()}}
            brief = {c: [round(v["us"], 1), v["bits_equal_base"]] if "us" in v else v["error"]
                     for c, v in recs.items()}  # fmt: skip
            print(json.dumps({"k": k, "n": n, "m": m, "xla_us": round(t_xla * 1e6, 1), **brief}),
                  flush=True)  # fmt: skip
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "tile_probe.json"), "w") as fh:
                json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                           "rows": rows}, fh, indent=1)  # fmt: skip
    return {"rows": rows}


def run(out_dir) -> dict:
    """gpu_suite entry point."""
    return probe(str(out_dir))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out")
    p.add_argument("--shapes", default="", help="K:N,K:N (default: SHAPES)")
    p.add_argument("--ms", default="", help="row counts (default: 1,16,64)")
    a = p.parse_args(argv)
    shapes = [tuple(int(x) for x in s.split(":")) for s in a.shapes.split(",") if s] or SHAPES
    ms = [int(m) for m in a.ms.split(",")] if a.ms else MS
    try:
        probe(a.out, shapes, ms)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
