"""Mixture-of-experts decode on one GPU: the Qwen3-30B-A3B shape (random bf16 weights), jdet "tp"
and "none" against transformers' Qwen3-MoE (eager, then compiled) measured in the same run.

Rows:
- jdet device step (decode_bench.device_step: B sequences at context `ctx` decoding back to
  back) for B = 1, 32, 64, with ms/step, tok/s and x the active-bytes floor;
- jdet engine step (B = 1: Engine.step with the host, after a real prefill): ms/token;
- jdet TTFT of one `--ttft-len`-token prompt (8k) through the engine, chunked by its token
  budget: the first request (with its compiles) and a second, fresh one (no prefix cache);
- transformers: `generate` of B sequences of `ctx` prompt tokens, (time for 1 + n new tokens -
  time for 1) / n per decode step, in a child process run before JAX takes the GPU (its rows
  are kept when its time limit cuts it short).
Active bytes of a step: every non-expert weight once (embedding excluded: one row is gathered)
+ the experts a step reads + the K/V of the B contexts. At B = 1 a layer reads exactly k experts;
for B > 1 the expected number of distinct experts under uniform routing, E (1 - (1 - k/E)^B)
(random weights route about uniformly; a trained model's routing is skewed, so fewer). Expert
bytes are the model's own (width 768): the engine's "tp" layout pads each expert to 1024, but
the kernels skip the zero tiles at TP 1. The floor is max(those bytes over the copy bandwidth
measured in this run (decode_bench.ceilings), 2 x active weights x B flops at the measured bf16
peak).

Memory: every engine is built with `donate_weights`, each mode on a fresh random model, so the
weights are never held twice (benchmarks/moe_memory.py computes the peak from shapes: 99.7 GB in
the "tp" layout, 140 GB had the model been kept). JAX may use 90 % of the GPU here
(XLA_PYTHON_CLIENT_MEM_FRACTION, unless set): transformers has finished before JAX starts. The
engine sizes its KV pool as a user's would (no num_pages: serving/engine/memory.py counts the
compiled step's own peak), so a step that needs more memory than is left fails at construction
naming the terms, not at its first step; `pool_pages` is the least the rows need.

    PYTHONPATH=. python -m benchmarks.moe_bench --out OUT [--smoke]
    PYTHONPATH=. python -m benchmarks.gpu_suite --only moe
Writes `moe_bench.json` after every part (a run cut short keeps what it measured).
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

SHAPES = {
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                          vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
                          tie_word_embeddings=False, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[]),
    "tiny-moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                     vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                     norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]),
}  # fmt: skip
BATCHES = (1, 32, 64)


def random_model(shape: str, max_len: int) -> Any:
    from benchmarks.decode_bench import random_model as make

    return make(shape, max_len, SHAPES)


def active_bytes(model: Any, batch: int, ctx: int) -> dict:
    """(non-expert weight bytes, expert bytes read, K/V bytes) of one decode step, and its
    flops (2 x the weights a token multiplies x B). Shapes only: the model's arrays may have
    been given to an engine (donate_weights) and freed."""
    import jax

    from jdet.kv_cache import kv_bytes_per_token

    cfg = model.cfg
    layers = model.params["layers"]
    size = lambda x: x.size * x.dtype.itemsize  # noqa: E731
    expert = sum(size(layers[n]) for n in ("expert_gate", "expert_up", "expert_down"))
    total = sum(size(x) for x in jax.tree_util.tree_leaves(model.params))
    other = total - expert - size(model.params["embed"])
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = k if batch == 1 else e * (1 - (1 - k / e) ** batch)
    read = expert * distinct / e  # per layer: `distinct` of the e experts
    kv = kv_bytes_per_token(cfg, model.dtype) * ctx * batch
    item = model.params["embed"].dtype.itemsize
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * ctx  # QK^T and PV per token
    flops = batch * (2 * (other + expert * k / e) / item + attn)
    return {"other_weight_bytes": other, "expert_bytes_read": read, "kv_bytes": kv,
            "experts_read_per_layer": distinct, "active_bytes": other + read + kv,
            "flops": flops}  # fmt: skip


def floor_of(ab: dict, ceil: dict) -> float:
    return max(ab["active_bytes"] / (ceil["copy_GBps"] * 1e9),
               ab["flops"] / (ceil["peak_TFLOPs"] * 1e12))  # fmt: skip


def ttft(eng: Any, prompt_len: int, rid: str, seed: int) -> float:
    """Seconds from add_request to the first token of one `prompt_len`-token prompt."""
    import numpy as np

    ids = np.random.default_rng(seed).integers(1, eng.cfg.vocab_size, prompt_len).tolist()
    t0 = time.perf_counter()
    eng.add_request(rid, ids, dict(temperature=0.0, max_tokens=1, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return time.perf_counter() - t0


def memory() -> dict:
    """The device's allocator statistics (bytes in use, the peak so far, JAX's limit)."""
    import jax

    st = jax.local_devices()[0].memory_stats() or {}
    keys = ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")
    return {k: int(st[k]) for k in keys if k in st}


def max_model_len(a: argparse.Namespace) -> int:
    return max(a.ctx + a.steps + 64, a.ttft_len + 64)


def pool_pages(a: argparse.Namespace) -> int:
    """KV pages: the largest batch at ctx, and the TTFT prompt twice over."""
    from benchmarks import decode_bench as db

    batch = db.pages_used(a.ctx + a.steps + 16) * max(a.batches)
    return max(batch, 64) + 2 * db.pages_used(max_model_len(a))


def jdet_rows(a: argparse.Namespace, ceil: dict, res: dict, save: Any) -> None:
    """Each mode on a fresh random model its engine owns (module docstring: memory)."""
    import gc

    from benchmarks import decode_bench as db
    from serving.engine.memory import device_limit

    steps, max_len, need = a.steps, max_model_len(a), pool_pages(a)
    for mode in a.modes:
        try:
            model = random_model(a.shape, max_len)
            made = memory()
            t0 = time.perf_counter()
            # sized by the engine where the device reports its memory (a CPU has no limit)
            sized = device_limit() is not None
            eng = db.make_engine(model, mode, max_len, None if sized else need,
                                 donate_weights=True)  # fmt: skip
            built = time.perf_counter() - t0
            budget = eng.memory_budget
            res["memory"][mode] = {"after_random_model": made, "engine_s": built,
                                   "after_engine": memory(), "num_pages": eng.runner.num_pages,
                                   "pages_needed": need,
                                   "step_peak": budget.peak if budget else None}  # fmt: skip
            save()
            r = eng.runner
            for b in a.batches:
                dev = db.device_step(r, b, a.ctx, steps)
                ab = active_bytes(model, b, a.ctx)
                row = {"framework": "jdet", "mode": mode, "batch": b, "ctx": a.ctx,
                       "device_step_s": dev, "tok_per_s": b / dev, **ab}  # fmt: skip
                if ceil:
                    floor = floor_of(ab, ceil)
                    row.update(floor_s=floor, device_vs_floor=dev / floor)
                res["rows"].append(row)
                save()
            row = {"framework": "jdet-engine", "mode": mode, "batch": 1, "ctx": a.ctx,
                   **db.engine_step(eng, a.ctx, steps)}  # fmt: skip
            res["rows"].append(row)
            save()
            if a.ttft_len:
                first = ttft(eng, a.ttft_len, "ttft0", seed=2)  # with the prefill compiles
                again = ttft(eng, a.ttft_len, "ttft1", seed=3)
                res["rows"].append({"framework": "jdet-engine", "mode": mode, "prompt": a.ttft_len,
                                    "ttft_s": again, "ttft_first_with_compile_s": first,
                                    "chunk_tokens": eng.config.max_num_batched_tokens})  # fmt: skip
            res["memory"][mode]["end"] = memory()
            save()
            del eng, r, model
            gc.collect()
        except Exception:  # noqa: BLE001 - keep the other rows
            res["rows"].append({"framework": "jdet", "mode": mode, "error": traceback.format_exc()})
            save()
            gc.collect()


def torch_child(a: argparse.Namespace) -> None:
    """transformers' Qwen3-MoE, random bf16 weights on the GPU: one JSON row per (variant, B),
    printed as measured (the parent keeps them if its time limit cuts this short). Eager for
    every B, then `torch.compile` (default mode) at B = 1."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(SHAPES[a.shape])
    raw.pop("architectures")
    mt = raw.pop("model_type")
    cfg = AutoConfig.for_model(mt, **raw, max_position_embeddings=a.ctx + a.steps + 64)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    print(json.dumps({"framework": "transformers", "load_s": time.perf_counter() - t0,
                      "transformers": __import__("transformers").__version__,
                      "torch": torch.__version__}), flush=True)  # fmt: skip
    steps = a.torch_steps

    def measure(name: str, b: int, reps: int) -> None:
        ids = torch.randint(1, cfg.vocab_size, (b, a.ctx), device="cuda")

        def gen(n: int) -> float:
            torch.cuda.synchronize()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, eos_token_id=None)  # fmt: skip
            torch.cuda.synchronize()
            return time.perf_counter() - t

        gen(2)  # warm-up (and the compile)
        t1 = min(gen(1) for _ in range(reps))
        tn = min(gen(1 + steps) for _ in range(reps))
        step = (tn - t1) / steps
        print(json.dumps({"framework": name, "batch": b, "ctx": a.ctx, "steps": steps,
                          "device_step_s": step, "tok_per_s": b / step}), flush=True)  # fmt: skip

    for b in a.batches:
        measure("transformers-eager", b, reps=2 if b == 1 else 1)
    try:
        model.forward = torch.compile(model.forward)
        measure("transformers-compiled", 1, reps=2)
    except Exception as e:  # noqa: BLE001 - the eager rows stand
        print(json.dumps({"framework": "transformers-compiled", "error": repr(e)[-1500:]}),
              flush=True)  # fmt: skip


