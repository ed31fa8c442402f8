"""The KV page pool's size on a device with a memory limit: what is left of the device's memory
once the weights, the step's own peak and a headroom are counted, under `gpu_memory_utilization`.

Why measured, not guessed: a fixed fraction of the free memory leaves the step's working memory
to chance (an 8B engine on an H200 can fail its first step that way). Here every term is read off
the device or the compiler:
- the weights and anything else already placed: the device's `bytes_in_use` once the runner has
  placed its (padded, fused) weights;
- the step's peak: XLA's memory analysis of the largest step shape the engine runs, compiled
  against an abstract pool (`temp_size_in_bytes`: activations, attention partials, sampler rows;
  the cache itself is donated and aliased, so the pool's size does not enter it — asserted by
  tests/serving/engine/test_memory.py), plus the score function's f32 logits of a full token bucket;
- a fixed headroom for what neither counts (allocator fragmentation, host-to-device staging of a
  step's inputs, small executables such as the logits transforms).
The pool gets the rest: pages = (utilization x limit - in use - peak - headroom) // page bytes.
A model that does not fit gets an error naming each term and the settings to change.

The compile is cached: the peak of a (model, plan, step shape, placement) is written beside
jdet's executables (`<key>.peak.json` in jdet/compile_cache.py `exec_dir`), so a restart sizes
its pool without compiling; without a cache directory the compile is paid at every start (about
the time of one step shape).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jdet import compile_cache
from jdet.exec_key import entry_key, key_parts
from pallas_kernels.paged_attention_pallas import SPLIT_PARTIALS_MAX_BYTES
from serving.engine.shapes import kv_pool, model_len_limit

_log = logging.getLogger(__name__)
GiB = 1 << 30
# What no measurement covers (module docstring): the allocator's fragmentation and small buffers.
HEADROOM_BYTES = 1 * GiB
SCORE_LOGITS_COPIES = 3  # score(): f32 logits, their log-softmax and the gathered rows' temporaries


@dataclasses.dataclass(frozen=True)
class Budget:
    """One device's memory terms, in bytes (module docstring)."""

    limit: int  # what JAX may allocate on the device (its `bytes_limit`)
    utilization: float  # EngineConfig.gpu_memory_utilization
    in_use: int  # weights and everything placed before the pool
    peak: int  # the largest step's working memory (XLA's memory analysis)
    headroom: int

    @property
    def for_pool(self) -> int:
        return int(self.utilization * self.limit) - self.in_use - self.peak - self.headroom

    def describe(self) -> str:
        g = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
        return (
            f"gpu_memory_utilization {self.utilization} x the device's {g(self.limit)} = "
            f"{g(int(self.utilization * self.limit))}; weights and other buffers in use "
            f"{g(self.in_use)}, the largest step's peak {g(self.peak)}, headroom "
            f"{g(self.headroom)}: {g(max(self.for_pool, 0))} left for the KV cache"
        )


def device_limit() -> tuple[int, int] | None:
    """(bytes_limit, bytes_in_use) of the first device, or None where it reports no limit (a
    CPU): there the pool keeps its fixed default (serving/engine/shapes.py `default_num_pages`)."""
    stats = _device_stats()
    limit = stats.get("bytes_limit")
    return (int(limit), int(stats.get("bytes_in_use", 0))) if limit else None


def _device_stats() -> dict:
    """The first device's allocator statistics; {} where the backend keeps none."""
    try:
        return jax.local_devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats
        return {}


def check_utilization(value: float) -> float:
    if not 0.0 < value <= 1.0:
        raise ValueError(
            f"gpu_memory_utilization={value} must be in (0, 1]: the fraction of the device "
            f"memory JAX may use that the engine's weights, KV cache and step take"
        )
    return value


