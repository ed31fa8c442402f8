"""What structured output and the logits transforms cost; writes `mask_bench.json`.

1. Host: llguidance's next-token bitmask, microseconds per row per token, for a set of JSON
   schemas, a regex and a choice, over the tokens of a constrained generation (a greedy walk:
   the first allowed token each step). The engine fills one such row per constrained sequence
   per step while the previous step runs on the device.
2. Device: the sampler (`jdet.sampling.sample`) at `--batch` rows of a `--vocab` vocabulary
   (128256: the Llama-3-8B shape) with (a) no LogitsInputs, (b) neutral LogitsInputs (what every
   step of an engine passes), (c) a random bitmask on every row, (d) bitmask + logit bias +
   penalties on every row. The overhead is (c) - (a) and (d) - (a); compare it with the decode
   step time at that batch (BENCHMARKS.md) for the issue-19 target (mask overhead <= 10 % of the
   8B step at batch 32). (c) and (d) include the host -> device transfer of their inputs (numpy,
   as the engine sends them each step); (b) is placed on the device once, as the engine caches it.

    PYTHONPATH=. python -m benchmarks.mask_bench --out out [--batch 32 --vocab 128256]
    [--tokenizer HF_DIR]   (default: the embedded model's tokenizer, V = 8192)
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import numpy as np

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
     "age": {"type": "integer"}}, "required": ["name", "age"]},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer"},
     "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}}}}, "maxItems": 4},
    {"type": "object", "properties": {"kind": {"enum": ["a", "b", "c"]},
     "value": {"anyOf": [{"type": "number"}, {"type": "string", "maxLength": 10}]}}},
]  # fmt: skip


def host_masks(tokenizer_dir: str | None, steps: int) -> list[dict]:
    import jdet
    from serving.constrained.structured import Structured

    if tokenizer_dir:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
        V, eos = len(tok), (int(tok.eos_token_id),)
    else:
        m = jdet.load()
        tok, V, eos = m.tokenizer, m.cfg.vocab_size, tuple(m.cfg.eos_token_ids)
    st = Structured(tok, V, eos)
    t0 = time.perf_counter()
    _ = st.info
    rows = [{"what": "tokenizer setup", "vocab": V, "seconds": time.perf_counter() - t0}]
    cases = [("json_schema", json.dumps(s)) for s in SCHEMAS]
    cases += [("regex", r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"), ("choice", '["yes", "no", "maybe"]')]
    W = -(-V // 32)
    for kind, spec in cases:
        t0 = time.perf_counter()
        guide = st.guide(((kind, spec),))
        compile_s = time.perf_counter() - t0
        words = np.zeros(W, np.int32)
        times, out = [], []
        for _ in range(steps):
            guide.sync(out)
            t0 = time.perf_counter()
            guide.fill(words)
            times.append(time.perf_counter() - t0)
            bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:V]
            allowed = np.flatnonzero(bits)
            if len(allowed) == 0 or set(allowed.tolist()) <= set(eos):
                break
            out.append(int(next(t for t in allowed if t not in eos)))
        rows.append({"what": f"mask {kind}", "vocab": V, "compile_s": compile_s,
                     "tokens": len(times), "median_us": float(np.median(times) * 1e6),
                     "p90_us": float(np.percentile(times, 90) * 1e6)})  # fmt: skip
    return rows


def device_sampler(batch: int, vocab: int) -> list[dict]:
    import jax

    from benchmarks.timing import median_seconds
    from jdet.ops import Ops
    from jdet.sampling import MAX_LOGIT_BIAS, LogitsInputs, SamplingInputs, sample

    rng = np.random.default_rng(0)
    logits = jax.device_put(rng.normal(0, 3, (batch, vocab)).astype(np.float32))
    U, W = 1024, -(-vocab // 32)

    def inputs(kind: str) -> SamplingInputs:
        z = np.zeros(batch, np.float32)
        x = None
        if kind != "none":
            x = dict(min_p=z, presence=z, frequency=z, repetition=z + 1,
                     pen_ids=np.full((batch, U), -1, np.int32),
                     pen_counts=np.zeros((batch, U), np.int32),
                     bias_ids=np.full((batch, MAX_LOGIT_BIAS), -1, np.int32),
                     bias_vals=np.zeros((batch, MAX_LOGIT_BIAS), np.float32),
                     mask=np.full((batch, W), -1, np.int32))  # fmt: skip
            if kind in ("mask", "all"):
                x["mask"] = rng.integers(-(2**31), 2**31 - 1, (batch, W), dtype=np.int32)
            if kind == "all":
                x["bias_ids"][:, :50] = rng.choice(vocab, (batch, 50))
                x["bias_vals"][:, :50] = 1.5
                x["pen_ids"][:, :300] = np.sort(rng.choice(vocab, (batch, 300)), axis=1)
                x["pen_counts"][:, :300] = 1
                x["presence"], x["repetition"] = z + 0.5, z + 1.1
            x = LogitsInputs(**x)
        return SamplingInputs(temperature=z + 0.8, top_k=np.zeros(batch, np.int32),
                              top_p=z + 1, seed=np.arange(batch, dtype=np.uint32),
                              position=np.full(batch, 100, np.int32), logits=x)  # fmt: skip

    ops = Ops("tp")
    fn = jax.jit(lambda lg, inp: sample(lg, inp, ops))
    rows = []
    for kind in ("none", "neutral", "mask", "all"):
        inp = inputs(kind)
        if kind == "neutral":  # the engine caches neutral inputs on the device per shape
            inp = jax.device_put(inp)
        s = median_seconds(fn, logits, inp, iters=20, reps=5)
        rows.append({"what": f"sampler {kind}", "batch": batch, "vocab": vocab, "ms": s * 1e3})
    base = rows[0]["ms"]
    for r in rows[1:]:
        r["overhead_ms"] = r["ms"] - base
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="out")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--tokenizer", default=None)
    a = p.parse_args(argv)
    import jax

    res: dict[str, Any] = {"device": str(jax.devices()[0].device_kind), "rows": []}
    res["rows"] += host_masks(a.tokenizer, a.steps)
    res["rows"] += device_sampler(a.batch, a.vocab)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "mask_bench.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    for r in res["rows"]:
        print(r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
