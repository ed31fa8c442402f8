"""`jdet generate | serve` (also `python -m jdet ...`). Benchmarks live outside the library:
`python -m benchmarks.serve_bench` from a checkout."""

from __future__ import annotations

import argparse
import sys


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    p.add_argument("--invariance", default="tp", choices=["tp", "batch", "none"])
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument(
        "--compile-cache-dir",
        default=None,
        help="persistent XLA compilation cache (default: $JDET_CACHE_DIR or ~/.cache/jdet/xla)",
    )
    p.add_argument("--no-compile-cache", action="store_true", help="no persistent cache")


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(
        tp=a.tp,
        invariance=a.invariance,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        page_size=a.page_size,
        num_pages=a.num_pages,
        enable_prefix_caching=not a.no_prefix_caching,
        compile_cache=compile_cache_setting(a),
    )


def compile_cache_setting(a: argparse.Namespace) -> bool | str:
    if a.no_compile_cache and a.compile_cache_dir:
        raise ValueError("give --compile-cache-dir or --no-compile-cache, not both")
    return False if a.no_compile_cache else (a.compile_cache_dir or True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jdet", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation, streamed to stdout")
    g.add_argument("prompt")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=0)
    _engine_args(g)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_dir", nargs="?", default=None)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key", default=None, help="require this bearer key (default: $JDET_API_KEY, "
        "which unlike a flag is not visible in ps)",
    )
    s.add_argument("--public-metrics", action="store_true", help="/metrics without the key")
    s.add_argument("--max-body-bytes", type=int, default=4 << 20, help="request body limit")
    s.add_argument(
        "--chat-template", default=None, help="Jinja chat template (a file or the text) "
        "replacing the tokenizer's, for /v1/chat/completions",
    )
    _engine_args(s)
    a = ap.parse_args(argv)

    try:
        if a.cmd == "generate":
            return _generate(a)
        if a.cmd == "serve":
            from serving.server import serve

            serve(
                a.model_dir or a.model,
                host=a.host,
                port=a.port,
                api_key=a.api_key,
                public_metrics=a.public_metrics,
                max_body_bytes=a.max_body_bytes,
                chat_template=a.chat_template,
                dtype=a.dtype,
                **_engine_kwargs(a),
            )
            return 0
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"jdet: error: {e}", file=sys.stderr)
        return 2
    return 1


def _generate(a: argparse.Namespace) -> int:
    import jdet

    # One prompt: compile only the shapes it meets (two or three) instead of warming the whole
    # shape set (12 on the CPU defaults, minutes there); `jdet serve` and `jdet.LLM` still warm up.
    llm = jdet.LLM(jdet.load(a.model, dtype=a.dtype), warmup=False, **_engine_kwargs(a))
    sp = jdet.SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        max_tokens=a.max_tokens,
        seed=a.seed,
    )
    print(a.prompt, end="", flush=True)
    for delta in llm.stream(a.prompt, sp):
        print(delta, end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
