"""Mixture-of-experts decode on one GPU: the Qwen3-30B-A3B shape (random bf16 weights), jdet "tp"
and "none" against transformers' Qwen3-MoE (eager) measured in the same run.

Rows:
- jdet device step (decode_bench.device_step: B sequences at context `ctx` decoding back to
  back) for B = 1, 32, 64, with ms/step, tok/s and x the active-bytes floor;
- jdet engine step (B = 1: Engine.step with the host, after a real prefill): ms/token;
- transformers: `generate` of B sequences of `ctx` prompt tokens, (time for 1 + n new tokens -
  time for 1) / n per decode step, in a child process run before JAX takes the GPU.
Active bytes of a step: every non-expert weight once (embedding excluded: one row is gathered)
+ the experts a step reads + the K/V of the B contexts. At B = 1 a layer reads exactly k experts;
for B > 1 the expected number of distinct experts under uniform routing, E (1 - (1 - k/E)^B)
(random weights route about uniformly; a trained model's routing is skewed, so fewer). The floor
is those bytes over the copy bandwidth measured in this run (decode_bench.ceilings).

    PYTHONPATH=. python -m benchmarks.moe_bench --out OUT [--smoke]
    PYTHONPATH=. python -m benchmarks.gpu_suite --only moe
Writes `moe_bench.json` after every part (a run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import json
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
    """(non-expert weight bytes, expert bytes read, K/V bytes) of one decode step."""
    import jax

    from jdet.kv_cache import kv_bytes_per_token

    cfg = model.cfg
    layers = model.params["layers"]
    expert = sum(layers[n].size * layers[n].dtype.itemsize
                 for n in ("expert_gate", "expert_up", "expert_down"))  # fmt: skip
    total = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(model.params))
    other = total - expert - model.params["embed"].size * model.params["embed"].dtype.itemsize
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    distinct = k if batch == 1 else e * (1 - (1 - k / e) ** batch)
    read = expert * distinct / e  # per layer: `distinct` of the e experts
    kv = kv_bytes_per_token(cfg, model.dtype) * ctx * batch
    return {"other_weight_bytes": other, "expert_bytes_read": read, "kv_bytes": kv,
            "experts_read_per_layer": distinct, "active_bytes": other + read + kv}  # fmt: skip


def jdet_rows(model: Any, a: argparse.Namespace, ceil: dict, res: dict, save: Any) -> None:
    from benchmarks import decode_bench as db

    steps = a.steps
    for mode in a.modes:
        try:
            num_pages = max(db.pages_used(a.ctx + steps + 16) * max(BATCHES), 64)
            eng = db.make_engine(model, mode, a.ctx + steps + 64, num_pages)
            r = eng.runner
            for b in a.batches:
                dev = db.device_step(r, b, a.ctx, steps)
                ab = active_bytes(model, b, a.ctx)
                row = {"framework": "jdet", "mode": mode, "batch": b, "ctx": a.ctx,
                       "device_step_s": dev, "tok_per_s": b / dev, **ab}  # fmt: skip
                if ceil:
                    floor = ab["active_bytes"] / (ceil["copy_GBps"] * 1e9)
                    row.update(floor_s=floor, device_vs_floor=dev / floor)
                res["rows"].append(row)
                save()
            row = {"framework": "jdet-engine", "mode": mode, "batch": 1, "ctx": a.ctx,
                   **db.engine_step(eng, a.ctx, steps)}  # fmt: skip
            res["rows"].append(row)
            save()
            del eng, r
        except Exception:  # noqa: BLE001 - keep the other rows
            res["rows"].append({"framework": "jdet", "mode": mode, "error": traceback.format_exc()})
            save()


def torch_child(shape: str, ctx: int, steps: int, batches: list[int]) -> None:
    """transformers' Qwen3-MoE, random bf16 weights on the GPU, eager: prints one JSON row each."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(SHAPES[shape])
    raw.pop("architectures")
    mt = raw.pop("model_type")
    cfg = AutoConfig.for_model(mt, **raw, max_position_embeddings=ctx + steps + 64)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    for b in batches:
        ids = torch.randint(1, cfg.vocab_size, (b, ctx), device="cuda")

        def gen(n: int, ids: Any = ids) -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0, eos_token_id=None)  # fmt: skip
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        gen(2)  # warm-up
        t1 = min(gen(1) for _ in range(2))
        tn = min(gen(1 + steps) for _ in range(2))
        step = (tn - t1) / steps
        print(json.dumps({"framework": "transformers-eager", "batch": b, "ctx": ctx,
                          "device_step_s": step, "tok_per_s": b / step}), flush=True)  # fmt: skip


def torch_rows(a: argparse.Namespace, out: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "benchmarks.moe_bench", "--torch-child", "--shape", a.shape,
           "--ctx", str(a.ctx), "--steps", str(a.steps),
           "--batches", ",".join(map(str, a.batches))]  # fmt: skip
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.torch_timeout)
    except subprocess.TimeoutExpired:
        return [{"framework": "transformers-eager", "error": f"timed out ({a.torch_timeout} s)"}]
    (out / "moe_bench_torch.log").write_text(r.stdout + r.stderr)
    rows = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode:
        rows.append({"framework": "transformers-eager", "error": (r.stdout + r.stderr)[-2000:]})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="out")
    p.add_argument("--shape", default="qwen3-30b-a3b", choices=sorted(SHAPES))
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--modes", default="tp,none")
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-timeout", type=int, default=1200)
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
        torch_child(a.shape, a.ctx, a.steps, a.batches)
        return 0
    if a.smoke:
        a.shape, a.ctx, a.steps, a.batches, a.no_torch = "tiny-moe", 64, 4, [1, 4], True
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"shape": a.shape, "ctx": a.ctx, "rows": []}

    def save() -> None:
        (out / "moe_bench.json").write_text(json.dumps(res, indent=2))

    if not a.no_torch:  # before JAX takes the GPU's memory
        res["rows"] += torch_rows(a, out)
        save()
    from benchmarks import decode_bench as db

    ceil = db.ceilings()
    res["ceilings"] = ceil
    model = random_model(a.shape, a.ctx + a.steps + 64)
    jdet_rows(model, a, ceil, res, save)
    save()
    if not report:
        return res
    for row in res["rows"]:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
