"""Timing shared by the benchmarks: median seconds per call of a jitted function.

Small calls are dominated by host dispatch, so the calls of a batch are queued back to back and
waited for once; the median over batches filters out the noise of a shared machine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, *args, iters: int, reps: int, warmup: int = 1,
                   keep_outputs: bool = False) -> float:  # fmt: skip
    """Median over `reps` batches of the mean time of `iters` back-to-back calls.

    `keep_outputs` holds every output of a batch alive until it is waited for (no buffer reuse
    between calls); otherwise only the last output is kept and waited on.
    """
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if keep_outputs:
            outs = [fn(*args) for _ in range(iters)]
        else:
            outs = None
            for _ in range(iters):
                outs = fn(*args)
        jax.block_until_ready(outs)
        samples.append((time.perf_counter() - t0) / iters)
        del outs
    return statistics.median(samples)
