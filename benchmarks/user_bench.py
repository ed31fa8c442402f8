"""What a user gets: `jdet.LLM` at its default settings, by wall clock, against compiled PyTorch in
the same run. The headline of BENCHMARKS.md.

    PYTHONPATH=. python -m benchmarks.user_bench [--shape llama3-8b] [--out DIR] [--smoke]

Parts (JSON rows in user_bench.json; random bf16 weights of the named shape, drawn on the device):
- start: a fresh process builds `jdet.LLM(model)` and generates one token (warm-up of every step
  shape included): seconds to the engine and to that first token, cold (an empty cache
  directory) and then warm (the same directory: jdet's executable cache);
- decode: batch-1 decode ms/token = (wall of a 1024-token prompt + 129 greedy tokens - wall of
  another 1024-token prompt + 1 token) / 128, best of 2 each, at the defaults, at context 8192,
  and across the settings a user may choose: max_num_seqs {1, 8, 16, 64, 256} x pools {sized by
  default, 1024 and 16384 pages} (a cliff between them is a bug);
- ttft: one prompt of 2k / 8k / 32k tokens, 1 output token, at the default settings and at
  max_num_batched_tokens 512 (every step within the stall-free budget);
- torch: compiled PyTorch decode (benchmarks/torch_decode.py, `torch.compile(mode=
  "reduce-overhead")`) at context 1024 and 8192, in a subprocess of this run, so the ratios are
  taken on one GPU at one time;
- tp: batch-1 decode at context 1024 and TTFT of an 8k prompt, defaults, at each TP size the
  host has (1, 2, 4), `invariance="tp"`, each engine in a fresh process; rows carry `vs_tp1`;
- sdpa: the TTFT anchor: transformers (`attn_implementation="sdpa"`) on the same shape, random
  bf16 weights, the same prompt lengths, one forward with `logits_to_keep=1`, best of 2, in a
  subprocess;
- offline: the mixed workload through one `LLM.generate` call: 256 requests, prompts uniform in
  128-1024 tokens, outputs in 64-512 (seeded, greedy, EOS ignored), timed after a warm-up call,
  `jdet.LLM(model)` with invariance "tp" (the default) and "none", each in a fresh process:
  output and total tok/s, steps, `vs_none` (tok/s over that of "none": above 1 is faster), and
  the roofline, a lower bound on the wall time from the hardware: the larger of compute (2 x the
  weights x the tokens each meets, the LM head for output tokens only, at the bf16 matmul peak)
  and memory (the longest output's steps, each reading every weight once, at the copy
  bandwidth), both ceilings measured in that process (benchmarks/matmul_bench.py `ceilings`);
  `vs_roofline` = wall / roofline;
- itl: serving under Poisson load: an `Engine` built as `jdet serve` builds it and warmed as its
  engine thread warms it, driven from one thread as that thread drives it (serve_bench's
  `poisson_run`; no HTTP: what the engine adds, not the server's handlers), 128 requests of
  256-1536 prompt tokens and 64-128 outputs at 4 and 16 requests/s: TTFT and inter-token latency
  p50/p99 (ms), at the defaults (steps without decodes up to 8192 tokens on a GPU, steps with
  decodes within the stall-free budget of 512) and at max_num_batched_tokens 512 (every step
  within 512), each in a fresh process.
Each jdet row states its engine's pool and settings; each decode row its ratio to compiled
PyTorch at the same context, each ttft row its ratio to SDPA at the same length. `env` records
the device, date, versions and commit. `--smoke` (a CPU check; notebooks/06 reads its JSON in
CI) runs start, decode, ttft and sdpa at the tiny shape: a 2 x 2 sweep, a 48-token prompt, SDPA
on the CPU; `--smoke --parts offline,itl` runs those at the tiny shape with a few requests (one
itl engine: 512 is a CPU's default), the roofline from the CPU's own ceilings.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SWEEP_SEQS = (1, 8, 16, 64, 256)
SWEEP_POOLS = (None, 1024, 16384)  # None: the engine sizes it (serving/engine/memory.py)
SMOKE_SEQS, SMOKE_POOLS = (1, 8), (None, 2048)
TTFT_LENS, SMOKE_TTFT_LENS = (2048, 8192, 32768), (48,)
# the offline mixed workload and the Poisson load (module docstring); smoke: the tiny shape's
OFFLINE = {"n": 256, "prompt": (128, 1024), "output": (64, 512), "max_len": 8192}
SMOKE_OFFLINE = {"n": 8, "prompt": (8, 48), "output": (4, 12), "max_len": 128}
ITL = {"n": 128, "prompt": (256, 1536), "output": (64, 128), "rates": (4.0, 16.0), "max_len": 2048}
SMOKE_ITL = {"n": 8, "prompt": (8, 48), "output": (4, 8), "rates": (50.0,), "max_len": 128}


def _model(shape: str, max_len: int) -> Any:
    from benchmarks.decode_bench import random_model

    return random_model(shape, max_len)


def _decode_ms(llm: Any, ctx: int, rng: np.random.Generator, steps: int = 128) -> tuple:
    """(decode ms/token, prompt-only wall s) through LLM.generate (module docstring)."""
    import jdet

    def wall(n: int) -> float:
        ids = rng.integers(1, llm.model.cfg.vocab_size, ctx).tolist()
        sp = jdet.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate([ids], sp)
        return time.perf_counter() - t0

    wall(1), wall(9)  # the prefill and decode shapes met, whatever warm-up did
    one = min(wall(1) for _ in range(2))
    many = min(wall(steps + 1) for _ in range(2))
    return (many - one) / steps * 1e3, one


def _engine_row(llm: Any, **extra: Any) -> dict:
    e = getattr(llm, "engine", llm)  # a jdet.LLM or an Engine
    return {"num_pages": e.page_manager.num_pages, "max_model_len": e.max_model_len,
            "max_num_seqs": e.config.max_num_seqs,
            "max_num_batched_tokens": e.config.max_num_batched_tokens,
            "invariance": e.invariance, **extra}  # fmt: skip


def _decode_child(shape: str, kw: dict, ctxs: tuple[int, ...], smoke: bool) -> None:
    """One engine of the sweep, in this (fresh) process: prints a JSON row per context."""
    import jdet

    rng = np.random.default_rng(0)
    llm = jdet.LLM(_model(shape, 16384), warmup=False, **kw)
    for ctx in ctxs:
        ms, _ = _decode_ms(llm, ctx, rng, steps=8 if smoke else 128)
        print(json.dumps(_engine_row(llm, part="decode", settings=kw, ctx=ctx, decode_ms=ms)),
              flush=True)  # fmt: skip


def _child_rows(cmd: list[str], fallback: dict, env: dict | None = None) -> list[dict]:
    """Run `cmd` (a fresh process) and return the JSON rows it printed, or one row of `fallback`
    with the tail of its stderr when it printed none."""
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    return rows or [{**fallback, "error": p.stderr[-2000:]}]


def _fresh_engines(part: str, shape: str, children: list[tuple[dict, dict]]) -> list[dict]:
    """`part`'s child (`--{part}-child`) once per (settings, payload), each a fresh process: its
    JSON rows, each printed whole as it comes (a run killed at its time limit still leaves every
    finished row, errors included, in its log)."""
    rows = []
    for kw, payload in children:
        cmd = [sys.executable, "-m", "benchmarks.user_bench", f"--{part}-child",
               json.dumps(payload), "--shape", shape]  # fmt: skip
        for r in _child_rows(cmd, {"part": part, "settings": kw}):
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def decode(shape: str, smoke: bool, shard: tuple[int, int] = (0, 1)) -> list[dict]:
    """Each setting in a fresh process, as a user starts an engine: one engine's pool and
    compiles never weigh on the next. `shard` (i, n): only every n-th setting from the i-th, so
    n processes on n GPUs share the sweep (`--merge` joins their JSON)."""
    settings: list[dict] = [{}]  # the defaults first
    seqs, pools = (SMOKE_SEQS, SMOKE_POOLS) if smoke else (SWEEP_SEQS, SWEEP_POOLS)
    # the sized pool across max_num_seqs first: a run cut short keeps the cliff check
    settings += [{"max_num_seqs": s, "num_pages": p} for p in pools for s in seqs
                 if (s, p) != (256, None)]  # fmt: skip
    return _fresh_engines("decode", shape, [
        (kw, {"kw": {k: v for k, v in kw.items() if v is not None}, "smoke": smoke,
              "ctxs": (64,) if smoke else (1024,) + ((8192,) if not kw else ())})
        for kw in settings[shard[0]::shard[1]]
    ])  # fmt: skip


def _ttft_child(shape: str, kw: dict, smoke: bool, lens: tuple[int, ...] = ()) -> None:
    """One engine's time to first token at each prompt length, in this (fresh) process."""
    import jdet

    rng = np.random.default_rng(1)
    lens = lens or (SMOKE_TTFT_LENS if smoke else TTFT_LENS)
    model = _model(shape, max(lens) + 64)
    llm = jdet.LLM(model, warmup=False, **kw)
    for n in lens:
        sp = jdet.SamplingParams(max_tokens=1, temperature=0.0)
        prompts = [rng.integers(1, model.cfg.vocab_size, n).tolist() for _ in range(3)]
        llm.generate([prompts[0]], sp)  # its shapes compiled
        t = []
        for ids in prompts[1:]:
            t0 = time.perf_counter()
            llm.generate([ids], sp)
            t.append(time.perf_counter() - t0)
        print(json.dumps(_engine_row(llm, part="ttft", prompt=n, ttft_ms=min(t) * 1e3)),
              flush=True)  # fmt: skip


