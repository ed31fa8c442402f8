"""Probe for docs/PREFILL_ATTENTION.md step 1: does feeding a warp-specialised Mosaic GPU attention
kernel from 16-token pages (one TMA per page) cost speed against one TMA per contiguous block?

The kernel follows the shape of JAX's `ops/gpu/attention_mgpu.py` forward pass (one producer
warpgroup issuing TMA into a ring of SMEM slots, two consumer warpgroups with 64-row wgmma tiles
and an online softmax), non-causal, without jdet's partitions: it measures the load path only,
not jdet's plan, and its bits mean nothing. Both modes run the same consumers; only the producer
differs ('contig': one [block_kv, E] copy per block; 'paged': block_kv / 16 copies of [16, E]
from a permuted page pool, the page index read from the page table in GMEM).

Usage (Hopper GPU): PYTHONPATH=. python -m benchmarks.paged_tma_probe --out $OUT
Writes paged_tma_probe.json: per (mode, block_kv) a check against an f32 reference at
--check-tokens (allclose; a failing candidate is not timed), then ms and TFLOP/s per (tokens,
mode, block_kv) beside cuDNN's, with the largest difference from cuDNN's output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

import jax
import jax.numpy as jnp
from jax import lax

PAGE = 16


def attention(q, k, v, pt, *, block_kv: int, steps: int, paged: bool):
    """Non-causal attention of q[T, H, E] over one sequence's K/V (module docstring).

    paged: k, v are pools [K, P, 16, E] and pt[N // 16] the sequence's pages; else k, v are
    [K, N, E]. Returns [T, H, E]."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    t, h, e = q.shape
    kh = k.shape[0]
    n = pt.shape[0] * PAGE if paged else k.shape[1]
    g = h // kh
    block_q = 64
    if t % (2 * block_q) or n % block_kv or block_kv % PAGE:
        raise ValueError(f"T ({t}) % 128, N ({n}) % block_kv, block_kv % {PAGE} must be 0")
    n_steps = n // block_kv
    steps = min(steps, n_steps)
    qt = q.transpose(1, 0, 2)  # [H, T, E]: a tile is 64 rows of one head
    dtype = q.dtype
    c = math.log2(math.e) / math.sqrt(e)

    def kernel(q_ref, k_ref, v_ref, pt_ref, o_ref, scoped):
        (q_smem2, k_smem, v_smem), (k_full, v_full, q_bar), (k_used, v_used), sched = scoped
        head = lax.axis_index("heads")
        kv_head = lax.div(head, jnp.int32(g))
        wg = lax.axis_index("wg")

        def sync():
            plgpu.barrier_arrive(sched)
            plgpu.barrier_wait(sched)

        @pl.when(wg < 2)
        def _consumer():
            plgpu.set_max_registers(232, action="increase")
            q_smem = q_smem2.at[wg]
            row0 = lax.axis_index("q_seq") * (2 * block_q) + wg * block_q
            plgpu.copy_gmem_to_smem(q_ref.at[head, pl.ds(row0, block_q)], q_smem, q_bar.at[wg])
            plgpu.barrier_wait(q_bar.at[wg])
            m = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                                  plgpu.Layout.WGMMA.reduce(1))  # fmt: skip
            lsum = plgpu.layout_cast(jnp.zeros((block_q,), jnp.float32),
                                     plgpu.Layout.WGMMA.reduce(1))  # fmt: skip
            acc = plgpu.layout_cast(jnp.zeros((block_q, e), jnp.float32), plgpu.Layout.WGMMA)
            plgpu.barrier_wait(k_full.at[0])
            pl.when(wg == 1)(sync)

            def step(i, carry):
                acc, m, lsum = carry
                slot = lax.rem(i, jnp.int32(steps))

                def qk(ref):
                    plgpu.wgmma(ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                    sync()
                    return ref[...]

                s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_used.at[slot])
                m_new = jnp.maximum(m, s.max(axis=1) * c)
                alpha = jnp.exp2(m - m_new)
                p = jnp.exp2(s * c - lax.broadcast_in_dim(m_new, s.shape, [0]))
                acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                lsum = lsum * alpha + p.sum(axis=1)
                p16 = p.astype(dtype)
                acc, lsum, m_new, p16 = lax.optimization_barrier((acc, lsum, m_new, p16))
                plgpu.barrier_arrive(sched)
                plgpu.barrier_wait(v_full.at[slot])
                plgpu.barrier_wait(sched)

                def pv(ref):
                    plgpu.wgmma(ref, p16, v_smem.at[slot])
                    nxt = i + 1

                    @pl.when(nxt < n_steps)
                    def _():
                        plgpu.barrier_wait(k_full.at[lax.rem(nxt, jnp.int32(steps))])

                acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_used.at[slot])
                return acc, m_new, lsum

            acc, m, lsum = lax.fori_loop(0, n_steps, step, (acc, m, lsum))
            pl.when(wg == 0)(sync)
            acc = acc / lax.broadcast_in_dim(lsum, acc.shape, [0])
            q_smem[...] = acc.astype(dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(q_smem, o_ref.at[head, pl.ds(row0, block_q)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(wg == 2)
        def _producer():
            plgpu.set_max_registers(40, action="decrease")

            def load(i, slot):
                if paged:
                    for j in range(block_kv // PAGE):
                        page = pt_ref[i * (block_kv // PAGE) + j]
                        rows = pl.ds(j * PAGE, PAGE)
                        plgpu.copy_gmem_to_smem(k_ref.at[kv_head, page], k_smem.at[slot, rows],
                                                k_full.at[slot])  # fmt: skip
                        plgpu.copy_gmem_to_smem(v_ref.at[kv_head, page], v_smem.at[slot, rows],
                                                v_full.at[slot])  # fmt: skip
                else:
                    blk = pl.ds(i * block_kv, block_kv)
                    plgpu.copy_gmem_to_smem(k_ref.at[kv_head, blk], k_smem.at[slot],
                                            k_full.at[slot])  # fmt: skip
                    plgpu.copy_gmem_to_smem(v_ref.at[kv_head, blk], v_smem.at[slot],
                                            v_full.at[slot])  # fmt: skip

            for i in range(steps):
                load(jnp.int32(i), i)

            @pl.loop(0, n_steps - steps)
            def _(i):
                slot = lax.rem(i, jnp.int32(steps))
                plgpu.barrier_wait(k_used.at[slot])
                plgpu.barrier_wait(v_used.at[slot])
                load(i + steps, slot)

    def entry(q_ref, k_ref, v_ref, pt_ref, o_ref):
        tr = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))
        smem = (
            plgpu.SMEM((2, block_q, e), dtype, transforms=tr),
            plgpu.SMEM((steps, block_kv, e), dtype, transforms=tr),
            plgpu.SMEM((steps, block_kv, e), dtype, transforms=tr),
        )
        # a paged slot is filled by one copy per page, each arriving once with its bytes
        fills = block_kv // PAGE if paged else 1
        pl.run_scoped(
            lambda *args: kernel(q_ref, k_ref, v_ref, pt_ref, o_ref, args),
            smem,
            (plgpu.Barrier(num_arrivals=fills, num_barriers=steps),
             plgpu.Barrier(num_arrivals=fills, num_barriers=steps),
             plgpu.Barrier(num_barriers=2)),
            (plgpu.Barrier(num_arrivals=2, num_barriers=steps),) * 2,
            plgpu.Barrier(num_arrivals=2),
            collective_axes="wg",
        )  # fmt: skip

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct(qt.shape, dtype),  # `out_shape` is gone in JAX 0.11
        grid=(h, t // (2 * block_q)),
        grid_names=("heads", "q_seq"),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qt, k, v, pt)
    return out.transpose(1, 0, 2)


def reference(q, k, v):
    """f32 non-causal attention of q[T, H, E] over k, v [K, N, E] (the accuracy oracle)."""
    t, h, e = q.shape
    kh = k.shape[0]
    qg = q.astype(jnp.float32).reshape(t, kh, h // kh, e)
    s = jnp.einsum("tkge,kne->tkgn", qg, k.astype(jnp.float32)) * e**-0.5
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("tkgn,kne->tkge", p, v.astype(jnp.float32)).reshape(t, h, e)


def _case(n: int, h: int, kh: int, e: int):
    key = jax.random.split(jax.random.PRNGKey(n), 4)
    q = jax.random.normal(key[0], (n, h, e), jnp.bfloat16)
    kc = jax.random.normal(key[1], (kh, n, e), jnp.bfloat16)
    vc = jax.random.normal(key[2], (kh, n, e), jnp.bfloat16)
    perm = jax.random.permutation(key[3], n // PAGE).astype(jnp.int32)
    # pool[:, perm[i]] holds the sequence's page i
    inv = jnp.argsort(perm)
    kp = kc.reshape(kh, n // PAGE, PAGE, e)[:, inv]
    vp = vc.reshape(kh, n // PAGE, PAGE, e)[:, inv]
    return q, kc, vc, kp, vp, perm


def _probe_fn(bk: int, steps: int, paged: bool):
    return jax.jit(lambda q, k, v, pt: attention(q, k, v, pt, block_kv=bk, steps=steps,
                                                 paged=paged))  # fmt: skip


def run(out_dir: str, tokens: list[int], block_kvs: list[int], steps: int,
        modes: tuple[str, ...] = ("contig", "paged"),
        check_tokens: int = 1024) -> list[dict]:  # fmt: skip
    """Each candidate alone in try/except, its row printed and the JSON rewritten as it ends:
    first checked against `reference` at `check_tokens` (allclose; a failing candidate is not
    timed), then timed at each length beside cuDNN (and compared with cuDNN's output)."""
    from benchmarks.timing import median_seconds

    h, kh, e = 32, 8, 128
    rows: list[dict] = []
    os.makedirs(out_dir, exist_ok=True)

    def emit(row):
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "error"}), flush=True)
        if "error" in row:
            print(row["error"][-800:], file=sys.stderr, flush=True)
        with open(os.path.join(out_dir, "paged_tma_probe.json"), "w") as fh:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "rows": rows}, fh, indent=1)  # fmt: skip

    ok: dict[tuple, bool] = {}
    q, kc, vc, kp, vp, perm = _case(check_tokens, h, kh, e)
    ref = reference(q, kc, vc)
    for bk in block_kvs:
        for mode in modes:
            paged = mode == "paged"
            row = {"tokens": check_tokens, "impl": mode, "block_kv": bk, "stage": "check"}
            try:
                args = (q, kp, vp, perm) if paged else (q, kc, vc, perm)
                out = jax.block_until_ready(_probe_fn(bk, steps, paged)(*args))
                err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
                row["max_abs_err"] = err
                row["allclose"] = bool(jnp.allclose(out.astype(jnp.float32), ref, atol=2e-2,
                                                    rtol=2e-2))  # fmt: skip
            except Exception:  # noqa: BLE001
                row["allclose"] = False
                row["error"] = traceback.format_exc()[-4000:]
            ok[(bk, mode)] = row["allclose"]
            emit(row)
    for n in tokens:
        q, kc, vc, kp, vp, perm = _case(n, h, kh, e)
        flops = 4 * h * e * n * n
        cud = cud_ms = None
        try:
            f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
                q[None], k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None],
                scale=e**-0.5, implementation="cudnn")[0])  # fmt: skip
            t = median_seconds(f, q, kc, vc, iters=10, reps=3, warmup=2)
            cud = f(q, kc, vc).astype(jnp.float32)
            cud_ms = t * 1e3
            emit({"tokens": n, "impl": "cudnn", "ms": t * 1e3, "TFLOPs": flops / t / 1e12})
        except Exception:  # noqa: BLE001
            emit({"tokens": n, "impl": "cudnn", "error": traceback.format_exc()[-1500:]})
        for bk in block_kvs:
            for mode in modes:
                paged = mode == "paged"
                row = {"tokens": n, "impl": mode, "block_kv": bk}
                if not ok[(bk, mode)]:
                    emit({**row, "skipped": "failed the check"})
                    continue
                try:
                    f = _probe_fn(bk, steps, paged)
                    args = (q, kp, vp, perm) if paged else (q, kc, vc, perm)
                    if cud is not None:
                        err = jnp.max(jnp.abs(f(*args).astype(jnp.float32) - cud))
                        row["max_abs_err_vs_cudnn"] = float(err)
                    t = median_seconds(f, *args, iters=10, reps=3, warmup=2)
                    row.update(ms=t * 1e3, TFLOPs=flops / t / 1e12)
                    if cud_ms is not None:
                        row["x_cudnn"] = cud_ms / row["ms"]  # 1: cuDNN's speed
                except Exception:  # noqa: BLE001
                    row["error"] = traceback.format_exc()[-4000:]
                emit(row)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--tokens", default="8192,32768")
    p.add_argument("--block-kv", default="64,128")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--modes", default="contig,paged")
    p.add_argument("--check-tokens", type=int, default=1024)
    a = p.parse_args(sys.argv[1:])
    run(a.out, [int(x) for x in a.tokens.split(",") if x],
        [int(x) for x in a.block_kv.split(",")], a.steps, tuple(a.modes.split(",")),
        a.check_tokens)  # fmt: skip
