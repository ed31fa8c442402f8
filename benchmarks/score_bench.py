"""Throughput of `jdet.LLM.score` (teacher-forced log-probs), after warm-up.

Why: since issue 14 a score is a request kind of the engine's scheduler (serving/engine/scoring.py)
instead of a loop of its own; this measures what that costs or saves, and prints a hash of the
log-probs so two trees (e.g. `git worktree` of the commit before) can be checked for equal bits.

    python benchmarks/score_bench.py                      # embedded model, CPU or GPU
    python benchmarks/score_bench.py --model DIR --seqs 256 --len 512 --budget 2048
"""

from __future__ import annotations

import argparse
import hashlib
import random
import time

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model directory (default: the embedded one)")
    ap.add_argument("--invariance", default="tp", help="reduction plan (tp, batch, none)")
    ap.add_argument("--seqs", type=int, default=64, help="sequences per score() call")
    ap.add_argument("--len", type=int, default=120, help="tokens per sequence")
    ap.add_argument("--budget", type=int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls (best is reported)")
    a = ap.parse_args()

    import jdet

    model = jdet.load(a.model) if a.model else jdet.load()
    llm = jdet.LLM(model, invariance=a.invariance, max_num_batched_tokens=a.budget,
                   max_model_len=max(a.len, 16))  # fmt: skip
    rng = random.Random(0)
    V = model.cfg.vocab_size
    seqs = [[rng.randrange(1, V) for _ in range(a.len)] for _ in range(a.seqs)]
    llm.score(seqs[:1])  # compiles the score shapes (warm-up)
    times = []
    for _ in range(a.repeats):
        t0 = time.perf_counter()
        out = llm.score(seqs)
        times.append(time.perf_counter() - t0)
    digest = hashlib.sha256(b"".join(np.asarray(o, np.float32).tobytes() for o in out))
    best = min(times)
    rate = a.seqs * (a.len - 1) / best
    print(f"score {a.seqs} x {a.len} tokens, budget {a.budget}, {a.invariance}: best {best:.3f} s "
          f"({rate:.0f} scored tokens/s), all {[round(t, 3) for t in times]}, "
          f"log-probs sha256 {digest.hexdigest()[:16]}")  # fmt: skip


if __name__ == "__main__":
    main()
