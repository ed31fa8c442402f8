"""Speculative decoding (serving/speculative/speculator.py): acceptance, tokens per target step,
speed.

CPU part (default; the embedded model, bf16, "tp" mode): held-out prompts of its corpus, greedy,
batched; for each draft kind (n-gram, self-speculative with L of its 5 layers, the trained draft
shipped in jdet/default_model/draft or `--draft DIR`) and K = 1..8: the per-position acceptance
alpha (accepted / reached drafts), the mean tokens a verify emits beside the seed's formula
(1 - alpha^(K+1)) / (1 - alpha), tokens per target step over the whole decode (plain decodes
included: n-gram finds no draft at times), and wall tokens/s against the plain engine in the
same run. Every run's tokens and log-probs are asserted bitwise equal to the plain engine's.
Each row is run with adaptive K off (`--min-alphas 0`: every decode drafts, as before) and on
(0.3, the default: a request whose acceptance falls below it decodes without drafts).

`--gpu` part (random bf16 weights of the Qwen3-8B shape, one GPU, like decode_bench.py): the device
time of one verify step of K + 1 tokens (K + 1 sampled rows) against one decode step, batch 1,
context 1024, K = 1..8; then end-to-end batch-1 generation through `Engine.step` on a copy-heavy
prompt (a random token block repeated; `--prompt heldout`: a held-out text of the embedded model's
corpus, little to copy), K = 4, several engines side by side in the same run sharing one placed copy
of the weights, `--reps` rounds in rotated order, median reported with the spread
(benchmarks/spec_e2e.py): n-gram drafts with adaptive K (the default), n-gram always drafting
(`min_alpha=0`), plain with async dispatch (the GPU default), plain synchronous (`--engines`), and
`--replay-alphas`: a benchmark-only replay draft (tests/serving/speculative/replay_draft.py) that
proposes the target's own recorded output, each position right with probability alpha, so the
speedup at alpha = 0.5..0.9 is measured on random weights, where real drafts get alpha ~ 0. Per
engine: decode tok/s (from the first output token on) and whole-request tok/s, the measured alpha
and tokens per verify beside the seed's formula, tokens per decode step, steps ahead, device->host
fetches and compiles per run; every run's bits asserted equal to the plain run's. The end-to-end
part also runs on a CPU (`--gpu --shape tiny|embedded --no-verify-timing`: counts, not speeds).

    PYTHONPATH=. python -m benchmarks.spec_bench [--ks 1,2,4,8] [--out OUT]
    PYTHONPATH=. python -m benchmarks.spec_bench --gpu --out $OUT      # < 5 minutes on an H100
    PYTHONPATH=. python -m benchmarks.spec_bench --gpu --ks 4 --reps 3 \
        --engines adaptive,plain_async --replay-alphas 0.7,0.9 --out $OUT   # issue 13's target
    PYTHONPATH=. python -m benchmarks.spec_bench --gpu --shape embedded [--prompt heldout]
Writes `spec_bench.json` (after every row) and prints a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.spec_e2e import BASE_ENGINES, e2e, shared_weights, summarize


def formula(alpha: float, k: int) -> float:
    """Expected tokens per verify of k drafts, each accepted with probability alpha."""
    return float(k + 1) if alpha >= 1.0 else (1 - alpha ** (k + 1)) / (1 - alpha)


def prompts_of_corpus(tokenizer: Any, n: int) -> list[list[int]]:
    """The user turn of the first n held-out documents, up to the assistant's turn."""
    d = Path(__file__).resolve().parents[1] / "jdet" / "default_model" / "heldout_sample.json"
    docs = json.loads(d.read_text())["documents"]
    out = []
    for doc in docs[:n]:
        cut = doc.find("<|im_start|>assistant\n")
        text = doc[: cut + len("<|im_start|>assistant\n")] if cut >= 0 else doc[:200]
        out.append(list(tokenizer(text, add_special_tokens=False)["input_ids"]))
    return out


def generate(eng: Any, prompts: list[list[int]], params: dict) -> tuple[list, float]:
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    t0 = time.perf_counter()
    outs = eng.run()
    return outs, time.perf_counter() - t0


def bits(outs: list) -> list:
    return [(o.outputs[0].token_ids, np.asarray(o.outputs[0].logprobs).tobytes()) for o in outs]


