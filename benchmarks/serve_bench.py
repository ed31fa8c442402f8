"""Serving benchmarks, side by side in one run; writes `serve_bench.json`.

1. Offline throughput: `n_requests` requests (prompt lengths uniform in `prompt_len`, outputs
   uniform in `output_len`, seeded temperature-0.7 sampling, EOS ignored) through the engine for
   invariance "tp", "batch" and "none" — output tokens/s and the ratio of each mode to "none".
2. Batch-1 decode: step time of one sequence at context `decode_ctx`, both through the whole
   engine loop (host work included) and as back-to-back device steps; bytes moved per step
   (every weight once + the K/V read) / time = achieved GB/s, against the HBM floor
   (bytes / copy bandwidth measured in the same run).
3. Serving with Poisson arrivals at several rates: TTFT and inter-token latency p50/p99,
   Sarathi-Serve stall-free scheduling (decodes first, prefill chunks within the token budget)
   vs prefill-first (whole prompts at once while decodes wait) — the Sarathi effect.

Weights are random (bf16) with the shapes of Qwen3-0.6B or Qwen3-8B; no tokenizer, so no
detokenisation cost. Every engine compiles its token buckets before timing (`Engine.warmup`).

    PYTHONPATH=. python -m benchmarks.serve_bench --out out [--shape 0.6b] [--smoke]
`--smoke` runs a tiny model with a few requests on CPU in seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any

import numpy as np

SHAPES = {
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 tie_word_embeddings=False),
    "0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                 num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, tie_word_embeddings=True),
    "8b": dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
               num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
               head_dim=128, tie_word_embeddings=False),
}  # fmt: skip


def random_model(shape: str, dtype: str = "bfloat16", max_len: int = 40960,
                 on_device: bool = False) -> Any:  # fmt: skip
    """A jdet.Model with random weights of the named Qwen3 shape (no tokenizer); `on_device`:
    drawn by jax.random on the device (`init_params`), seconds instead of minutes for 8B."""
    import jax.numpy as jnp

    from jdet.config import ModelConfig
    from jdet.loader import Model
    from jdet.params import init_params

    raw = dict(
        model_type="qwen3",
        architectures=["Qwen3ForCausalLM"],
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        max_position_embeddings=max_len,
        eos_token_id=0,
        bos_token_id=0,
        attention_bias=False,
        torch_dtype=dtype,
        **SHAPES[shape],
    )
    cfg = ModelConfig.from_hf(raw)
    params = init_params(cfg, seed=0, dtype=jnp.dtype(dtype), on_device=on_device)
    return Model(cfg=cfg, params=params, tokenizer=None, path=None, hf_config=raw)


def workload(
    n: int, prompt_len: tuple[int, int], output_len: tuple[int, int], vocab: int, seed: int = 0
) -> list[tuple[list[int], dict]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        o = int(rng.integers(output_len[0], output_len[1] + 1))
        ids = rng.integers(1, vocab, p).tolist()
        out.append((ids, dict(temperature=0.7, seed=i, max_tokens=o, ignore_eos=True)))
    return out


def make_engine(model: Any, mode: str, a: argparse.Namespace, warm: bool = True, **kw: Any) -> Any:
    """An engine with fixed S and Pmax buckets (few shapes); `warm` compiles its token buckets."""
    import gc

    from serving.engine.engine import Engine

    gc.collect()  # the previous engine's KV cache must be gone before this one sizes its pool
    max_len = kw.pop("max_model_len", a.max_model_len)
    settings = dict(
        invariance=mode, max_num_batched_tokens=a.budget, max_num_seqs=a.max_num_seqs,
        max_model_len=max_len, page_size=a.page_size, num_pages=a.num_pages,
        min_seqs_bucket=a.max_num_seqs, min_pages_bucket=max_len // a.page_size,
        min_tokens_bucket=a.min_tokens_bucket,
        keep_raw_metrics=True,  # p50/p99 from every sample (the engine keeps none by default)
    )  # fmt: skip
    settings.update(kw)
    eng = Engine(model, **settings)
    if a.num_pages is None:
        # Pin the pool to the first engine's size: free memory drifts a little between engines, and
        # a different page count is a different cache shape, i.e. a fresh compile of every bucket.
        a.num_pages = eng.page_manager.num_pages
    eng.warmup_s = eng.warmup() if warm else 0.0
    return eng


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


# ---------------------------------------------------------------------- 1. offline throughput
def offline(model: Any, a: argparse.Namespace) -> list[dict]:
    work = workload(a.n_requests, a.prompt_len, a.output_len, model.cfg.vocab_size)
    rows = []
    for mode in a.modes:
        eng = make_engine(model, mode, a)
        t0 = time.perf_counter()
        for i, (ids, p) in enumerate(work):
            eng.add_request(f"r{i}", ids, p)
        outs = eng.run()
        dt = time.perf_counter() - t0
        gen = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt = sum(len(ids) for ids, _ in work)
        raw = eng.metrics.raw
        rows.append({
            "mode": mode, "requests": len(outs), "seconds": dt, "output_tokens": gen,
            "output_tok_per_s": gen / dt, "total_tok_per_s": (gen + prompt) / dt,
            "steps": eng.num_steps, "mean_step_tokens": float(np.mean(raw.step_tokens)),
            "preemptions": eng.scheduler.num_preemptions, "warmup_s": eng.warmup_s,
            "compiled_shapes": len(eng.runner.shapes_seen),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del eng
    base = next((r for r in rows if r["mode"] == "none"), None)
    for r in rows:
        if base:
            r["ratio_vs_none"] = r["output_tok_per_s"] / base["output_tok_per_s"]
    return rows


# ---------------------------------------------------------------------- 2. batch-1 decode
def copy_bandwidth() -> float | None:
    import jax

    if jax.default_backend() == "cpu":
        return None
    from benchmarks.attention_bench import copy_bandwidth as cb

    return cb()


def decode_b1(model: Any, a: argparse.Namespace, bw: float | None) -> list[dict]:
    import jax

    from jdet.kv_cache import kv_bytes_per_token

    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.params))
    if model.cfg.tie_word_embeddings:
        weight_bytes += 0  # embed is read once as lm_head; the gathered row is negligible
    else:
        weight_bytes -= model.params["embed"].size * model.params["embed"].dtype.itemsize
    ctx = a.decode_ctx
    kv_bytes = kv_bytes_per_token(model.cfg, model.dtype) * ctx
    rows = []
    for mode in a.modes:
        eng = make_engine(
            model,
            mode,
            a,
            warm=False,
            min_tokens_bucket=1,
            min_seqs_bucket=1,
            max_model_len=a.decode_ctx + a.decode_steps + 16,
        )
        ids = list(np.random.default_rng(1).integers(1, model.cfg.vocab_size, ctx - 1))
        eng.add_request(
            "b1", ids, dict(temperature=0.0, max_tokens=a.decode_steps + 2, ignore_eos=True)
        )
        step_times = []
        while eng.has_unfinished():
            t0 = time.perf_counter()
            eng.step()
            step_times.append(time.perf_counter() - t0)
        loop_t = float(np.median(step_times[3:])) if len(step_times) > 4 else None
        # device-only: the same decode step replayed back to back (no host work in between)
        seq_ids = ids + [1]
        from serving.sampling_options import SamplingOptions
        from serving.sequence import Sequence

        seq = Sequence("dev", 0, seq_ids, SamplingOptions(temperature=0.0), seed=0)
        eng.page_manager.grow(seq, len(seq_ids))
        seq.num_computed_tokens = len(seq_ids) - 1
        batch, sampling = eng.runner.prepare([(seq, 1)])
        batch = jax.device_put(batch)
        sampling = jax.device_put(sampling)
        out = eng.runner.dispatch(batch, sampling)
        jax.block_until_ready(out.tokens)
        n = a.decode_steps
        t0 = time.perf_counter()
        for _ in range(n):
            out = eng.runner.dispatch(batch, sampling)
        jax.block_until_ready(out.tokens)
        dev_t = (time.perf_counter() - t0) / n
        eng.page_manager.release(seq)
        total = weight_bytes + kv_bytes
        row = {"mode": mode, "ctx": ctx, "bytes_per_step": total,
               "engine_step_s": loop_t, "engine_tok_per_s": 1 / loop_t if loop_t else None,
               "device_step_s": dev_t, "device_tok_per_s": 1 / dev_t,
               "device_GBps": total / dev_t / 1e9}  # fmt: skip
        if bw:
            floor = total / bw
            row.update(
                hbm_floor_s=floor,
                device_vs_floor=dev_t / floor,
                engine_vs_floor=(loop_t / floor) if loop_t else None,
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
        del eng
    return rows


# ---------------------------------------------------------------------- 3. Poisson serving
def poisson_run(eng: Any, work: list[tuple[list[int], dict]], rate: float) -> dict:
    """Drive `eng` from one thread, as the server's engine thread does (serving/http/driver.py),
    with `work` arriving as a Poisson process of `rate` requests/s: seconds, and TTFT, ITL and
    e2e percentiles (seconds) of this run alone, from the engine's raw samples (an engine built
    with `keep_raw_metrics`; one engine may serve several runs in turn)."""
    raw = eng.metrics.raw
    start = {k: len(getattr(raw, k)) for k in ("ttft", "itl", "e2e")}
    preempted = eng.scheduler.num_preemptions
    rng = np.random.default_rng(int(rate * 1000))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(work)))
    t0 = time.perf_counter()
    nxt = 0
    while nxt < len(work) or eng.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(work) and arrivals[nxt] <= now:
            ids, p = work[nxt]
            eng.add_request(f"r{rate:g}-{nxt}", ids, p, arrival_time=t0 + arrivals[nxt])
            nxt += 1
        if eng.has_unfinished():
            eng.step()
        elif nxt < len(work):
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
    dt = time.perf_counter() - t0
    ttft, itl, e2e = (getattr(raw, k)[start[k]:] for k in ("ttft", "itl", "e2e"))
    return {"rate_req_s": rate, "requests": len(work), "seconds": dt,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "itl_p50": pct(itl, 50), "itl_p99": pct(itl, 99), "itl_max": max(itl, default=None),
            "e2e_p50": pct(e2e, 50),
            "preemptions": eng.scheduler.num_preemptions - preempted}  # fmt: skip


def poisson(model: Any, a: argparse.Namespace) -> list[dict]:
    rows = []
    work = workload(
        a.poisson_requests, a.poisson_prompt_len, a.poisson_output_len, model.cfg.vocab_size, seed=7
    )
    for policy in ("stall_free", "prefill_first"):
        budget = a.budget if policy == "stall_free" else max(a.budget, a.poisson_prompt_len[1])
        for rate in a.rates:
            eng = make_engine(
                model,
                a.poisson_mode,
                a,
                scheduling=policy,
                max_num_batched_tokens=budget,
                min_tokens_bucket=16,
                max_model_len=a.poisson_max_model_len,
            )
            row = {"policy": policy, "budget": budget, **poisson_run(eng, work, rate)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            del eng
    return rows


# ---------------------------------------------------------------------- entry points
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.serve_bench", description=__doc__.splitlines()[0]
    )
    p.add_argument("--out", default="out")
    p.add_argument("--shape", default="0.6b", choices=sorted(SHAPES))
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--parts", default="offline,decode,poisson")
    p.add_argument("--modes", default="tp,batch,none")
    p.add_argument("--n-requests", type=int, default=1000)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 128))
    p.add_argument("--output-len", type=int, nargs=2, default=(90, 110))
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument(
        "--min-tokens-bucket",
        type=int,
        default=256,
        help="smallest padded token count of the offline runs (fewer compiles)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=256,
        help="offline runs; S and Pmax buckets are fixed at their maxima, so keep it "
        "just above the longest prompt + output",
    )
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--decode-ctx", type=int, default=1024)
    p.add_argument("--decode-steps", type=int, default=64)
    p.add_argument("--poisson-mode", default="tp")
    p.add_argument("--poisson-requests", type=int, default=64)
    p.add_argument("--poisson-prompt-len", type=int, nargs=2, default=(256, 1536))
    p.add_argument("--poisson-output-len", type=int, nargs=2, default=(64, 128))
    p.add_argument("--poisson-max-model-len", type=int, default=2048)
    p.add_argument("--rates", type=float, nargs="+", default=(4.0, 16.0, 64.0))
    p.add_argument("--smoke", action="store_true", help="tiny model, a few requests (CPU)")
    return p


def smoke_args(a: argparse.Namespace) -> argparse.Namespace:
    a.shape, a.dtype, a.n_requests = "tiny", "float32", 12
    a.prompt_len, a.output_len, a.budget, a.min_tokens_bucket = (4, 24), (4, 10), 64, 16
    a.max_num_seqs, a.max_model_len, a.page_size, a.num_pages = 8, 128, 8, 128
    a.decode_ctx, a.decode_steps = 32, 8
    a.poisson_requests, a.poisson_prompt_len, a.poisson_output_len = 8, (8, 48), (4, 8)
    a.rates, a.poisson_max_model_len = (50.0,), 128
    return a


def run(out_dir: str = "out", argv: list[str] | None = None, **overrides: Any) -> dict:
    """Run the selected parts; `overrides` set any option by its dest name (e.g. shape="8b")."""
    import jax

    a = parser().parse_args(argv or [])
    if a.smoke or overrides.get("smoke"):
        a = smoke_args(a)
    for k, v in overrides.items():
        setattr(a, k, v)
    if isinstance(a.modes, str):
        a.modes = [m for m in a.modes.split(",") if m]
    parts = a.parts.split(",") if isinstance(a.parts, str) else list(a.parts)
    dev = jax.devices()[0]
    res: dict[str, Any] = {
        "device": dev.device_kind,
        "backend": jax.default_backend(),
        "jax": jax.__version__,
        "shape": a.shape,
        "dtype": a.dtype,
        "settings": {k: v for k, v in vars(a).items() if k != "out"},
    }
    os.makedirs(out_dir, exist_ok=True)

    def save() -> None:  # after every part, so a run cut short keeps what it measured
        with open(os.path.join(out_dir, f"serve_bench_{a.shape}.json"), "w") as fh:
            json.dump(res, fh, indent=1, default=str)

    t0 = time.perf_counter()
    need = max(a.max_model_len, a.poisson_max_model_len, a.decode_ctx + a.decode_steps + 16)
    model = random_model(a.shape, a.dtype, max_len=max(need, 4096))
    res["load_s"] = time.perf_counter() - t0
    if "decode" in parts:
        try:
            bw = copy_bandwidth()
            res["copy_GBps"] = bw / 1e9 if bw else None
            res["decode_b1"] = decode_b1(model, a, bw)
        except Exception:  # noqa: BLE001 - keep the other parts
            res["decode_b1_error"] = traceback.format_exc()[-3000:]
            print(res["decode_b1_error"], file=sys.stderr)
        save()
    if "offline" in parts:
        try:
            res["offline"] = offline(model, a)
        except Exception:  # noqa: BLE001
            res["offline_error"] = traceback.format_exc()[-3000:]
            print(res["offline_error"], file=sys.stderr)
        save()
    if "poisson" in parts:
        try:
            res["poisson"] = poisson(model, a)
        except Exception:  # noqa: BLE001
            res["poisson_error"] = traceback.format_exc()[-3000:]
            print(res["poisson_error"], file=sys.stderr)
    save()
    return res


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parser().parse_args(argv)
    run(a.out, argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