def step_peak(runner: Any, exec_dir: Path | None) -> int:
    """The largest step shape's working memory in bytes (XLA's memory analysis), compiled
    against an abstract pool of the pages of one max_model_len sequence, plus the score
    function's f32 logits for its largest token bucket (`SCORE_LOGITS_COPIES`: a step's score
    rows stay within the stall-free budget, serving/engine/scheduler.py). A step of two
    programs (serving/engine/host_inputs.py `SplitStep.peak_bytes`) counts both and the logits
    between them, with the sampler of every variant the engine runs (their temporaries differ:
    a variant's logits transforms may take more than the forward); a step of one program counts
    the FULL variant's. Plus the split attention layout's partials at their cap: the largest
    shape may run looped while a smaller one holds up to SPLIT_PARTIALS_MAX_BYTES of them beside
    activations no larger than the largest shape's (pallas_kernels/paged_attention_pallas.py)."""
    shape = runner.shapes.all()[-1]
    kv = runner.abstract_kv(runner.max_pages)
    batch, sampling = runner.warmup_batch(shape, "step")
    samplings = [runner.warmup_batch(shape, "step", v)[1] for v in runner.variants]
    path = _peak_path(runner, kv, batch, samplings, exec_dir)
    temp = None
    if path is not None and path.exists():
        try:
            temp = int(json.loads(path.read_text())["temp"])
        except (OSError, ValueError, KeyError, TypeError):
            temp = None
    if temp is None:
        peak_bytes = getattr(runner.step_fn, "peak_bytes", None)
        if peak_bytes is not None:
            temp = int(peak_bytes(runner.params, kv, batch, *samplings))
        else:
            compiled = runner.step_fn.lower(runner.params, kv, batch, sampling).compile()
            temp = int(compiled.memory_analysis().temp_size_in_bytes)
        if path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps({"temp": temp, "shape": list(shape)}))
                os.replace(tmp, path)
            except OSError:
                pass  # the next start compiles again
    score_tokens = runner.shapes.all("score")[-1][0]
    score_logits = score_tokens * runner.cfg.vocab_size * 4 * SCORE_LOGITS_COPIES
    return temp + score_logits + SPLIT_PARTIALS_MAX_BYTES


def _peak_path(runner: Any, kv: Any, batch: Any, sampling: Any, exec_dir: Path | None) -> Any:
    if exec_dir is None:
        return None
    static = {"cfg": repr(runner.cfg), "invariance": runner.invariance, "tp": runner.tp,
              "what": "step peak", "program": type(runner.step_fn).__name__}  # fmt: skip
    # a stable key name, not a module path: another name would orphan every cached peak
    parts = key_parts("serving.memory.step_peak", static, jax.devices()[: runner.tp],
                      (runner.params, kv, batch, sampling))  # fmt: skip
    return Path(exec_dir) / (entry_key(parts) + ".peak.json")


def page_bytes_per_device(runner: Any) -> int:
    """Bytes of one KV page (k and v, every layer) on one device of the runner's mesh."""
    kv = runner.abstract_kv(1)
    total = sum(int(jnp.dtype(a.dtype).itemsize) * int(a.size) for a in kv.values())
    return total // runner.kv_devices