def cpu_part(a: argparse.Namespace, res: dict, save: Any) -> None:
    import jdet
    from serving.engine.engine import Engine

    model = jdet.load()
    budget = 64
    kw = dict(invariance="tp", max_num_batched_tokens=budget, max_num_seqs=budget,
              max_model_len=512, page_size=16, num_pages=256, min_tokens_bucket=16,
              min_seqs_bucket=1, min_pages_bucket=32)  # fmt: skip  (S = T for every K)
    prompts = prompts_of_corpus(model.tokenizer, a.prompts)
    params = dict(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    generate(Engine(model, **kw), prompts[:2], params)  # compile the shapes met
    plain, t_plain = generate(Engine(model, **kw), prompts, params)
    n_out = sum(len(o.outputs[0].token_ids) for o in plain)
    res["cpu_plain"] = {"tokens": n_out, "seconds": t_plain, "tok_per_s": n_out / t_plain}
    kinds = [("ngram", {}), ("self", {"draft_layers": a.self_layers}),
             ("draft", {"draft_model": a.draft})]  # fmt: skip
    runs = [(kind, extra, k, m) for kind, extra in kinds if kind in a.kinds
            for k in a.ks for m in a.min_alphas]  # fmt: skip
    for kind, extra, k, min_alpha in runs:
        spec = jdet.SpeculativeConfig(method=kind, num_tokens=k, min_alpha=min_alpha, **extra)
        eng = Engine(model, **kw, speculative=spec)
        generate(eng, prompts[:1], dict(params, max_tokens=4))  # compile the draft's shapes
        eng.speculator.reset_stats()
        outs, dt = generate(eng, prompts, params)
        assert bits(outs) == bits(plain), f"{kind} K={k}: bits differ from the plain engine"
        st = eng.speculator.stats()
        acc = st["accepted_tokens"]
        row = dict(kind=kind, K=k, min_alpha=min_alpha, **st, formula=formula(st["alpha"], k),
                   tokens_per_step=n_out / max(1, n_out - acc), seconds=dt,
                   tok_per_s=n_out / dt, speedup=t_plain / dt, bits_equal=True)  # fmt: skip
        res["cpu"].append(row)
        print(json.dumps(row), flush=True)
        save()


# ---------------------------------------------------------------------- GPU part
def verify_inputs(cfg: Any, ctx: int, k: int, pmax: int) -> tuple[Any, Any]:
    """One sequence computing k + 1 tokens at positions ctx-1..ctx-1+k, k + 1 sampled rows
    (k = 0: a decode step), padded to S = T = 16 rows as the engine pads them (k <= 15)."""
    from jdet.batch import StepBatch
    from jdet.step import SamplingInputs

    page = 16
    n = k + 1
    T = S = 16
    pos = np.zeros(T, np.int32)
    pos[:n] = np.arange(ctx - 1, ctx - 1 + n)
    pt = np.zeros((S, pmax), np.int32)
    pt[0] = np.minimum(np.arange(pmax), -(-(ctx + k) // page) - 1)
    slot = np.full(T, -1, np.int32)
    slot[:n] = pt[0, pos[:n] // page] * page + pos[:n] % page
    qs = np.full(S + 1, n, np.int32)
    qs[0] = 0
    cl = np.zeros(S, np.int32)
    cl[0] = ctx + k
    rows = np.zeros(S, np.int32)
    rows[:n] = np.arange(n)
    tok = np.random.default_rng(k).integers(1, cfg.vocab_size, T).astype(np.int32)
    z = np.zeros(S, np.float32)
    spos = np.zeros(S, np.int32)
    spos[:n] = pos[:n] + 1
    si = SamplingInputs(temperature=z, top_k=np.zeros(S, np.int32), top_p=z + 1,
                        seed=np.zeros(S, np.uint32), position=spos)  # fmt: skip
    return StepBatch(tok, pos, slot, qs, cl, pt, rows), si


def time_verify(eng: Any, ctx: int, ks: list[int], res: dict, save: Any) -> None:
    """Device time of one step: a decode (K = 0) and verifies of K + 1 tokens, batch 1."""
    import jax

    from benchmarks.timing import median_seconds

    r = eng.runner

    def one(sb: Any, si: Any) -> Any:
        r.kv, out = r.step_fn(r.params, r.kv, sb, si)
        return out.tokens

    t_dec = None
    for k in [0, *ks]:
        P = r.shapes.pages[-1]
        sb, si = verify_inputs(eng.cfg, ctx, k, P)
        # placed as ModelRunner.dispatch places a step's inputs: the engine's executable
        sb = dataclasses.replace(sb, token_ids=jax.device_put(sb.token_ids, r.token_sharding))
        si = dataclasses.replace(si, logits=r.logits_rows.neutral(16, P * r.page_size))
        t = median_seconds(one, sb, si, iters=8, reps=5, warmup=2)
        t_dec = t if k == 0 else t_dec
        row = {"K": k, "step_ms": t * 1e3, "vs_decode": t / t_dec}
        res["gpu_verify"].append(row)
        print(json.dumps(row), flush=True)
        save()


def copy_text() -> str:
    """A held-out docstring of the embedded model's corpus followed by a blank line."""
    from jdet.loader import DEFAULT_MODEL_DIR

    docs = json.loads((DEFAULT_MODEL_DIR / "heldout_sample.json").read_text())["documents"]
    return next(d for d in docs if len(d) > 300)[:800].strip() + "\n\n"


def gpu_part(a: argparse.Namespace, res: dict, save: Any) -> None:
    """One placed copy of the weights for every engine (`shared_weights`)."""
    with shared_weights() as placed:
        gpu_engines(a, res, save)
        res["weight_copies_placed"] = len(placed)


def gpu_engines(a: argparse.Namespace, res: dict, save: Any) -> None:
    """Every engine has the same shape set (S = T: max_num_seqs >= the token budget), so they
    share the compiled steps: 3 shapes in all."""
    import gc

    import jax

    import jdet
    from benchmarks.decode_bench import random_model
    from serving.engine.engine import Engine

    res["env"] = {"jax": jax.__version__, "device": jax.devices()[0].device_kind}
    ctx, max_len = 1024, 2048
    if a.shape == "embedded":  # trained weights: the copy-heavy prompt is actually copied
        ctx, max_len = 384, 1024
        model = jdet.load()
    else:
        model = random_model(a.shape, max_len)
    kw = dict(invariance="tp", max_num_batched_tokens=64, max_num_seqs=64, max_model_len=max_len,
              page_size=16, num_pages=160, min_tokens_bucket=16, min_seqs_bucket=1,
              min_pages_bucket=max_len // 16, enable_prefix_caching=False)  # fmt: skip
    spec = jdet.SpeculativeConfig(method="ngram", num_tokens=a.e2e_k)
    eng = Engine(model, **kw, speculative=spec)
    if not a.no_verify_timing:
        time_verify(eng, ctx, a.ks, res, save)
    # end to end, batch 1: a copy-heavy prompt (a 64-token block repeated), greedy
    block = np.random.default_rng(0).integers(1, model.cfg.vocab_size, 64).tolist()
    if a.shape == "embedded":  # a docstring repeated: "repeat this text" in its own words
        block = model.tokenizer(copy_text())["input_ids"]
    if a.prompt == "heldout":  # natural text, little to copy (embedded: its held-out documents)
        if a.shape != "embedded":
            raise ValueError("--prompt heldout needs --shape embedded (a tokenizer and a corpus)")
        block = [t for p in prompts_of_corpus(model.tokenizer, 64) for t in p]
    prompt = (block * (ctx // len(block) + 1))[: ctx - 1]
    params = dict(temperature=0.0, max_tokens=a.gpu_tokens, ignore_eos=True)
    del eng
    gc.collect()
    if a.shape != "embedded" and a.gpu_tokens + ctx > max_len:
        raise ValueError(f"--gpu-tokens {a.gpu_tokens} + the {ctx}-token prompt > {max_len}")
    names = a.engines + [f"replay_{x:g}" for x in a.replay_alphas]
    res["gpu_e2e_runs"] = e2e(model, kw, spec, prompt, params, a.reps, names, bits)
    save()
    by = summarize(res["gpu_e2e_runs"], names)
    for r in by.values():  # the seed's formula at the measured alpha (speculative engines)
        if "alpha" in r:
            r["formula"] = formula(r["alpha"], r["K"])
    res["gpu_e2e"] = list(by.values())
    if "plain_async" in by:  # decode tok/s of each engine / plain async's, same run
        base = by["plain_async"]["decode_tok_per_s"]
        res["gpu_e2e_vs_plain_async"] = {n: r["decode_tok_per_s"] / base for n, r in by.items()}
    res["gpu_bits_equal"] = True
    save()


def table(res: dict) -> str:
    lines = []
    if res.get("cpu_plain"):
        p = res["cpu_plain"]
        lines.append(f"CPU embedded model, plain: {p['tokens']} tokens, {p['tok_per_s']:.1f} tok/s")
        lines.append("kind K min_alpha | alpha accept-rate | tokens/verify formula | "
                     "tokens/step | tok/s speedup bits")  # fmt: skip
        for r in res["cpu"]:
            lines.append(
                f"{r['kind']} {r['K']} {r.get('min_alpha', 0.0)} | {r['alpha']:.3f} "
                f"{r['acceptance_rate']:.3f} | "
                f"{r['mean_accepted_length']:.2f} {r['formula']:.2f} | {r['tokens_per_step']:.2f}"
                f" | {r['tok_per_s']:.1f} {r['speedup']:.2f}x {'=' if r['bits_equal'] else '!='}"
            )
    for r in res["gpu_verify"]:
        lines.append(f"GPU verify K={r['K']}: {r['step_ms']:.2f} ms = {r['vs_decode']:.2f}x decode")
    vs = res.get("gpu_e2e_vs_plain_async", {})
    for r in res["gpu_e2e"]:
        extra = ""
        if "alpha" in r:
            extra = (f"; alpha {r['alpha']:.3f}, tokens/verify {r['mean_accepted_length']:.2f}"
                     f" (formula {r['formula']:.2f})")  # fmt: skip
        if r["run"] in vs:
            extra += f"; {vs[r['run']]:.2f}x plain async"
        lines.append(
            f"e2e {r['run']}: decode {r['decode_tok_per_s']:.1f} tok/s "
            f"({r['decode_tok_per_s_min']:.1f}-{r['decode_tok_per_s_max']:.1f} over {r['reps']}"
            f" reps), whole request {r['tok_per_s_median']:.1f}; {r['decode_steps']} decode steps"
            f" ({r['tokens_per_decode_step']:.2f} tokens each; {r['steps_ahead']} ahead),"
            f" {r['fetches']} fetches, {r['compiles']} compiles{extra}"
        )
    if res.get("gpu_bits_equal"):
        lines.append("e2e: every run's tokens and log-probs equal the plain run's")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--ks", default="1,2,3,4,5,6,7,8")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--self-layers", type=int, default=2, help="L of the self-speculative draft")
    p.add_argument("--draft", default="default",
                   help="draft model directory of method 'draft' (default: the shipped draft)")
    p.add_argument("--kinds", default="ngram,self,draft", help="draft kinds of the CPU part")
    p.add_argument("--min-alphas", default="0,0.3",
                   help="adaptive K thresholds of the CPU part (0: off, every decode drafts)")
    p.add_argument("--prompt", default="copy", choices=("copy", "heldout"),
                   help="the GPU end-to-end prompt: copy-heavy, or held-out text (embedded)")
    p.add_argument("--gpu", action="store_true", help="the GPU part instead of the CPU part")
    p.add_argument("--shape", default="qwen3-8b")
    p.add_argument("--gpu-tokens", type=int, default=128, help="tokens generated end to end")
    p.add_argument("--e2e-k", type=int, default=4, help="K of the end-to-end n-gram run")
    p.add_argument("--reps", type=int, default=5,
                   help="end-to-end rounds (each runs every engine, order rotated)")
    p.add_argument("--engines", default=",".join(BASE_ENGINES),
                   help="end-to-end engines (benchmarks/spec_e2e.py), one plain at least")
    p.add_argument("--replay-alphas", default="",
                   help="end-to-end replay-draft engines, one per acceptance rate (e.g. 0.7,0.9):"
                   " the target's own output, each position right with this probability")
    p.add_argument("--no-verify-timing", action="store_true",
                   help="--gpu: skip the verify-step timing (e.g. the end-to-end part on a CPU)")
    a = p.parse_args(argv)
    a.ks = [int(k) for k in a.ks.split(",")]
    a.kinds = a.kinds.split(",")
    a.min_alphas = [float(m) for m in a.min_alphas.split(",")]
    a.engines = [e for e in a.engines.split(",") if e]
    a.replay_alphas = [float(x) for x in a.replay_alphas.split(",") if x]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res: dict = {"args": vars(a), "cpu": [], "gpu_verify": [], "gpu_e2e": []}

    def save() -> None:
        (out / "spec_bench.json").write_text(json.dumps(res, indent=1, default=str))

    try:
        (gpu_part if a.gpu else cpu_part)(a, res, save)
    except Exception:  # noqa: BLE001 - keep what was measured
        res["error"] = traceback.format_exc()[-3000:]
        print(res["error"], file=sys.stderr, flush=True)
    save()
    print(table(res), flush=True)
    return 1 if "error" in res else 0


if __name__ == "__main__":
    sys.exit(main())