def ttft(shape: str, smoke: bool) -> list[dict]:
    """At the defaults and at max_num_batched_tokens 512, each engine in a fresh process (as
    `decode`)."""
    budgets = [{}] if smoke else [{}, {"max_num_batched_tokens": 512}]
    return _fresh_engines("ttft", shape, [(kw, {"kw": kw, "smoke": smoke}) for kw in budgets])


def _roofline(model: Any, prompt: int, output: int, requests: int, steps: int,
              ceil: dict) -> dict:  # fmt: skip
    """A lower bound on the offline workload's wall time from the hardware (module docstring):
    compute, 2 x the weights' elements x the tokens each passes (the body: every prompt token and
    every output token but each request's last; the LM head: each output token), at the bf16
    matmul peak; memory, `steps` steps that each read every weight once, at the copy bandwidth.
    The embedding (gathered, not multiplied) counts only where it is tied (it is the LM head)."""
    import jax

    from benchmarks.decode_bench import step_bytes

    w, _ = step_bytes(model, 1, 0)  # the bytes a step streams
    head = model.params["embed"].size
    elems = sum(x.size for x in jax.tree_util.tree_leaves(model.params))
    body = elems - head - (0 if model.cfg.tie_word_embeddings else model.params["lm_head"].size)
    flops = 2.0 * body * (prompt + output - requests) + 2.0 * head * output
    compute = flops / (ceil["peak_TFLOPs"] * 1e12)
    memory = steps * w / (ceil["copy_GBps"] * 1e9)
    return {"flops": flops, "weight_bytes": w, "min_steps": steps, **ceil,
            "roofline_compute_s": compute, "roofline_memory_s": memory,
            "roofline_s": max(compute, memory)}  # fmt: skip