def torch_rows(a: argparse.Namespace, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.moe_bench", "--torch-child", "--shape", a.shape,
           "--ctx", str(a.ctx), "--torch-steps", str(a.torch_steps),
           "--batches", ",".join(map(str, a.batches))]  # fmt: skip
    err = None
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.torch_timeout)
        stdout, stderr = r.stdout, r.stderr
        if r.returncode:
            err = (stdout + stderr)[-2000:]
    except subprocess.TimeoutExpired as e:  # keep the rows it printed
        text = lambda x: x.decode() if isinstance(x, bytes) else (x or "")  # noqa: E731
        stdout, stderr = text(e.stdout), text(e.stderr)
        err = f"stopped at its time limit ({a.torch_timeout} s)"
    (out / "moe_bench_torch.log").write_text(stdout + stderr)
    rows = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    if err:
        rows.append({"framework": "transformers", "error": err})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--modes", default="tp,none")
    p.add_argument("--ttft-len", type=int, default=8192, help="TTFT prompt tokens (0: skip)")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-steps", type=int, default=8)
    p.add_argument("--torch-timeout", type=int, default=150)
    p.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="tiny shape, few steps (CPU check)")
    return p


def run(out_dir: str = "out", argv: list[str] | None = None) -> dict:
    """benchmarks.gpu_suite's entry point ("moe"): the rows as a dict, also in moe_bench.json."""
    return main(["--out", str(out_dir), *(argv or [])], report=False)


