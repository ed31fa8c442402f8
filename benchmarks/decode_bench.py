"""Decode latency in the gpt-fast habit: per config, tok/s, achieved GB/s and x the floor, for
"tp" and the fair "none", with the PyTorch bar (`benchmarks.torch_decode`) measured in the same run.

Rows (random bf16 weights of the named shape, one H100):
- device step: the decode step of B sequences at context `ctx` dispatched back to back (no host
  work between steps); engine step (B = 1): the whole `Engine.step` loop, host included, after a
  real prefill of the prompt.
- bytes per step = every weight once (embedding excluded: one row is gathered) + the K/V of the
  B contexts; floor = max(bytes / copy bandwidth, FLOPs / matmul peak), both ceilings measured in
  this run (XLA 1 GiB copy, XLA 8192^3 bf16 product).
- `variants`: the same "tp" step with other Ops settings (attention partition, scan unroll), to
  decide levers from measurements; `kernels`: every op of one layer at M = 1 timed alone (what
  remains between the step and the floor, kernel by kernel).

    PYTHONPATH=. python -m benchmarks.decode_bench --out OUT [--shapes llama3-8b] [--smoke]
Writes `decode_bench.json` (after every part, so a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

# HF config.json fields of each shape (random weights; no tokenizer).
SHAPES = {
    "llama3-8b": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256,
                      hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                     hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "qwen3-0.6b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                       hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    # Qwen3-1.7B / 4B: between the 0.6B and 8B shapes (100 and 202 MB of weights a layer), where
    # the unrolled layer loop (Ops.unroll_layers_gpu) was measured (BENCHMARKS.md)
    "qwen3-1.7b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                       hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-4b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
                     hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=512,
                 hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}  # fmt: skip
PAGE = 16


def random_model(shape: str, max_len: int, shapes: dict | None = None) -> Any:
    """A jdet.Model with random bf16 weights of `shapes[shape]` (default: this module's
    SHAPES), drawn on the device where there is one."""
    import jax
    import jax.numpy as jnp

    from jdet.config import ModelConfig
    from jdet.loader import Model
    from jdet.params import init_params

    raw = dict((shapes or SHAPES)[shape], max_position_embeddings=max_len, eos_token_id=0,
               bos_token_id=0, attention_bias=False, torch_dtype="bfloat16")  # fmt: skip
    cfg = ModelConfig.from_hf(raw)
    # drawn on the GPU: numpy's RNG took ~2.5 min of device time per 8B model
    params = init_params(cfg, seed=0, dtype=jnp.bfloat16, on_device=jax.default_backend() != "cpu")
    return Model(cfg=cfg, params=params, tokenizer=None, path=None, hf_config=raw)


def step_bytes(model: Any, batch: int, ctx: int) -> tuple[int, int]:
    """(weight bytes read per step, K/V bytes read per step)."""
    import jax

    from jdet.kv_cache import kv_bytes_per_token

    leaves = jax.tree_util.tree_leaves(model.params)
    w = sum(x.size * x.dtype.itemsize for x in leaves)
    if not model.cfg.tie_word_embeddings:  # the embedding is gathered (one row), not streamed
        w -= model.params["embed"].size * model.params["embed"].dtype.itemsize
    return w, kv_bytes_per_token(model.cfg, model.dtype) * ctx * batch


def step_flops(model: Any, batch: int, ctx: int) -> float:
    """2 x weight elements x tokens (matmuls) + attention's 4 x H x E x ctx per token."""
    c = model.cfg
    w, _ = step_bytes(model, batch, ctx)
    return 2.0 * (w / 2) * batch + 4.0 * c.num_layers * c.num_heads * c.head_dim * ctx * batch


