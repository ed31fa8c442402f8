"""Warm-up: compile (or load from the caches) the engine's step and score for every shape of its
bounded set before it serves, each on a junk batch that writes no K/V (so it is safe at any time,
even beside running sequences). Split out of serving/engine/model_runner.py; `ModelRunner.warmup`
and `ModelRunner.warmup_batch` call these."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from jdet import exec_cache, exec_key
from jdet.batch import StepBatch
from jdet.plan import backend
from jdet.step import SamplingInputs
from serving.engine import sampler_variants


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
        logits=runner.neutral_logits(variant, Sp, Pp),
        **variant.fields(),
    )
    return StepBatch(tok, pos, slot, qs, cl, pt, rows), sampling

def warmup_workers() -> int:
    """Threads that compile warm-up shapes at once: on a GPU up to 8 (a shape's compile is
    mostly XLA's, which releases the GIL; its tracing and lowering do not, so more threads than
    that gain nothing; BENCHMARKS.md, Defaults and memory, times threaded against serial
    warm-up); on a CPU one, since the
    compiles would take the cores the tests and the host's own work need."""
    if backend().cpu:
        return 1
    return max(1, min(8, os.cpu_count() or 1))


def warmup(
    runner: Any, kind: str = "step", progress: bool = True, should_stop: Any = None
) -> float:
    """Compile (or load from the persistent cache) `kind` ("step" or "score") for every shape
    of the set — a step for each sampler variant a step may run (serving/engine/sampler_variants.py)
    — then run each once on a junk batch that writes nothing: safe at any time. The compiles
    run in `warmup_workers()` threads, the runs one after another (they share the device and
    the donated cache). Shows a tqdm bar naming shape k of n and the seconds its compile took.
    Returns the seconds."""
    if kind == "step":  # rows prepared before warm-up may name a variant it compiles afresh
        runner.ahead_cache = None
    variants = runner.variants if kind == "step" else (sampler_variants.FULL,)
    # Every shape in the first variant before any in the next: a step of two programs
    # (host_inputs.py `SplitStep`) shares the forward between variants, so the threads compile
    # distinct forwards first and the later variants find theirs made (or wait for it). Largest
    # shapes first: the longest compiles start first, so the last to finish is a short one.
    shapes = [(s, v) for v in variants for s in reversed(runner.shapes.all(kind))]
    fn = runner.score_step() if kind == "score" else runner.step_fn
    inputs = []
    for shape, variant in shapes:
        batch, extra = runner.warmup_batch(shape, kind, variant)  # (score: no variant)
        inputs.append((runner.place_tokens(batch) if kind == "step" else batch, extra))
    bar = None
    if progress:
        bar = tqdm(total=len(shapes), desc=f"jdet: compiling {kind} shapes", unit="shape")
    t_all = time.perf_counter()

    def make(k: int) -> None:
        if should_stop is not None and should_stop():
            return
        t0 = time.perf_counter()
        exec_cache.prepare(fn, runner.params, runner.kv, *inputs[k])  # load, or compile
        if bar is not None:
            (T, S, P), variant = shapes[k]
            name = f" {variant.name} sampler" if kind == "step" else ""
            n = len(shapes) // len(variants)
            bar.set_postfix_str(f"shape {k % n + 1}/{n} "
                                f"T={T} S={S} Pmax={P}{name}: {time.perf_counter() - t0:.1f}s")
            bar.update(1)

    try:
        workers = warmup_workers()
        with exec_key.held_environment():  # one key environment for every entry it makes
            if workers > 1 and len(shapes) > 1:
                with ThreadPoolExecutor(workers, thread_name_prefix="jdet-warmup") as pool:
                    for f in [pool.submit(make, k) for k in range(len(shapes))]:
                        f.result()
            else:
                for k in range(len(shapes)):
                    make(k)
        for k, (shape, _) in enumerate(shapes):  # each executable once, on the device
            if should_stop is not None and should_stop():
                break
            batch, extra = inputs[k]
            if kind == "step":
                out = runner.dispatch(batch, extra)
            else:
                runner.kv, out = fn(runner.params, runner.kv, batch, extra)
            jax.block_until_ready(out)
            if kind == "step":
                runner.shapes_seen.add(shape)
                T, S, _ = shape
                if S < T:  # an ahead step's sampled tokens padded to T on the device
                    jax.block_until_ready(runner.pad_tokens(S, T)(out.tokens))
    finally:
        if bar is not None:
            bar.close()
    return time.perf_counter() - t_all
