"""Tensor parallelism on one host: the tree all-reduce against lax.psum, and decode tokens/s.

1. All-reduce of f32 row-parallel partials [T, D] (D = 4096, 8192; T = 1, 16, 256, 4096) over
   TP = 2, 4, 8 (as many as the host has): `lax.psum` (NCCL) vs `tree_allreduce` with each
   schedule ("exchange": log2(tp) full-size swaps; "halving": reduce-scatter by recursive halving +
   all-gather by recursive doubling; "halving_ag": the same reduce-scatter + NCCL all-gather;
   "pull": the one-launch Mosaic GPU kernel, on Hopper, for the sizes it takes) and "auto" (what
   jdet runs: the schedule picked by size).
   Each timing is one jitted program of REPEAT chained all-reduces (x <- allreduce(x)), so launch
   overhead is amortised; reported per all-reduce, with the bus bandwidth 2(n-1)/n * bytes / t
   (NCCL's convention) and the ratio tree/psum (target <= 1.15). Before timing, the tree result is
   checked bitwise against the numpy pairwise reference on every device.
2. Decode tokens/s of a Qwen3-8B-shaped random bf16 model at TP = 1, 2, 4, 8 (as available), in
   "tp" mode (tree matmul + tree all-reduce) and "batch" mode (BIO matmul + psum): B sequences of
   context CTX, one token each per step, through the same `make_tp_step` the engine uses.

Usage: PYTHONPATH=. python3 -m benchmarks.tp_bench [out_dir]     (writes tp_bench.json)
`run(out_dir, small=True)` runs tiny shapes on CPU host devices (a smoke test, not a measurement).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.timing import median_seconds
from jdet.batch import build_batch
from jdet.config import ModelConfig
from jdet.params import abstract_params
from jdet.plan import prepare_params
from jdet.sampling import SamplingInputs
from sharding.mesh import TP_AXIS, make_tp_mesh, shard_map
from sharding.specs import named, param_partition_specs
from sharding.tp import init_tp_kv_cache, make_tp_step
from sharding.tree_allreduce import (
    GATHER_MAX_BYTES_TP2,
    GATHER_MAX_TOTAL_BYTES,
    PULL_MAX_BYTES,
    auto_schedule,
    pull_runs_here,
    tree_allreduce,
    tree_sum_reference,
)

REPEAT = 10
QWEN3_8B = ModelConfig(
    model_type="qwen3",
    vocab_size=151936,
    hidden_size=4096,
    intermediate_size=12288,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    max_position_embeddings=40960,
    tie_word_embeddings=False,
    qkv_bias=False,
    o_bias=False,
    qk_norm=True,
)


def _time(fn, *args, iters: int = 5, reps: int = 3) -> float:
    """Median over `reps` of the mean time of `iters` back-to-back dispatches (seconds)."""
    return median_seconds(fn, *args, iters=iters, reps=reps)


def _chain(op, mesh, repeat: int):
    def body(x):
        for _ in range(repeat):
            x = op(x)
        return x

    return jax.jit(shard_map(body, mesh=mesh, in_specs=P(TP_AXIS), out_specs=P(TP_AXIS)))


def _ops(shape: tuple[int, int] | None = None, tp: int = 2) -> dict:
    """psum and every tree schedule; "pull" where it runs and takes [T, D] = `shape`."""
    ops = {
        "psum": lambda x: jax.lax.psum(x, TP_AXIS),
        "pairs": lambda x: tree_allreduce(x, TP_AXIS, algorithm="pairs"),
        "gather": lambda x: tree_allreduce(x, TP_AXIS, algorithm="gather"),
        "exchange": lambda x: tree_allreduce(x, TP_AXIS, algorithm="exchange"),
        "halving": lambda x: tree_allreduce(x, TP_AXIS, algorithm="halving"),
        "halving_ag": lambda x: tree_allreduce(x, TP_AXIS, algorithm="halving_ag"),
    }
    if pull_runs_here():
        from pallas_kernels.allreduce_mosaic import unsupported

        if shape is None or unsupported((1, *shape), jnp.float32, tp) is None:
            ops["pull"] = lambda x: tree_allreduce(x, TP_AXIS, algorithm="pull")
    return ops


def check_tree_bits(mesh, tp: int, shape=(16, 4096)) -> bool:
    """Tree all-reduce == numpy pairwise reference, bitwise, on every device, every schedule."""
    rng = np.random.default_rng(tp)
    x = (rng.standard_normal((tp, *shape)) * 10.0 ** rng.uniform(-3, 3, (tp, *shape))).astype(
        np.float32
    )
    ref = tree_sum_reference(list(x))
    ok = True
    ops = _ops(shape, tp)
    for name in [k for k in ops if k != "psum"]:  # every tree schedule
        f = _chain(ops[name], mesh, 1)
        out = np.asarray(f(x.reshape(tp * shape[0], shape[1]))).reshape(tp, *shape)
        ok &= all(np.array_equal(out[r], ref) for r in range(tp))
    return bool(ok)


def kernel_checks(tps) -> dict:
    """Which per-device pieces keep their bits under TP on this backend (a diagnosis aid).

    column: matmul(x, w)[:, shard] == matmul(x, w[:, shard]) for the shard widths TP makes;
    row: tree_allreduce over devices of tree_matmul_partial == tree_matmul (f32, bitwise).
    """
    from pallas_kernels.matmul import matmul
    from pallas_kernels.tree_matmul import tree_matmul, tree_matmul_partial

    out: dict = {}
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 1024)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1024, 1024)) * 0.03, jnp.bfloat16)
    full = np.asarray(matmul(x, w, out_dtype=jnp.float32))
    for width in (512, 256, 128):
        part = np.asarray(matmul(x, w[:, :width], out_dtype=jnp.float32))
        out[f"column_N1024_vs_N{width}"] = bool(np.array_equal(part, full[:, :width]))
    ref = np.asarray(tree_matmul(x, w, out_dtype=jnp.float32))
    for tp in tps:
        mesh = make_tp_mesh(tp)

        def body(a, b, tp=tp):
            p = tree_matmul_partial(a, b, k_total=1024, shard=0, num_shards=tp)
            return tree_allreduce(p, TP_AXIS)[None]

        f = jax.jit(shard_map(body, mesh=mesh, in_specs=(P(None, TP_AXIS), P(TP_AXIS)),
                              out_specs=P(TP_AXIS)))  # fmt: skip
        got = np.asarray(f(x, w)).reshape(tp, 16, 1024)
        out[f"row_tp{tp}"] = bool(all(np.array_equal(got[r], ref) for r in range(tp)))
    return out


def allreduce_bench(tps, dims, tokens, budget_s: float) -> list[dict]:
    rows = []
    t_start = time.time()
    for tp in sorted(tps, reverse=True):
        mesh = make_tp_mesh(tp)
        bits_ok = check_tree_bits(mesh, tp)
        for d in dims:
            for t in tokens:
                if time.time() - t_start > budget_s:
                    rows.append({"tp": tp, "D": d, "T": t, "skipped": "time budget"})
                    continue
                nbytes = t * d * 4
                x = jax.device_put(
                    jnp.ones((tp * t, d), jnp.float32), NamedSharding(mesh, P(TP_AXIS))
                )
                r = {"tp": tp, "D": d, "T": t, "bytes_per_device": nbytes, "tree_bits_ok": bits_ok}
                ops = _ops((t, d), tp)
                for name, op in ops.items():
                    try:
                        sec = _time(_chain(op, mesh, REPEAT), x) / REPEAT
                        r[f"{name}_us"] = round(sec * 1e6, 2)
                        r[f"{name}_busbw_GBps"] = round(2 * (tp - 1) / tp * nbytes / sec / 1e9, 1)
                    except Exception:  # noqa: BLE001
                        r[f"{name}_error"] = traceback.format_exc()[-800:]
                auto = auto_schedule(nbytes, tp)
                if f"{auto}_us" in r and "psum_us" in r:
                    r["auto"] = auto
                    r["auto_over_psum"] = round(r[f"{auto}_us"] / r["psum_us"], 3)
                    trees = [k for k in ops if k != "psum" and f"{k}_us" in r]
                    best = min(trees, key=lambda k: r[f"{k}_us"])
                    r["best_tree"] = best
                    r["best_tree_over_psum"] = round(r[f"{best}_us"] / r["psum_us"], 3)
                print(json.dumps(r), flush=True)
                rows.append(r)
    return rows


def random_sharded_params(cfg: ModelConfig, mesh, dtype=jnp.bfloat16, seed: int = 0) -> dict:
    """Random weights in the TP layout (padded, kv heads replicated), generated on the devices."""
    tp = mesh.shape[TP_AXIS]
    shapes = jax.eval_shape(lambda p: prepare_params(p, cfg, tp), abstract_params(cfg, dtype))
    shardings = named(mesh, param_partition_specs(shapes, cfg))
    leaves, treedef = jax.tree_util.tree_flatten_with_path(shapes)

    def init(key):
        keys = jax.random.split(key, len(leaves))
        out = []
        for k, (path, s) in zip(keys, leaves, strict=True):
            name = str(path[-1])
            if "norm" in name:
                out.append(jnp.ones(s.shape, s.dtype))
            else:
                out.append((jax.random.normal(k, s.shape, jnp.float32) * 0.02).astype(s.dtype))
        return jax.tree_util.tree_unflatten(treedef, out)

    return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed))


def decode_bench(cfg: ModelConfig, mesh, params: dict, mode: str, batch: int, ctx: int,
                 page: int = 16, steps: int = 10, **ops_kw) -> dict:  # fmt: skip
    """Time one decode step of `batch` sequences at context `ctx` (one token each). `ops_kw`:
    make_tp_step's (e.g. allreduce="xla_auto")."""
    tp = mesh.shape[TP_AXIS]
    weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params)) / tp
    pages_per_seq = -(-(ctx + 1) // page)
    kv = init_tp_kv_cache(cfg, mesh, batch * pages_per_seq, page, jnp.bfloat16)
    seqs = [
        ([1], ctx, list(range(s * pages_per_seq, (s + 1) * pages_per_seq))) for s in range(batch)
    ]
    b, _ = build_batch(seqs, page, logits="last", pad_tokens=max(16, batch))
    sp = SamplingInputs(
        temperature=np.zeros(batch, np.float32),
        top_k=np.zeros(batch, np.int32),
        top_p=np.ones(batch, np.float32),
        seed=np.arange(batch, dtype=np.uint32),
        position=np.full(batch, ctx + 1, np.int32),
    )
    step = make_tp_step(cfg, mode, mesh, **ops_kw)
    t0 = time.time()
    kv, out = step(params, kv, b, sp)
    jax.block_until_ready(out)
    compile_s = time.time() - t0
    kv, out = step(params, kv, b, sp)
    jax.block_until_ready(out)
    t0 = time.perf_counter()
    for _ in range(steps):
        kv, out = step(params, kv, b, sp)
    jax.block_until_ready(out)
    sec = (time.perf_counter() - t0) / steps
    del kv
    return {
        "tp": tp,
        "mode": mode,
        "batch": batch,
        "ctx": ctx,
        "step_ms": round(sec * 1e3, 3),
        "tokens_per_s": round(batch / sec, 1),
        "weight_GBps_per_device": round(weight_bytes / sec / 1e9, 1),
        "compile_s": round(compile_s, 1),
    }


def run(out_dir: str, small: bool = False, budget_s: float | None = None) -> dict:
    """Both parts; writes tp_bench.json under out_dir after every case and returns the results."""
    t_start = time.time()
    budget = budget_s or float(os.environ.get("TP_BENCH_BUDGET_S", "240"))
    n = jax.device_count()
    tps = [t for t in (2, 4, 8) if t <= n]
    res: dict = {
        "device": jax.devices()[0].device_kind,
        "num_devices": n,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"),
        "auto_policy": {
            "gather_max_bytes_tp2": GATHER_MAX_BYTES_TP2,
            "gather_max_total_bytes": GATHER_MAX_TOTAL_BYTES,
            "pull_max_bytes": PULL_MAX_BYTES,
            "pull_runs_here": pull_runs_here(),
        },
        "repeat": REPEAT,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        (out / "tp_bench.json").write_text(json.dumps(res, indent=1))

    try:
        res["kernel_checks"] = kernel_checks(tps)
    except Exception:  # noqa: BLE001
        res["kernel_checks"] = {"error": traceback.format_exc()[-2000:]}
    print(json.dumps({"kernel_checks": res["kernel_checks"]}), flush=True)
    dims, tokens = ((64, 128), (1, 16)) if small else ((4096, 8192), (1, 16, 256, 4096))
    res["allreduce"] = allreduce_bench(tps, dims, tokens, budget_s=0.4 * budget)
    save()

    cfg = QWEN3_8B
    batches, ctx = (1,), 1024
    if small:
        from tests.sharding.tiny import tiny_cfg

        cfg, batches, ctx = tiny_cfg(head_dim=128), (2,), 8
    res["decode_model"] = {k: v for k, v in cfg.__dict__.items() if k != "rope_scaling"}
    res["decode"] = []
    # most informative first: tp-vs-batch at the largest TP, then TP=1, then the sizes between
    order = [t for t in (8, 4) if t <= n][:1] + [1] + [t for t in (2, 4) if t <= n]
    order = list(dict.fromkeys(order))
    est = 40.0  # seconds one (TP, mode) config takes; updated as they run
    for tp in order:
        if budget - (time.time() - t_start) < est:
            res["decode"].append({"tp": tp, "skipped": "budget"})
            continue
        mesh = make_tp_mesh(tp)
        t1 = time.time()
        params = random_sharded_params(cfg, mesh)
        jax.block_until_ready(params)
        res.setdefault("decode_init_s", {})[str(tp)] = round(time.time() - t1, 1)
        for mode in ("tp", "batch"):
            for bsz in batches:
                if budget - (time.time() - t_start) < est:
                    res["decode"].append(
                        {"tp": tp, "mode": mode, "batch": bsz, "skipped": "budget"}
                    )
                    continue
                t1 = time.time()
                try:
                    r = decode_bench(cfg, mesh, params, mode, bsz, ctx)
                    est = time.time() - t1
                except Exception:  # noqa: BLE001
                    r = {
                        "tp": tp,
                        "mode": mode,
                        "batch": bsz,
                        "error": traceback.format_exc()[-2000:],
                    }
                print(json.dumps(r), flush=True)
                res["decode"].append(r)
                save()
        del params
    by = {(r["tp"], r["mode"], r["batch"]): r for r in res["decode"] if "step_ms" in r}
    res["decode_tp_over_batch"] = {
        f"tp{t}_B{b}": round(by[(t, "tp", b)]["step_ms"] / by[(t, "batch", b)]["step_ms"], 3)
        for (t, m, b) in by
        if m == "tp" and (t, "batch", b) in by
    }
    res["seconds"] = round(time.time() - t_start, 1)
    save()
    return res


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks.tp_bench OUT [--tests] [--deadline-s S]`.

    --tests first runs the `-m gpu` tests of the tree all-reduce and of TP
    (tests/sharding/test_tree_allreduce_gpu.py, test_tp_gpu.py) in this process (one JAX start
    for both); the benchmark then gets what is left of the deadline.
    """
    import argparse

    t0 = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("out", nargs="?", default=os.environ.get("OUT", "out"))
    ap.add_argument("--tests", action="store_true")
    ap.add_argument("--deadline-s", type=float, default=280.0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tests = None
    if a.tests:
        import pytest

        args = ["-m", "gpu", "-q", "-x", "-p", "no:cacheprovider",
                "tests/sharding/test_tree_allreduce_gpu.py", "tests/sharding/test_tp_gpu.py"]
        tests = {"returncode": int(pytest.main([*args, f"--junitxml={out / 'tp_gpu_tests.xml'}"]))}
        tests["seconds"] = round(time.time() - t0, 1)
        print(json.dumps({"gpu_tests": tests}), flush=True)
    res = run(str(out), budget_s=max(30.0, a.deadline_s - (time.time() - t0)))
    res["gpu_tests"] = tests
    (out / "tp_bench.json").write_text(json.dumps(res, indent=1))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
