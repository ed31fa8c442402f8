"""Warm-up: compile (or load from the caches) the engine's step and score for every shape of its
bounded set before it serves, each on a junk batch that writes no K/V (so it is safe at any time,
even beside running sequences). Split out of serving/model_runner.py; `ModelRunner.warmup` and
`ModelRunner.warmup_batch` call these."""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jdet import exec_cache
from jdet.batch import StepBatch
from jdet.step import SamplingInputs
from serving import sampler_variants


def warmup_batch(
    runner: Any, shape: tuple[int, int, int], kind: str = "step",
    variant: sampler_variants.Variant = sampler_variants.FULL,
) -> tuple[Any, Any]:  # fmt: skip
    """A junk batch of `shape` (T, S, Pmax) that writes no K/V (every slot -1), so warming
    up never touches a page the prefix cache or a running sequence holds. One sequence of
    min(T, Pmax * B) tokens; the rest is padding. For "score" the second item is the
    targets [T], for "step" the SamplingInputs [S] of the sampler `variant` (top-p on where
    the variant filters and temperature 1 where it draws, so nothing is left out)."""
    Tp, Sp, Pp = shape
    n = min(Tp, Pp * runner.page_size)
    tok = np.arange(Tp, dtype=np.int32) % runner.cfg.vocab_size
    pos = np.minimum(np.arange(Tp, dtype=np.int32), n - 1)
    slot = np.full(Tp, -1, np.int32)
    qs = np.full(Sp + 1, n, np.int32)
    qs[0] = 0
    cl = np.zeros(Sp, np.int32)
    cl[0] = n
    pt = np.tile(np.arange(Pp, dtype=np.int32), (Sp, 1))
    if kind == "score":
        rows = np.minimum(np.arange(Tp, dtype=np.int32), n - 1)
        return StepBatch(tok, pos, slot, qs, cl, pt, rows), tok.copy()
    rows = np.zeros(Sp, np.int32)
    rows[0] = n - 1
    z = np.zeros(Sp, np.float32)
    sampling = SamplingInputs(
        temperature=z + (1 if variant.draw else 0),
        top_k=np.zeros(Sp, np.int32),
        top_p=z + (0.9 if variant.filter_topk_topp else 1.0),
        seed=np.zeros(Sp, np.uint32),
        position=cl.copy(),
        logits=runner._neutral_logits(variant, Sp, Pp),
        **variant.fields(),
    )
    return StepBatch(tok, pos, slot, qs, cl, pt, rows), sampling

def warmup(
    runner: Any, kind: str = "step", progress: bool = True, should_stop: Any = None
) -> float:
    """Compile (or load from the persistent cache) `kind` ("step" or "score") for every shape
    of the set — a step for each sampler variant a step may run (serving/sampler_variants.py)
    — running each once on a junk batch that writes nothing: safe at any time. Shows a tqdm
    bar naming shape k of n and the seconds taken. Returns the seconds."""
    if kind == "step":  # from now on the steps run only the variants compiled here
        runner.variants = sampler_variants.engine_variants()  # the set now (tests may set it)
        runner._ahead_key = None  # rows prepared with a variant of an earlier set
    variants = runner.variants if kind == "step" else (sampler_variants.FULL,)
    ns = len(runner.shapes.all())
    shapes = [(s, v) for s in runner.shapes.all() for v in variants]  # executables to make
    fn = runner.score_step() if kind == "score" else runner.step_fn
    bar = None
    if progress:
        bar = tqdm(total=len(shapes), desc=f"jdet: compiling {kind} shapes", unit="shape")
    t_all = time.perf_counter()
    try:
        for k, (shape, variant) in enumerate(shapes):
            if should_stop is not None and should_stop():
                break
            t0 = time.perf_counter()
            batch, extra = runner.warmup_batch(shape, kind, variant)  # (score: no variant)
            if kind == "step":
                batch = runner.place_tokens(batch)
            exec_cache.prepare(fn, runner.params, runner.kv, batch, extra)  # load, or compile
            if kind == "step":
                out = runner.dispatch(batch, extra)
            else:
                runner.kv, out = fn(runner.params, runner.kv, batch, extra)
            jax.block_until_ready(out)
            if kind == "step":
                runner.shapes_seen.add(shape)
            if bar is not None:
                T, S, P = shape
                bar.set_postfix_str(
                    f"shape {k // len(variants) + 1}/{ns} T={T} S={S} Pmax={P}"
                    + (f" {variant.name} sampler" if kind == "step" else "")
                    + f": {time.perf_counter() - t0:.1f}s"
                )
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return time.perf_counter() - t_all