def main(argv: list[str] | None = None, report: bool = True) -> Any:
    a = parser().parse_args(argv)
    a.batches = [int(b) for b in str(a.batches).split(",")]
    a.modes = a.modes.split(",")
    if a.torch_child:
        torch_child(a)
        return 0
    if a.smoke:
        a.shape, a.ctx, a.steps, a.batches, a.ttft_len = "tiny-moe", 64, 4, [1, 4], 96
        a.no_torch = a.no_torch or not _has_cuda()
    # before JAX starts (a no-op when gpu_suite imported it already): transformers is done
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"shape": a.shape, "ctx": a.ctx, "rows": [], "memory": {}}

    def save() -> None:
        (out / "moe_bench.json").write_text(json.dumps(res, indent=2))

    from benchmarks.moe_memory import plan

    res["memory"]["plan"] = plan(a.shape, pool_pages(a))  # from shapes: the layout's peak
    if not a.no_torch:  # before JAX takes the GPU's memory
        res["rows"] += torch_rows(a, out)
        save()
    from benchmarks import decode_bench as db

    ceil = db.ceilings()
    res["ceilings"] = ceil
    jdet_rows(a, ceil, res, save)
    save()
    if not report:
        return res
    for row in res["rows"]:
        print(json.dumps(row), flush=True)
    return 0


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


if __name__ == "__main__":
    sys.exit(main())