def pool_pages(runner: Any, utilization: float, exec_dir: Path | None) -> tuple[int, Budget]:
    """Pages of the pool (module docstring) and the budget they were read from; the runner has
    placed its weights and holds no pool yet."""
    limit = device_limit()
    if limit is None:
        raise RuntimeError("pool_pages needs a device that reports its memory limit")
    peak = step_peak(runner, exec_dir)
    limit, in_use = device_limit()  # after the compile: nothing stays, but read it as it is
    budget = Budget(limit, utilization, in_use, peak, HEADROOM_BYTES)
    return max(0, budget.for_pool // page_bytes_per_device(runner)), budget


def size_pool(
    runner: Any, utilization: float, max_model_len: int, *, may_shrink: bool, step_tokens: int,
    exec_dir: Path | None,
) -> tuple[int, int, Budget]:  # fmt: skip
    """Size and allocate the runner's pool (module docstring): (pages, max_model_len, budget).
    `may_shrink`: max_model_len was not set, so a pool shorter than the model's own length
    shortens it instead of failing; a pool that cannot hold one sequence of max_model_len (or,
    shrinking, one step's `step_tokens`) raises a ValueError naming each term and the settings
    to change."""
    num_pages, budget = pool_pages(runner, utilization, exec_dir)
    if num_pages > 0:
        num_pages = allocate_to_fit(runner, num_pages, budget.peak)
    page_size = runner.page_size
    need = -(-max_model_len // page_size)
    if num_pages < need:
        fits = num_pages * page_size
        if not may_shrink or fits < step_tokens:
            page_mib = page_bytes_per_device(runner) / (1 << 20)
            raise ValueError(
                f"the model does not fit: {budget.describe()}, which holds {fits} tokens of KV "
                f"cache ({page_mib:.2f} MiB a {page_size}-token page) but one sequence of "
                f"max_model_len={max_model_len} needs {need} pages"
                + ("" if may_shrink else f" and a step {step_tokens} tokens")
                + "; lower max_model_len or max_num_batched_tokens, raise "
                "gpu_memory_utilization, or split the model over more devices (tp); JAX's own "
                "limit is XLA_PYTHON_CLIENT_MEM_FRACTION of the device (default 0.75)"
                + (DONATE_HINT if _two_copies(runner) else "")
            )
        max_model_len = fits
        runner.set_max_model_len(fits)
    return num_pages, max_model_len, budget


DONATE_HINT = (
    "; the engine's own layout of the weights sits beside the model's: donate_weights=True "
    "frees the model's copy"
)


def _two_copies(runner: Any) -> bool:
    """Whether the runner laid the weights out anew (a mesh) and the caller kept its copy."""
    return getattr(runner, "_mesh", None) is not None and not getattr(
        runner.config, "donate_weights", False
    )


def allocate_to_fit(runner: Any, num_pages: int, keep_free: int) -> int:
    """`runner.allocate_kv` of at most `num_pages` pages such that the device still has a free
    block of `keep_free` bytes (the step's working memory) beside it; returns the pages.

    Why not just `num_pages`: the pool is two arrays of up to tens of GiB each, and each needs
    one contiguous block of the device allocator. Bytes that are free in total may be cut into
    smaller holes by what was placed and freed before (the weights' preparation). So:
    - each try first fits one half to the largest free block the allocator reports (a half
      bigger than that block cannot be placed, whatever the total free);
    - the halves are made one at a time and waited for (jdet/kv_cache.py `make_halves`), so a
      failure is of one whole array and the half made before it is deleted at once; a pool that
      does not fit, or leaves no block of `keep_free` for the step, is freed and tried 10 %
      smaller;
    - a failed try's arrays are deleted, the runner's and any other pool-shaped array the try
      left alive (`_strays`: whatever else references them, an error's traceback for one).
    A try that kept its memory would make every smaller one fail too (on an H200 every try of a
    pool made as one two-output program failed, down to a 548 MiB pool, with the device's
    in-use memory grown to its limit), so each failed try's line names the device's in-use
    memory and largest free block after the cleanup."""
    tries: list[str] = []  # what each try met: the error names them all
    if getattr(runner, "kv", None) is not None:
        free_pool(runner)  # a pool already there: its memory is the first try's to use
    half = _half_page_bytes(runner)
    for _ in range(40):
        block = largest_free_block()
        if half and block is not None and num_pages * half > block:
            # a half is one array: more pages than the largest free block holds cannot fit
            num_pages = block // half
            if num_pages < 1:
                tries.append(f"no free block holds a page ({block / GiB:.2f} GiB)")
                break
        before = {id(a) for a in jax.live_arrays()}
        try:
            runner.allocate_kv(num_pages)
            jax.block_until_ready(runner.kv)
            free = largest_free_block()
            if free is None or free >= keep_free:
                return num_pages
            tries.append(f"{num_pages} pages: allocated, then a largest free block of "
                         f"{free / GiB:.2f} GiB")  # fmt: skip
        except jax.errors.JaxRuntimeError as e:
            if "RESOURCE_EXHAUSTED" not in str(e):
                raise
            tries.append(f"{num_pages} pages: {str(e).strip().splitlines()[0][:200]}")
        free_pool(runner, _strays(runner, num_pages, before))
        tries[-1] += f" (freed: {_stats()})"
        _log.warning("KV pool try %d: %s; trying 10 %% smaller", len(tries), tries[-1])
        num_pages = int(num_pages * 0.9)
        if num_pages < 1:
            break
    shown = tries if len(tries) <= 4 else [*tries[:3], "...", tries[-1]]
    raise MemoryError(
        f"no KV pool fits beside the weights with a {keep_free / GiB:.2f} GiB block left for "
        f"the step: the device's free memory is too fragmented or too small. {len(tries)} tries: "
        + "; ".join(shown)
        + f". Now: {_stats()}"
    )


def _stats() -> str:
    """The device allocator's in-use, largest free block and limit, where it reports them: in
    each failed try's line, so a try that kept memory shows as a growing in-use."""
    stats = _device_stats()
    keys = ("bytes_in_use", "largest_free_block_bytes", "bytes_limit")
    return ", ".join(f"{k} {int(stats[k]) / GiB:.2f} GiB" for k in keys if k in stats) or "no stats"


def _half_page_bytes(runner: Any) -> int:
    """Bytes one page adds to one half (k or v) of the pool on one device; 0 where the runner
    cannot say (then the tries alone find the size)."""
    if getattr(runner, "abstract_kv", None) is None or not hasattr(runner, "kv_devices"):
        return 0
    return page_bytes_per_device(runner) // 2


def free_pool(runner: Any, strays: list | None = None) -> None:
    """Drop the runner's pool and free its device memory now, whoever else still refers to it;
    `strays`, other arrays of a failed try, too."""
    kv, runner.kv = runner.kv, None
    for a in [*jax.tree_util.tree_leaves(kv or {}), *(strays or [])]:
        with contextlib.suppress(Exception):  # an array whose allocation failed has no buffer
            a.delete()
    gc.collect()


def _strays(runner: Any, num_pages: int, before: set[int]) -> list:
    """Live arrays made since `before` (ids of the live arrays then) that have a pool array's
    shape and dtype: what a failed try allocated, wherever it is still referenced."""
    abstract = getattr(runner, "abstract_kv", None)
    if abstract is None:
        return []
    kinds = {(tuple(a.shape), jnp.dtype(a.dtype)) for a in abstract(num_pages).values()}
    return [a for a in jax.live_arrays()
            if id(a) not in before and (tuple(a.shape), jnp.dtype(a.dtype)) in kinds]  # fmt: skip


def largest_free_block() -> int | None:
    """The device allocator's largest free block in bytes, where it reports one (a GPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    free = stats.get("largest_free_block_bytes")
    return int(free) if free is not None else None


def runner_with_pool(model: Any, config: Any, make_runner: Any) -> tuple[Any, int, int, Any]:
    """(runner, num_pages, max_model_len, Budget or None): the runner `make_runner(config)`
    builds from `config` with its pool and length resolved. On a device with a memory limit and
    no `num_pages` set, the pool is sized after the weights are placed, from the compiled step's
    own peak (module docstring), and may shorten max_model_len when it was not set; elsewhere
    the pool has a fixed default (serving/engine/shapes.py `kv_pool`)."""
    util = check_utilization(config.gpu_memory_utilization)
    sized = config.num_pages is None and device_limit() is not None
    if sized:
        max_model_len, num_pages = model_len_limit(model.cfg, config.max_model_len), None
    else:
        max_model_len, num_pages = kv_pool(
            model.cfg, model.dtype, page_size=config.page_size, max_model_len=config.max_model_len,
            num_pages=config.num_pages, max_num_seqs=config.max_num_seqs,
        )  # fmt: skip
    runner = make_runner(
        dataclasses.replace(config, max_model_len=max_model_len, num_pages=num_pages)
    )
    budget = None
    if sized:  # the pool is allocated here, once the weights are placed
        num_pages, max_model_len, budget = size_pool(
            runner, util, max_model_len, may_shrink=config.max_model_len is None,
            step_tokens=config.max_num_batched_tokens, exec_dir=compile_cache.exec_dir(),
        )  # fmt: skip
    return runner, num_pages, max_model_len, budget