def decode_inputs(cfg: Any, batch: int, ctx: int, pmax: int, seed: int = 0,
                  pad_tokens: int = 0) -> tuple[Any, Any]:  # fmt: skip
    """StepBatch + SamplingInputs of `batch` sequences each decoding its token at position ctx-1,
    sequence b on pages b*used.. where `used` holds its ctx tokens (a permutation would not change
    the time: pages are 4 KB+); table entries past the context are never read: they repeat the
    last page."""
    from jdet.batch import StepBatch
    from jdet.step import SamplingInputs
    from serving.engine.sampler_variants import for_step

    b = np.arange(batch, dtype=np.int32)
    used = pages_used(ctx)
    cols = np.minimum(np.arange(pmax, dtype=np.int32), used - 1)
    pt = (b[:, None] * used + cols[None, :]).astype(np.int32)
    pos = np.full(batch, ctx - 1, np.int32)
    slot = pt[:, (ctx - 1) // PAGE] * PAGE + (ctx - 1) % PAGE
    tok = np.random.default_rng(seed).integers(1, cfg.vocab_size, batch).astype(np.int32)
    slot = slot.astype(np.int32)
    if pad_tokens > batch:  # rows of no sequence, as the engine pads T to its bucket (slot -1)
        extra = pad_tokens - batch
        tok = np.concatenate([tok, np.zeros(extra, np.int32)])
        pos = np.concatenate([pos, np.zeros(extra, np.int32)])
        slot = np.concatenate([slot, np.full(extra, -1, np.int32)])
    sb = StepBatch(tok, pos, slot, np.arange(batch + 1, dtype=np.int32),
                   np.full(batch, ctx, np.int32), pt, b.copy())  # fmt: skip
    z = np.zeros(batch, np.float32)
    k = np.zeros(batch, np.int32)
    # greedy rows: the sampler variant the engine runs for them (serving/engine/sampler_variants.py)
    si = SamplingInputs(temperature=z, top_k=k, top_p=z + 1, seed=np.zeros(batch, np.uint32),
                        position=pos[:batch] + 1, **for_step(k, z + 1, False))  # fmt: skip
    return sb, si


def pages_used(ctx: int) -> int:
    """Pages one sequence of `ctx` tokens occupies."""
    return -(-ctx // PAGE)


def pages_for(ctx: int, steps: int) -> int:
    """Page-table width bucket of a context (a power of two, as the engine pads it)."""
    from jdet.batch import pow2_bucket

    return pow2_bucket(-(-(ctx + steps + 16) // PAGE), 1, 1 << 20)


def device_step(runner: Any, batch: int, ctx: int, steps: int, step_fn: Any = None,
                pad_tokens: int = 0) -> float:  # fmt: skip
    """Median seconds per back-to-back decode step (runner's params/cache; `step_fn` overrides;
    `pad_tokens`: T padded with rows of no sequence, as the engine's token bucket does)."""
    import jax

    from benchmarks.timing import median_seconds

    fn = step_fn or runner.step_fn
    sb, si = decode_inputs(runner.cfg, batch, ctx, pages_for(ctx, steps), pad_tokens=pad_tokens)
    if step_fn is not None:
        sb, si = jax.device_put(sb), jax.device_put(si)
    # else the runner's own step (serving/engine/host_inputs.py PackedStep) takes host arrays, as
    # the engine passes them (it packs them into one host buffer; device arrays would be copied back
    # first). Measured on an H100 with host arrays too: this row stays slower than the same step
    # as a variant row (Qwen3-0.6B 1.83 vs 1.52 ms, Llama-3-8B 6.62 vs 6.56): the packed step
    # also unpacks its inputs on the device (slices and bitcasts of one word buffer), which the
    # variant's plain step does not; not investigated further (BENCHMARKS run 11).

    def one(sb: Any, si: Any) -> Any:
        runner.kv, out = fn(runner.params, runner.kv, sb, si)
        return out.tokens

    return median_seconds(one, sb, si, iters=max(4, steps // 4), reps=5, warmup=2)


def engine_step(eng: Any, ctx: int, steps: int, rid: str = "b1") -> dict:
    """Batch-1 greedy generation through Engine.step: median step after the prefill."""
    ids = np.random.default_rng(1).integers(1, eng.cfg.vocab_size, ctx - 1).tolist()
    eng.add_request(rid, ids, dict(temperature=0.0, max_tokens=steps + 4, ignore_eos=True))
    times, t_first = [], None
    t0 = time.perf_counter()
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        if t_first is None and len(times) >= 2:
            t_first = time.perf_counter() - t0
    decode = times[-steps:]
    return {"engine_step_s": float(np.median(decode)), "engine_steps": len(times),
            "engine_first_steps_s": t_first}  # fmt: skip


def make_engine(model: Any, mode: str, max_len: int, num_pages: int | None,
                **settings: Any) -> Any:  # fmt: skip
    """A benchmark's engine (`settings`: more EngineConfig fields, e.g. donate_weights);
    `num_pages` None: the engine sizes its pool from the device's memory, as a user's does."""
    import gc

    from serving.engine.engine import Engine

    gc.collect()
    return Engine(model, invariance=mode, max_num_batched_tokens=2048, max_num_seqs=64,
                  max_model_len=max_len, page_size=PAGE, num_pages=num_pages,
                  min_tokens_bucket=1, min_seqs_bucket=1, min_pages_bucket=1,
                  enable_prefix_caching=False, async_scheduling="off", **settings)  # fmt: skip


def ceilings() -> dict:
    import jax

    if jax.default_backend() == "cpu":
        return {}
    from benchmarks.matmul_bench import ceilings as c

    r = c()
    return {"copy_GBps": r["copy_gbps"], "peak_TFLOPs": r["xla_bf16_tflops"]}


def row_for(model: Any, mode: str, batch: int, ctx: int, dev_s: float, ceil: dict) -> dict:
    w, kvb = step_bytes(model, batch, ctx)
    row = {"mode": mode, "batch": batch, "ctx": ctx, "weight_bytes": w, "kv_bytes": kvb,
           "device_step_s": dev_s, "device_tok_per_s": batch / dev_s,
           "device_GBps": (w + kvb) / dev_s / 1e9}  # fmt: skip
    if ceil:
        fl = step_flops(model, batch, ctx)
        floor = max((w + kvb) / (ceil["copy_GBps"] * 1e9), fl / (ceil["peak_TFLOPs"] * 1e12))
        row.update(floor_s=floor, device_vs_floor=dev_s / floor)
    return row


def parse_variant(v: str) -> dict:
    """'attn_partition=128' -> {'attn_partition': 128}, the Ops fields of a variant ('+' joins
    several). A dotted key sets a field of an Ops field that is a kernel config:
    'attn_config.split_stages=2' -> {'attn_config': AttentionConfig(split_stages=2)}."""
    import dataclasses

    from jdet.ops import Ops

    out: dict = {}
    for kv in v.split("+"):
        k, val = kv.split("=")
        if "." not in k:
            out[k] = int(val)
            continue
        field, sub = k.split(".", 1)
        base = out.get(field, getattr(Ops(), field, None))
        names = {f.name for f in dataclasses.fields(base)} if dataclasses.is_dataclass(base) else ()
        if sub not in names:
            raise ValueError(f"variant {k!r}: Ops.{field} has no field {sub!r}")
        out[field] = dataclasses.replace(base, **{sub: type(getattr(base, sub))(int(val))})
    return out


def decode_rows(model: Any, shape: str, a: argparse.Namespace, ceil: dict, res: dict,
                save: Any) -> None:  # fmt: skip
    max_len = max(a.ctx) + a.steps + 32
    # pool: the largest batch at the shortest context, or one sequence at the longest (batches > 1
    # run at the shortest context only); 65k pages of an 8B model would not fit the GPU
    num_pages = max(max(a.batches) * pages_used(min(a.ctx)),
                    pages_for(max(a.ctx), a.steps) + a.steps // PAGE + 2) + 8  # fmt: skip
    for mode in a.modes:
        eng = make_engine(model, mode, max_len, num_pages)
        runner = eng.runner
        for ctx in a.ctx:
            for batch in a.batches:
                if batch > 1 and ctx > min(a.ctx):
                    continue  # batches > 1 at the shortest context only
                try:
                    row = row_for(model, mode, batch, ctx, device_step(runner, batch, ctx, a.steps),
                                  ceil)  # fmt: skip
                except Exception:  # noqa: BLE001 - keep the other rows
                    row = {"mode": mode, "batch": batch, "ctx": ctx,
                           "error": traceback.format_exc()[-2000:]}  # fmt: skip
                row["shape"] = shape
                if batch == 1 and ctx in a.engine_ctx and "error" not in row:
                    try:
                        row.update(engine_step(eng, ctx, a.steps))
                        row["engine_tok_per_s"] = 1 / row["engine_step_s"]
                        row["host_s"] = row["engine_step_s"] - row["device_step_s"]
                        if "floor_s" in row:
                            row["engine_vs_floor"] = row["engine_step_s"] / row["floor_s"]
                        # the same request with async scheduling (step n+1 dispatched before step
                        # n's tokens reach the host; same bits, tests/serving/engine/test_async.py)
                        eng.async_scheduling, ahead0 = True, eng.num_steps_ahead
                        r2 = engine_step(eng, ctx, a.steps, rid="b1-async")
                        eng.async_scheduling = False
                        row["engine_async_step_s"] = r2["engine_step_s"]
                        row["async_steps_ahead"] = eng.num_steps_ahead - ahead0
                        row["host_async_s"] = r2["engine_step_s"] - row["device_step_s"]
                    except Exception:  # noqa: BLE001
                        row["engine_error"] = traceback.format_exc()[-2000:]
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
        for pad in a.pad_tokens:  # batch 1 at the engine's padded token counts
            ctx = min(a.ctx)
            try:
                dev = device_step(runner, 1, ctx, a.steps, pad_tokens=pad)
                row = row_for(model, mode, 1, ctx, dev, ceil)
            except Exception:  # noqa: BLE001
                row = {"mode": mode, "batch": 1, "ctx": ctx,
                       "error": traceback.format_exc()[-2000:]}  # fmt: skip
            row.update(shape=shape, pad_tokens=pad)
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            save()
        # a variant is "tp" unless it names its mode first ("none:jdet.model.X=0")
        mine = [v for v in a.variants if (v.split(":")[0] if ":" in v else "tp") == mode]
        if mine:
            from sharding.mesh import make_tp_mesh
            from sharding.tp import make_tp_step

            mesh = make_tp_mesh(1)
            for v in mine:
                ctx = min(a.ctx)
                try:
                    fields = parse_variant(v.split(":")[-1])
                    t0 = time.perf_counter()
                    fn = make_tp_step(model.cfg, mode, mesh, **fields)
                    dev = device_step(runner, 1, ctx, a.steps, step_fn=fn)
                    row = row_for(model, mode, 1, ctx, dev, ceil)
                    row["compile_and_time_s"] = time.perf_counter() - t0
                except Exception:  # noqa: BLE001
                    row = {"error": traceback.format_exc()[-2000:]}
                row.update(shape=shape, variant=v)
                res["variants"].append(row)
                print(json.dumps(row), flush=True)
                save()
        del eng, runner


def kernel_rows(model: Any, ceil: dict, ctx: int) -> list[dict]:
    """Every op of one decode layer at M = 1, alone: Pallas (the "tp" path) vs XLA."""
    import jax
    import jax.numpy as jnp

    from benchmarks.matmul_bench import _time_op
    from pallas_kernels import matmul, paged_attention, rms_norm, tree_matmul
    from pallas_kernels.paged_attention import none_partition, paged_attention_xla

    c = model.cfg
    D, H, K, E, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    bw = ceil.get("copy_GBps", 1.0) * 1e9
    x = jax.random.normal(jax.random.PRNGKey(0), (1, D), jnp.bfloat16)
    rows = []

    def xla(a, b):  # noqa: ANN001, ANN202 - the "none" mode's projection
        return jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype)

    def xla_bf16(a, b):  # noqa: ANN001, ANN202 - XLA's own bf16-out dot
        return jnp.dot(a, b)

    def xla_pad16(a, b):  # noqa: ANN001, ANN202 - rows padded to 16 (XLA's M=1 plans are slow)
        return jnp.dot(jnp.pad(a, ((0, 16 - a.shape[0]), (0, 0))), b)[: a.shape[0]]

    def mm(a, b):  # noqa: ANN001, ANN202
        return matmul(a, b, out_dtype=a.dtype)

    def tree(a, b):  # noqa: ANN001, ANN202
        return tree_matmul(a, b, out_dtype=a.dtype)

    projections = [("q", D, H * E), ("k", D, K * E), ("v", D, K * E),
                   ("qkv fused", D, (H + 2 * K) * E), ("o", H * E, D),
                   ("gate", D, F), ("up", D, F), ("gate_up fused", D, 2 * F),
                   ("down", F, D), ("lm_head", D, c.vocab_size)]  # fmt: skip
    for name, k_in, n in projections:
        w = jax.random.normal(jax.random.PRNGKey(1), (k_in, n), jnp.bfloat16) * 0.02
        a = x if k_in == D else jax.random.normal(jax.random.PRNGKey(2), (1, k_in), jnp.bfloat16)
        r = {"op": name, "K": k_in, "N": n, "bytes": w.nbytes, "floor_us": w.nbytes / bw * 1e6}
        impls = (("xla", xla), ("xla_bf16", xla_bf16), ("xla_pad16", xla_pad16), ("matmul", mm),
                 ("tree", tree))  # fmt: skip
        for impl, f in impls:
            try:
                r[impl + "_us"] = _time_op(f, a, w, 2 * n) * 1e6
            except Exception as e:  # noqa: BLE001
                r[impl + "_error"] = str(e)[:300]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del w
    def norm_xla(a, w):  # noqa: ANN001, ANN202
        af = a.astype(jnp.float32)
        y = af * jax.lax.rsqrt(jnp.mean(af * af, -1, keepdims=True) + 1e-6)
        return y.astype(a.dtype) * w

    g = jnp.ones((D,), jnp.bfloat16)
    r = {"op": "rms_norm", "bytes": 4 * D,
         "xla_us": _time_op(norm_xla, x, g, 2 * D) * 1e6,
         "pallas_us": _time_op(lambda a, w: rms_norm(a, w, 1e-6), x, g, 2 * D) * 1e6}  # fmt: skip
    rows.append(r)
    print(json.dumps(r), flush=True)
    # attention of one decode token at `ctx` over a paged cache of one layer
    pmax = pages_for(ctx, 0)
    kc = jax.random.normal(jax.random.PRNGKey(3), (K, pmax, PAGE, E), jnp.bfloat16)
    vc = jax.random.normal(jax.random.PRNGKey(4), (K, pmax, PAGE, E), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(5), (1, H, E), jnp.bfloat16)
    pt = jnp.arange(pmax, dtype=jnp.int32)[None]
    cl = jnp.full((1,), ctx, jnp.int32)
    qs = jnp.array([0, 1], jnp.int32)
    pos = jnp.full((1,), ctx - 1, jnp.int32)
    kvb = 2 * K * ctx * E * 2
    r = {"op": f"attention ctx {ctx}", "bytes": kvb, "floor_us": kvb / bw * 1e6}
    parts = sorted({512, 256, 128, 64, none_partition(1, pt.shape, kc.shape)}, reverse=True)
    for ps in parts:
        f = jax.jit(lambda q, pt, ps=ps: paged_attention(q, kc, vc, pt, cl, qs, pos,
                                                         scale=E**-0.5, partition_size=ps))
        r[f"pallas_p{ps}_us"] = _time_op(f, q, pt, 0) * 1e6
    f = jax.jit(lambda q, pt: paged_attention_xla(q, kc, vc, pt, cl, qs, pos, scale=E**-0.5))
    r["xla_gather_us"] = _time_op(f, q, pt, 0) * 1e6
    rows.append(r)
    print(json.dumps(r), flush=True)
    # prefill attention (one 2048-token chunk at positions 0..2047): the partition's other cost
    t = 2048
    pmax = pages_for(t, 0)
    kc = jax.random.normal(jax.random.PRNGKey(3), (K, pmax, PAGE, E), jnp.bfloat16)
    vc = jax.random.normal(jax.random.PRNGKey(4), (K, pmax, PAGE, E), jnp.bfloat16)
    q = jax.random.normal(jax.random.PRNGKey(5), (t, H, E), jnp.bfloat16)
    pt = jnp.arange(pmax, dtype=jnp.int32)[None]
    cl = jnp.full((1,), t, jnp.int32)
    qs = jnp.array([0, t], jnp.int32)
    pos = jnp.arange(t, dtype=jnp.int32)
    r = {"op": f"attention prefill {t}"}
    for ps in (512, 256, 128):
        f = jax.jit(lambda q, pt, ps=ps: paged_attention(q, kc, vc, pt, cl, qs, pos,
                                                         scale=E**-0.5, partition_size=ps))
        r[f"pallas_p{ps}_us"] = _time_op(f, q, pt, 0) * 1e6
    rows.append(r)
    print(json.dumps(r), flush=True)
    return rows


def torch_rows(shape: str, ctx: int, out: Path, timeout: int) -> list[dict]:
    """Run benchmarks.torch_decode in a child process (before JAX takes the GPU)."""
    from benchmarks.torch_decode import SHAPES as TS

    if shape not in TS:
        return []
    cmd = [sys.executable, "-m", "benchmarks.torch_decode", "--shape", shape, "--ctx", str(ctx),
           "--out", str(out)]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return [{"framework": "torch", "shape": shape, "ctx": ctx,
                 "error": f"torch_decode did not finish in {timeout} s"}]  # fmt: skip
    (out / f"torch_decode_{shape}_{ctx}.log").write_text(r.stdout + r.stderr)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode or not rows:
        rows.append({"framework": "torch", "shape": shape, "ctx": ctx,
                     "error": (r.stdout + r.stderr)[-2000:]})  # fmt: skip
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--shapes", default="llama3-8b,qwen3-8b,qwen3-0.6b")
    p.add_argument("--modes", default="tp,none")
    p.add_argument("--batches", default="1,8,32,64")
    p.add_argument("--ctx", default="1024,8192")
    p.add_argument("--engine-ctx", default="1024", help="contexts with an engine-step row (B=1)")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--pad-tokens", default="", help="batch-1 rows with T padded to these counts "
                   "(the engine pads T to its token bucket, min_tokens_bucket)")  # fmt: skip
    p.add_argument("--variants", default="", help="'tp' Ops settings to compare (a 'none:' prefix: "
                   "that mode's), comma-separated "
                   "('attn_partition=128,attn_partition=512'; a kernel config's field: "
                   "'attn_config.split_stages=2')")  # fmt: skip
    p.add_argument("--kernels", default="", help="shapes whose single-layer kernels to time")
    p.add_argument("--torch", default="", help="shapes for the PyTorch bar (ctx 1k)")
    p.add_argument("--torch-timeout", type=int, default=300)
    p.add_argument("--smoke", action="store_true", help="tiny shape on CPU, seconds")
    return p


def run(out_dir: str = "out", argv: list[str] | None = None) -> dict:
    a = parser().parse_args(argv or [])
    if a.smoke:
        a.shapes, a.batches, a.ctx, a.engine_ctx, a.steps = "tiny", "1,4", "64", "64", 4
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    a.modes = a.modes.split(",")
    a.batches = [int(b) for b in a.batches.split(",")]
    a.ctx = [int(c) for c in a.ctx.split(",")]
    a.engine_ctx = [int(c) for c in a.engine_ctx.split(",") if c]
    a.variants = [v for v in a.variants.split(",") if v]
    a.pad_tokens = [int(t) for t in a.pad_tokens.split(",") if t]
    res: dict = {"args": {k: v for k, v in vars(a).items()}, "torch": [], "rows": [],
                 "variants": [], "kernels": {}}  # fmt: skip

    def save() -> None:
        (out / "decode_bench.json").write_text(json.dumps(res, indent=1, default=str))

    for shape in [s for s in a.torch.split(",") if s]:  # first: JAX takes the GPU when imported
        res["torch"] += torch_rows(shape, 1024, out, a.torch_timeout)
        save()
    import jax

    res["env"] = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
                  "xla_flags": os.environ.get("XLA_FLAGS", "")}  # fmt: skip
    res["ceilings"] = ceil = ceilings()
    print(json.dumps(res["ceilings"]), flush=True)
    for shape in a.shapes.split(","):
        t0 = time.perf_counter()
        model = random_model(shape, max(a.ctx) + a.steps + 64)
        if shape in a.kernels.split(","):
            try:
                res["kernels"][shape] = kernel_rows(model, ceil, min(a.ctx))
            except Exception:  # noqa: BLE001
                res["kernels"][shape] = {"error": traceback.format_exc()[-2000:]}
            save()
        try:
            decode_rows(model, shape, a, ceil, res, save)
        except Exception:  # noqa: BLE001
            res.setdefault("errors", []).append(traceback.format_exc()[-3000:])
            print(res["errors"][-1], file=sys.stderr, flush=True)
        res.setdefault("shape_seconds", {})[shape] = time.perf_counter() - t0
        del model
        save()
    print(table(res), flush=True)
    return res


def table(res: dict) -> str:
    lines = ["shape mode B ctx | device ms tok/s GB/s x_floor | engine ms x_floor host ms"]
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"{r.get('shape')} {r['mode']} {r['batch']} {r['ctx']} ERROR")
            continue
        e = r.get("engine_step_s")
        pad = f" T={r['pad_tokens']}" if r.get("pad_tokens") else ""
        lines.append(
            f"{r['shape']} {r['mode']} {r['batch']}{pad} {r['ctx']} | "
            f"{r['device_step_s'] * 1e3:.2f} "
            f"{r['device_tok_per_s']:.0f} {r['device_GBps']:.0f} {r.get('device_vs_floor', 0):.2f}"
            + (f" | {e * 1e3:.2f} {r.get('engine_vs_floor', 0):.2f} {r['host_s'] * 1e3:.2f}"
               if e else "")
            + (f" | async {r['engine_async_step_s'] * 1e3:.2f} host {r['host_async_s'] * 1e3:.2f}"
               if "engine_async_step_s" in r else "")  # fmt: skip
        )
    for shape, ks in res["kernels"].items():
        for r in ks if isinstance(ks, list) else []:
            lines.append(f"kernel {shape} " + " ".join(
                f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    for r in res["variants"]:
        if "error" not in r:
            lines.append(f"variant {r['shape']} {r['variant']}: {r['device_step_s'] * 1e3:.2f} ms")
    for r in res["torch"]:
        if "step_s" in r:
            lines.append(f"torch {r['shape']} {r['mode']}: {r['step_s'] * 1e3:.2f} ms synced, "
                         f"{r['pipelined_step_s'] * 1e3:.2f} ms pipelined")  # fmt: skip
        else:
            lines.append(f"torch {r.get('shape')} {r.get('mode')}: {r.get('error', '')[:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    run(a.out, argv if argv is not None else sys.argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
