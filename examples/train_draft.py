"""Train a small draft model for speculative decoding of jdet's embedded model (issue 13).

Same corpus, tokenizer and training code as the embedded model (examples/make_corpus.py,
examples/train_tiny.py), a much smaller Qwen3: D = 64, 2 layers, tied embeddings (~0.6 M
parameters, 1.3 MB in bf16), trained on a CPU within a time limit. The shipped draft
(jdet/default_model/draft, no tokenizer files: it shares the embedded model's) was trained on this
project's 2-core CPU in 238 s (200 steps of 16 x 256 tokens, held-out loss 5.24 nats vs the
embedded model's 3.54); `SpeculativeConfig(method="draft", draft_model="default")` uses it.

Usage:
  python examples/make_corpus.py --out build/tiny --model-dir build/tiny/tok   # same tokenizer
  python examples/train_draft.py --data build/tiny --out jdet/default_model/draft
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny  # noqa: E402

DRAFT = train_tiny.ModelConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, intermediate_size=192
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", type=Path, default=Path("build/tiny"))
    ap.add_argument("--out", type=Path, default=Path("jdet/default_model/draft"))
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--time-limit", type=float, default=240.0)
    a = ap.parse_args()
    tc = train_tiny.TrainConfig(
        seq_len=256, batch_size=16, steps=a.steps, warmup_steps=20, lr=3e-3, dropout=0.0,
        eval_every=25, time_limit_s=a.time_limit,
    )  # fmt: skip
    a.out.mkdir(parents=True, exist_ok=True)
    summary = train_tiny.train(a.data, a.out, DRAFT, tc)
    print(json.dumps({k: v for k, v in summary.items() if k != "log"}, indent=2))


if __name__ == "__main__":
    main()