def _offline_child(shape: str, kw: dict, smoke: bool) -> None:
    """The offline mixed workload through one `jdet.LLM` in this (fresh) process: its row, with
    the roofline from ceilings measured here before the engine takes the memory."""
    import gc

    import jdet
    from benchmarks.matmul_bench import ceilings
    from benchmarks.serve_bench import workload

    w = SMOKE_OFFLINE if smoke else OFFLINE
    sizes = (256, 1 << 22) if smoke else (8192, 1 << 29)  # smoke: the CPU's own figures
    c = ceilings(*sizes)
    ceil = {"peak_TFLOPs": c["xla_bf16_tflops"], "copy_GBps": c["copy_gbps"],
            "ceilings": f"bf16 {sizes[0]}^3 matmul, {sizes[1] >> 19} MiB copy in this process"}
    gc.collect()
    model = _model(shape, w["max_len"])
    llm = jdet.LLM(model, warmup=True, **kw)  # every step shape compiled at the first call

    def batch(n: int, seed: int) -> tuple[list, list]:
        work = workload(n, w["prompt"], w["output"], model.cfg.vocab_size, seed)
        sps = [jdet.SamplingParams(max_tokens=p["max_tokens"], temperature=0.0, ignore_eos=True)
               for _, p in work]  # fmt: skip
        return [ids for ids, _ in work], sps

    llm.generate(*batch(min(16, w["n"]), seed=1), use_tqdm=False)  # the warm-up call
    prompts, sps = batch(w["n"], seed=0)
    e = llm.engine
    steps, preempted = e.num_steps, e.scheduler.num_preemptions
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sps, use_tqdm=False)
    dt = time.perf_counter() - t0
    gen, prompt = sum(len(o.outputs[0].token_ids) for o in outs), sum(map(len, prompts))
    row = _engine_row(llm, part="offline", settings=kw, requests=len(outs), seconds=dt,
                      prompt_tokens=prompt, output_tokens=gen, output_tok_per_s=gen / dt,
                      total_tok_per_s=(gen + prompt) / dt, steps=e.num_steps - steps,
                      preemptions=e.scheduler.num_preemptions - preempted)  # fmt: skip
    row.update(_roofline(model, prompt, gen, len(outs), max(sp.max_tokens for sp in sps), ceil))
    row["vs_roofline"] = dt / row["roofline_s"]
    print(json.dumps(row), flush=True)


