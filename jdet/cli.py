"""`jdet generate | serve` (also `python -m jdet ...`).

The engine and server flags are generated from `jdet.settings.EngineConfig` / `ServerConfig`
(names, defaults, choices, help), so every entry point takes the same settings. Benchmarks live
outside the library: `python -m benchmarks.serve_bench` from a checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import sys

import jax

import jdet
from jdet import spec_config
from jdet.plan import backend
from jdet.settings import EngineConfig, ServerConfig, add_flags, from_args
from jdet.version import __version__
from serving.engine.shapes import default_min_tokens_bucket


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="jdet", description=__doc__.splitlines()[0])
    ap.add_argument("--version", action="version", version=f"jdet {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate a continuation, streamed to stdout")
    g.add_argument("prompt", help="the text to continue")
    g.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept (default: 1)")
    g.add_argument("--top-k", type=int, default=0, help="top tokens kept, 0: all (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (default: 0)")
    add_flags(g, EngineConfig)
    spec_config.add_flags(g)  # speculative decoding (jdet/spec_config.py)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("model_dir", nargs="?", default=None, help="model directory (or --model)")
    s.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    add_flags(s, EngineConfig)
    spec_config.add_flags(s)
    add_flags(s, ServerConfig)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        engine = from_args(EngineConfig, a)
        spec = spec_config.from_args(a)
        if a.cmd == "generate":
            rc = _generate(a, engine, spec)
            if argv is None:  # the process's own command line: nothing runs after us
                _exit_now(rc)
            return rc
        if a.cmd == "serve":
            from serving.http.launch import serve  # FastAPI is a slow import: `jdet serve` only

            kw = dataclasses.asdict(engine)
            kw["speculative"] = spec
            serve(a.model_dir or a.model, **dataclasses.asdict(from_args(ServerConfig, a)), **kw)
            return 0
    except (ValueError, FileNotFoundError, NotADirectoryError) as e:
        print(f"jdet: error: {e}", file=sys.stderr)
        return 2
    return 1


def _generate(a: argparse.Namespace, engine: EngineConfig, spec: object = None) -> int:
    # One prompt: compile only the shapes it meets (two or three) instead of warming the whole
    # shape set (12 on the CPU defaults); `jdet serve` and `jdet.LLM` still warm up.
    # Each shape met is loaded from jdet's executable cache (or compiled and written there) at its
    # first call, so a second run neither traces nor compiles (jdet/exec_cache.py). Its steps run
    # the smallest sampler variant that serves the prompt (sampler_variants.ON_DEMAND: a greedy
    # prompt's step has no draw and no logits transforms), the only one it compiles.
    # No cyclic GC until the first token: start-up allocates most of the process's objects
    # (tracing), and the collector walked them again and again, a visible share of a warm-cache
    # run's CPU (gc.callbacks; benchmarks/cpu_bench.py times the phases); the garbage cycles of
    # start-up are collected once it is back on.
    # Its steps are compiled with the engine's own XLA options: a faster-compiling option set
    # gave other log-probs (jdet/step.py, above `_parse_options`).
    # On a CPU a prompt is prefilled in chunks of the smallest token bucket (the decode step's
    # shape) unless --max-num-batched-tokens is given: one compiled step shape for the whole run
    # instead of one more per prompt-length bucket (a second compile in a run that is mostly
    # compiling: benchmarks/cpu_bench.py times its phases). Chunked prefill gives the same bits.
    engine = _generate_config(engine, spec)
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        llm = jdet.LLM(a.model, engine, warmup=False, speculative=spec)
        sp = jdet.SamplingParams(
            temperature=a.temperature,
            top_p=a.top_p,
            top_k=a.top_k,
            max_tokens=a.max_tokens,
            seed=a.seed,
        )
        print(a.prompt, end="", flush=True)
        for delta in llm.stream(a.prompt, sp):
            if gc_was_on and not gc.isenabled():
                gc.enable()
            print(delta, end="", flush=True)
        print()
    finally:
        if gc_was_on:
            gc.enable()
    return 0


def _exit_now(rc: int) -> None:
    """End the process at once, output flushed. Why: interpreter and JAX teardown (atexit:
    clearing backends and caches, freeing every module) is a noticeable share of a cold `jdet
    generate` (benchmarks/cpu_bench.py), spent after its last token. Nothing is pending: the
    caches are written when a shape compiles, and effects are awaited here first."""
    jax.effects_barrier()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`jdet generate ... | head`)
            pass
    os._exit(rc)


def _generate_config(engine: EngineConfig, spec: object) -> EngineConfig:
    """The config `jdet generate` runs: one step shape where that is safe (`_one_shape_budget`),
    each sampler variant compiled at its first step, each step shape loaded from the executable
    cache (or compiled and written there) at its first call."""
    engine = _one_shape_budget(engine, spec)
    if engine.sampler_variants == "auto":
        engine = dataclasses.replace(engine, sampler_variants="on-demand")
    return dataclasses.replace(engine, exec_cache_on_call=True)


def _one_shape_budget(engine: EngineConfig, spec: object) -> EngineConfig:
    """`engine` with the token budget of one step shape where that is safe: on a CPU, with the
    default budget and no speculative decoding (a verify step needs k + 1 tokens)."""
    default = EngineConfig().max_num_batched_tokens
    if spec is not None or engine.max_num_batched_tokens != default:
        return engine
    if not backend().cpu:
        return engine
    # min_tokens_bucket pinned too: no 1-token decode bucket (serving/engine/shapes.py
    # `single_token_bucket`), whose compile would cost the one-shot run more than it saves
    budget = engine.min_tokens_bucket or default_min_tokens_bucket()
    return dataclasses.replace(engine, max_num_batched_tokens=budget, min_tokens_bucket=budget)


if __name__ == "__main__":
    sys.exit(main())