def offline(shape: str, smoke: bool) -> list[dict]:
    """invariance "tp" (the default) and "none", each engine in a fresh process."""
    modes = ({"invariance": "tp"}, {"invariance": "none"})
    return _fresh_engines("offline", shape, [(kw, {"kw": kw, "smoke": smoke}) for kw in modes])


def _itl_child(shape: str, kw: dict, smoke: bool) -> None:
    """One engine built as `jdet serve` builds it (serving/http/launch.py) and warmed as its
    engine thread warms it before /health answers ready, in this (fresh) process, under Poisson
    load at each rate: a row per rate."""
    from benchmarks.serve_bench import poisson_run, workload
    from jdet.settings import EngineConfig
    from serving.engine.engine import Engine

    w = SMOKE_ITL if smoke else ITL
    model = _model(shape, w["max_len"])
    eng = Engine(model, EngineConfig(**kw), keep_raw_metrics=True)  # p50/p99 from every sample
    warm = eng.warmup("step")
    for i, rate in enumerate(w["rates"]):  # a seed per rate: no prompt is a cached prefix
        r = poisson_run(eng, workload(w["n"], w["prompt"], w["output"], model.cfg.vocab_size,
                                      seed=7 + i), rate)  # fmt: skip
        lat = {f"{k}_ms": v * 1e3 for k, v in r.items()
               if k.startswith(("ttft", "itl", "e2e")) and v is not None}  # fmt: skip
        row = _engine_row(eng, part="itl", settings=kw, scheduling=eng.config.scheduling,
                          stall_free_budget=eng.config.stall_free_budget, warmup_s=warm,
                          rate_req_s=rate, requests=r["requests"], seconds=r["seconds"], **lat,
                          preemptions=r["preemptions"])  # fmt: skip
        print(json.dumps(row), flush=True)


def itl(shape: str, smoke: bool) -> list[dict]:
    """At the defaults and at max_num_batched_tokens 512, each engine in a fresh process."""
    budgets = [{}] if smoke else [{}, {"max_num_batched_tokens": 512}]  # a CPU's default: 512
    return _fresh_engines("itl", shape, [(kw, {"kw": kw, "smoke": smoke}) for kw in budgets])


def tp_sizes(smoke: bool) -> list[int]:
    """TP sizes this host can run: 1, 2, 4 up to its device count (a CPU smoke run: 1, 2)."""
    if smoke:
        return [1, 2]
    import jax

    return [n for n in (1, 2, 4) if n <= len(jax.devices())]


def tp(shape: str, smoke: bool) -> list[dict]:
    """Decode and TTFT per TP size (module docstring), each engine in a fresh process."""
    rows = []
    lens = SMOKE_TTFT_LENS if smoke else (8192,)
    for n in tp_sizes(smoke):
        kw = {"tp": n}
        for r in _fresh_engines("decode", shape, [(kw, {"kw": kw, "smoke": smoke,
                                                       "ctxs": (64,) if smoke else (1024,)})]):
            rows.append({**r, "part": "tp", "tp": n})
        for r in _fresh_engines("ttft", shape, [(kw, {"kw": kw, "smoke": smoke, "lens": lens})]):
            rows.append({**r, "part": "tp", "tp": n})
    return rows


def start(shape: str) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory(prefix="jdet-user-bench-") as cache:
        env = {**os.environ, "JDET_CACHE_DIR": cache, "JDET_WARMUP": "1"}
        for which in ("cold", "warm"):
            cmd = [sys.executable, "-m", "benchmarks.start_bench", "--child", "start",
                   "--shape", shape, "--max-len", "8192", "--step-programs", "auto"]  # fmt: skip
            rows.append({**_child_rows(cmd, {}, env)[-1], "cache": which})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def torch_anchor(shape: str, out: Path) -> list[dict]:
    rows = []
    for ctx in (1024, 8192):
        rows += _child_rows([sys.executable, "-m", "benchmarks.torch_decode", "--shape", shape,
                             "--ctx", str(ctx), "--modes", "compile", "--out", str(out)],
                            {"ctx": ctx})  # fmt: skip
    return rows


def _sdpa_child(shape: str, lens: list[int]) -> None:
    """transformers with SDPA, time to first token at each length, in this (fresh) process."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from benchmarks.decode_bench import SHAPES

    raw = {k: v for k, v in SHAPES[shape].items() if k not in ("model_type", "architectures")}
    cfg = AutoConfig.for_model(SHAPES[shape]["model_type"], **raw,
                               max_position_embeddings=max(lens) + 64)  # fmt: skip
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):  # random weights drawn where they run
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
    m.eval()
    for n in lens:
        times = []
        with torch.no_grad():
            for _ in range(3):  # the first compiles nothing but warms the allocator and kernels
                ids = torch.randint(1, cfg.vocab_size, (1, n), device=dev)
                t0 = time.perf_counter()
                int(m(ids, logits_to_keep=1).logits[0, -1].argmax())  # the token reaches the host
                times.append(time.perf_counter() - t0)
        row = {"part": "sdpa", "prompt": n, "ttft_ms": min(times[1:]) * 1e3, "device": dev,
               "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
        print(json.dumps(row), flush=True)


def sdpa_anchor(shape: str, smoke: bool) -> list[dict]:
    lens = SMOKE_TTFT_LENS if smoke else TTFT_LENS
    cmd = [sys.executable, "-m", "benchmarks.user_bench", "--sdpa-child", "--shape", shape,
           "--lens", ",".join(map(str, lens))]  # fmt: skip
    return _child_rows(cmd, {})


def environment() -> dict:
    import jax

    import jdet

    git = ["git", "-C", str(Path(__file__).resolve().parent)]
    try:  # "+changes": the working tree differs from the commit
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()  # fmt: skip
        dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()  # fmt: skip
        commit = head + ("+changes" if dirty and head else "")
    except OSError:  # no git: a copy of the tree
        commit = ""
    commit = os.environ.get("JDET_COMMIT") or commit or "unknown"
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "jdet": jdet.__version__,
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [d.device_kind for d in jax.devices()], "commit": commit}  # fmt: skip


def ratios(result: dict) -> None:
    """Each decode row's ratio to compiled PyTorch's pipelined step at its context; each ttft
    row's to SDPA at its prompt length; each tp row's to TP 1; each offline row's output tok/s
    to that of "none" (a throughput ratio: above 1 is faster)."""
    bar = {r["ctx"]: r.get("pipelined_step_s") for r in result.get("torch", []) if "ctx" in r}
    for r in result.get("decode", []):
        if bar.get(r.get("ctx")):
            r["vs_torch_compile"] = r["decode_ms"] / 1e3 / bar[r["ctx"]]
    one = {(r.get("ctx"), r.get("prompt")): r for r in result.get("tp", []) if r.get("tp") == 1}
    for r in result.get("tp", []):
        base = one.get((r.get("ctx"), r.get("prompt")), {})
        for key in ("decode_ms", "ttft_ms"):
            if key in r and base.get(key):
                r["vs_tp1"] = r[key] / base[key]
    sdpa = {r["prompt"]: r.get("ttft_ms") for r in result.get("sdpa", []) if "prompt" in r}
    for r in result.get("ttft", []):
        if sdpa.get(r.get("prompt")):
            r["vs_sdpa"] = r["ttft_ms"] / sdpa[r["prompt"]]
    none = [r for r in result.get("offline", []) if r.get("invariance") == "none"]
    for r in result.get("offline", []):
        if none and none[0].get("output_tok_per_s") and r.get("output_tok_per_s"):
            r["vs_none"] = r["output_tok_per_s"] / none[0]["output_tok_per_s"]


PARTS = ("start", "decode", "ttft", "sdpa", "torch", "tp", "offline", "itl")
SMOKE_PARTS = ("start", "decode", "ttft", "sdpa")  # the record notebooks/06 reads in CI


def run(
    out_dir: str = "out", shape: str = "llama3-8b", smoke: bool = False,
    only: tuple[str, ...] = PARTS, shard: tuple[int, int] = (0, 1),
) -> dict:  # fmt: skip
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result: dict = {"shape": shape, "env": environment()}

    def save() -> None:  # after every part: a run cut short keeps what it measured
        (out / "user_bench.json").write_text(json.dumps(result, indent=1, default=str))

    parts = [
        ("start", lambda: start(shape)),
        ("decode", lambda: decode(shape, smoke, shard)),
        ("ttft", lambda: ttft(shape, smoke)),
        ("sdpa", lambda: sdpa_anchor(shape, smoke)),
        ("tp", lambda: tp(shape, smoke)),
        ("offline", lambda: offline(shape, smoke)),
        ("itl", lambda: itl(shape, smoke)),
    ]
    if not smoke:  # the GPU-only anchor
        parts.append(("torch", lambda: torch_anchor(shape, out)))
    for name, fn in [(n, f) for n, f in parts if n in only]:
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001 - record why a part is missing, run the rest
            result[name] = [{"error": f"{type(e).__name__}: {e}"[:2000]}]
        ratios(result)
        save()
    return result


def joined(records: list[dict], names: list[str] | None = None) -> dict:
    """One record from several runs' (`--parts` halves, the sweep's `--shard` runs on several
    GPUs of one machine): each part's rows joined in the order given, the first run's shape and
    env kept, each part's trees in `trees` where they differ, the ratios taken again across
    them. `names` (paths) name a record of another shape in the error."""
    names = names or [f"record {i}" for i in range(len(records))]
    result: dict = {"shape": records[0].get("shape"), "env": records[0].get("env", {})}
    for rec, name in zip(records, names, strict=True):
        if rec.get("shape") != result["shape"]:
            raise ValueError(f"{name} measured the {rec.get('shape')} shape, {names[0]} the "
                             f"{result['shape']} shape: join runs of one shape")  # fmt: skip
    trees = {}
    for part in PARTS:
        rows = [r for rec in records for r in rec.get(part, [])]
        if rows:
            result[part] = rows
            got = [rec.get("trees", {}).get(part) or rec.get("env", {}).get("commit", "?")
                   for rec in records if rec.get(part)]  # fmt: skip
            trees[part] = " + ".join(dict.fromkeys(got))
    if len(set(trees.values())) > 1:  # the tree of each part, where the runs differ
        result["trees"] = trees
    ratios(result)
    return result


def merge(paths: list[str], out_dir: str) -> dict:
    """`joined` of these runs' user_bench.json, written to out_dir/user_bench.json."""
    result = joined([json.loads(Path(p).read_text()) for p in paths], paths)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "user_bench.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--smoke", action="store_true", help="tiny shape, a few tokens (CPU check)")
    ap.add_argument("--parts", help="comma-separated subset of " + ",".join(PARTS)
                    + " (default: all; with --smoke " + ",".join(SMOKE_PARTS) + ")")  # fmt: skip
    ap.add_argument("--shard", default="0/1",
                    help="I/N: only every N-th setting of the decode sweep from the I-th")
    ap.add_argument("--merge", nargs="+", metavar="JSON",
                    help="join these runs' user_bench.json into OUT/user_bench.json, run nothing")
    ap.add_argument("--decode-child", help=argparse.SUPPRESS)
    ap.add_argument("--ttft-child", help=argparse.SUPPRESS)
    ap.add_argument("--offline-child", help=argparse.SUPPRESS)
    ap.add_argument("--itl-child", help=argparse.SUPPRESS)
    ap.add_argument("--sdpa-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lens", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.decode_child:
        c = json.loads(a.decode_child)
        _decode_child(a.shape, c["kw"], tuple(c["ctxs"]), c["smoke"])
        return 0
    if a.ttft_child:
        c = json.loads(a.ttft_child)
        _ttft_child(a.shape, c["kw"], c["smoke"], tuple(c.get("lens", ())))
        return 0
    for child, fn in ((a.offline_child, _offline_child), (a.itl_child, _itl_child)):
        if child:
            c = json.loads(child)
            fn(a.shape, c["kw"], c["smoke"])
            return 0
    if a.sdpa_child:
        _sdpa_child(a.shape, [int(n) for n in a.lens.split(",")])
        return 0
    if a.merge:
        merge(a.merge, a.out)
        return 0
    parts = tuple(a.parts.split(",")) if a.parts else SMOKE_PARTS if a.smoke else PARTS
    if unknown := set(parts) - set(PARTS):
        ap.error(f"unknown --parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    i, n = (int(v) for v in a.shard.split("/"))
    run(a.out, "tiny" if a.smoke else a.shape, a.smoke, parts, (i, n))
    return 0


if __name__ == "__main__":
    sys.exit(main())
