"""A step's small host arrays in one host->device copy, cut back apart inside the step executable.

Why: a decode step's layout (positions, slots, query starts, context lengths, page table, logits
rows) and its sampling rows (temperature, top-k, top-p, seed, position) are 11 small numpy arrays,
and jit copies each numpy argument to the device by itself. Each such copy costs host time: a
trivial jitted function of one step's batch and sampling arguments takes several times longer
with them as numpy arrays than with the same arrays already on the device
(benchmarks/dispatch_probe.py), which bounds a small model's engine step (the host must dispatch
step n+1 while the device runs step n). Here their 4-byte words are written into one uint32
array on the host (`pack`, benchmarks/host_bench.py), passed as one argument, and cut back
into the arrays by slices and bit casts *inside* the step's own executable: one copy, no second
executable, no value change.

Which leaves are packed is fixed by position, not by type (`PACKED_BATCH`, `PACKED_SAMPLING`): the
layout, hence the executable, is a function of the step shape alone, so warm-up compiles every
layout a step can have. The token ids stay apart (an ahead step's are a device array: the
previous step's samples), and so do the logits transforms (`LogitsInputs`: cached neutral device
arrays, or a request's own rows).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jdet import exec_cache
from jdet.ops import Ops
from jdet.sampling import sample, token_logprobs
from jdet.step import SamplingInputs, jit_step, logits_body, xla_options
from sharding.tp import tp_logits_body

PACKED_BATCH = ("positions", "slot_mapping", "query_start", "context_lens", "page_table",
                "logits_rows")  # fmt: skip
PACKED_SAMPLING = ("temperature", "top_k", "top_p", "seed", "position")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each packed array sits in the words: ((owner, field, shape, dtype str), ...), owner
    "b" (StepBatch) or "s" (SamplingInputs). Static (hashable, no leaves), so it is part of the
    jit cache key and of the executable cache's argument tree."""

    fields: tuple[tuple[str, str, tuple[int, ...], str], ...]

    @property
    def num_words(self) -> int:
        return sum(int(np.prod(shape, dtype=np.int64)) for _, _, shape, _ in self.fields)

    def unpack(self, words: jax.Array, batch: Any, sampling: Any) -> tuple[Any, Any]:
        """(batch, sampling) with the packed fields cut out of `words` (traced: slices and bit
        casts, exact)."""
        got: dict[str, dict[str, jax.Array]] = {"b": {}, "s": {}}
        offset = 0
        for owner, name, shape, dtype in self.fields:
            n = int(np.prod(shape, dtype=np.int64))
            w = lax.slice(words, (offset,), (offset + n,))
            got[owner][name] = lax.bitcast_convert_type(w, jnp.dtype(dtype)).reshape(shape)
            offset += n
        if batch is not None:  # None: the caller wants the sampling fields only (SplitStep)
            batch = dataclasses.replace(batch, **got["b"])
        inputs = _inputs(sampling)
        if got["s"] and inputs is not None:
            sampling = _with_inputs(sampling, dataclasses.replace(inputs, **got["s"]))
        return batch, sampling


jax.tree_util.register_static(Layout)


def _inputs(sampling: Any) -> Any:
    """The SamplingInputs inside `sampling` (itself, or a speculative step's `.inputs`), or
    None."""
    if isinstance(sampling, SamplingInputs):
        return sampling
    inner = getattr(sampling, "inputs", None)
    return inner if isinstance(inner, SamplingInputs) else None


def _with_inputs(sampling: Any, inputs: Any) -> Any:
    if isinstance(sampling, SamplingInputs):
        return inputs
    return dataclasses.replace(sampling, inputs=inputs)


def pack(batch: Any, sampling: Any) -> tuple[Any, Any, np.ndarray, Layout]:
    """(batch, sampling with the packed fields set to None, the uint32 words, their Layout).

    A packed field that is a device array (no step builds one today) is brought to the host:
    correct, only slower; the layout never depends on where an array came from. Written for the
    host's decode path (benchmarks/host_bench.py): no dataclasses.replace, one concatenate, one
    Layout per set of shapes."""
    inputs = _inputs(sampling)
    arrays = [np.asarray(getattr(batch, name)) for name in PACKED_BATCH]
    if inputs is not None:
        arrays += [np.asarray(getattr(inputs, name)) for name in PACKED_SAMPLING]
    key = tuple((a.shape, a.dtype.char) for a in arrays)
    layout = _LAYOUTS.get(key)
    if layout is None:
        layout = _LAYOUTS.setdefault(key, _layout(arrays, inputs is not None))
    words = np.concatenate([a.reshape(-1).view(np.uint32) for a in arrays])
    batch = _cleared(batch, PACKED_BATCH)
    if inputs is not None:
        sampling = _with_inputs(sampling, _cleared(inputs, PACKED_SAMPLING))
    return batch, sampling, words, layout


_LAYOUTS: dict[tuple, Layout] = {}


def _layout(arrays: list[np.ndarray], with_sampling: bool) -> Layout:
    names = [("b", n) for n in PACKED_BATCH]
    if with_sampling:
        names += [("s", n) for n in PACKED_SAMPLING]
    for (_, name), a in zip(names, arrays, strict=True):
        if a.dtype.itemsize != 4:
            raise TypeError(f"host input {name} has dtype {a.dtype}; packing needs 4-byte words "
                            "(int32, uint32 or float32)")  # fmt: skip
    return Layout(tuple((o, n, tuple(a.shape), a.dtype.str)
                        for (o, n), a in zip(names, arrays, strict=True)))  # fmt: skip


def _cleared(obj: Any, names: tuple[str, ...]) -> Any:
    """A shallow copy of dataclass `obj` with `names` set to None (dataclasses.replace re-runs
    __init__ and costs several times more)."""
    new = copy.copy(obj)
    for name in names:
        object.__setattr__(new, name, None)
    return new


def packed(step: Callable, jit: Callable) -> Callable:
    """`jit`((params, kv, batch, sampling, words, layout) -> step(params, kv, unpacked batch,
    unpacked sampling)). `step` is a jitted step (jdet/step.py, sharding/tp.py); its Python
    function is what runs here, under `jit` = its own `jdet.step.jit_step(ops)` (the same XLA
    options and KV donation: JAX refuses compiler options on a nested jit)."""
    body = getattr(step, "__wrapped__", step)

    @jit
    def step(params: Any, kv: Any, batch: Any, sampling: Any, words: Any, layout: Layout) -> Any:
        # named `step`: compile_cache.traced() and the logs count the step under that name
        batch, sampling = layout.unpack(words, batch, sampling)
        return body(params, kv, batch, sampling)

    return step


def packed_step_fn(step: Callable, invariance: str) -> Callable:
    """`packed(step, its own jit)`, one per (jitted step, mode): the
    steps are cached per (config, Ops) (jdet/step.py, sharding/tp.py), so every engine on a model
    shares this one function and its compiled shapes, as it shared the plain step's (a new
    wrapper per engine would re-trace every shape)."""
    return _packed_step_fn(step, invariance)


@functools.cache
def _packed_step_fn(step: Callable, invariance: str) -> Callable:
    # the step's own jit: its XLA options depend on the mode and platform only
    return packed(step, jit_step(Ops(invariance=invariance)))


class PackedStep:
    """A step callable with the ordinary (params, kv, batch, sampling) signature whose host
    inputs travel packed (module docstring). `fn` is `packed(step)`, possibly behind jdet's
    executable cache; `warm` and `lower` take the ordinary arguments too."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn

    def __call__(self, params: Any, kv: Any, batch: Any, sampling: Any) -> Any:
        return self.fn(params, kv, *pack(batch, sampling))

    def warm(self, params: Any, kv: Any, batch: Any, sampling: Any) -> str | None:
        return exec_cache.prepare(self.fn, params, kv, *pack(batch, sampling))

    def lower(self, params: Any, kv: Any, batch: Any, sampling: Any) -> Any:
        return self.fn.lower(params, kv, *pack(batch, sampling))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.fn, attr)


def split_step_fn(
    cfg: Any, invariance: str, mesh: Any = None
) -> tuple[Callable, Callable, Callable]:
    """An engine's step as two executables, (forward, sampler), one pair per (config, mode):
    forward(params, kv, batch, words, layout) -> (kv, f32 logits [N, V]) (the KV cache donated)
    and sampler(logits, sampling, words, layout) -> SampleOut. `SplitStep` runs them in turn.
    The third, logprobs(logits, targets) -> f32 [N], is the sampler's log-softmax alone: with
    the forward it is the engine's score function on a CPU (`SplitScore`).

    Why: the sampler is compiled once per (rows, vocabulary, variant) instead of once per step
    shape and variant, and each forward shape is traced and compiled once for every variant. On a
    GPU the step's trace and lowering hold the GIL (seconds a shape on the 8B model: BENCHMARKS.md,
    Start-up), so an 8B default engine traced 36 steps (18 shapes x 2 variants) before its first
    token, and 18 forwards and a few samplers split; on an earlier tree the two programs gave the
    same bits, their step time within run-to-run noise of one program's (BENCHMARKS.md, "Defaults
    and memory"; `split_step_here` says why a GPU still runs one). On a CPU the full sampler is
    about half of a step's compile (benchmarks/sampler_compile.py; XLA CPU emits each fusion as its
    own LLVM module, and the Gumbel draw, top-k/top-p filter and top log-probs are many), and in
    one step program it is compiled again for every step shape (T, S, Pmax) and sampler variant.
    Apart, one forward serves every variant of a shape, one sampler every shape of the same rows N,
    vocabulary and variant, and XLA's persistent cache shares both between processes: warm-up
    compiles far less. Same bits: the logits are the same f32 array either way (the forward ends in
    the lm_head matmul's f32 sums), and the sampler is the same function of them
    (`jdet.step.step_body`'s `sample`), compiled with the step's XLA options
    (tests/jdet/test_golden.py unchanged, TP 1 and 2). `mesh`: the TP runtime's (sharding/tp.py):
    the forward runs under shard_map and returns the gathered logits replicated; the sampler runs
    on them as it ran per device inside the shard_map."""
    return _split_step_fn(cfg, invariance, mesh)


@functools.cache
def _split_step_fn(cfg: Any, invariance: str, mesh: Any) -> tuple[Callable, Callable, Callable]:
    if mesh is None:
        ops = Ops(invariance=invariance)
        forward = logits_body(cfg, ops)
    else:
        forward, ops = tp_logits_body(cfg, invariance, mesh)

    @jit_step(ops)
    def step(params: Any, kv: Any, batch: Any, words: Any, layout: Layout) -> Any:
        # named `step`: compile_cache.traced() and the logs count it as the step
        batch, _ = layout.unpack(words, batch, None)
        return forward(params, kv, batch)

    opts = xla_options(ops)
    jit = functools.partial(jax.jit, **({"compiler_options": opts} if opts else {}))

    @jit
    def sampler(logits: Any, sampling: Any, words: Any, layout: Layout) -> Any:
        _, sampling = layout.unpack(words, None, sampling)
        return sample(logits, sampling, ops)

    sampler.jdet_xla_options = opts  # the executable cache keys by it (jdet/exec_cache.py)

    @jit
    def logprobs(logits: Any, targets: Any) -> Any:
        return token_logprobs(logits, targets, ops)

    return step, sampler, logprobs


STEP_PROGRAMS = ("auto", "split", "fused")


def split_step_here(step_programs: str = "auto") -> bool:
    """Whether an engine's own step runs as `SplitStep` (`split_step_fn` says why) or as one
    program per shape and variant (`packed`): EngineConfig.step_programs, where "auto" is split
    on every backend. Why: on an H200 (Llama-3-8B shape, batch-1 decode through `LLM.generate`,
    benchmarks/start_bench.py) the two steps took the same time within a third of a percent,
    and the split step compiles fewer executables at warm-up (each forward shape traced once for
    both sampler variants); BENCHMARKS.md holds the figures."""
    if step_programs not in STEP_PROGRAMS:
        raise ValueError(f"step_programs={step_programs!r}: choose one of {STEP_PROGRAMS}")
    return step_programs != "fused"


@functools.cache
def _sampling_layout(layout: Layout) -> tuple[int, Layout]:
    """(where the sampling fields start in `layout`'s words, their own Layout): they come last
    (`pack`), so the sampler is given a view of the words' tail, whose size is N's alone."""
    start = sum(int(np.prod(shape, dtype=np.int64)) for o, _, shape, _ in layout.fields
                if o == "b")  # fmt: skip
    own = Layout(tuple(f for f in layout.fields if f[0] == "s"))
    if layout.fields[: len(layout.fields) - len(own.fields)] + own.fields != layout.fields:
        raise AssertionError("pack() no longer puts the sampling fields last")
    return start, own


class SplitStep(PackedStep):
    """`PackedStep` over `split_step_fn`'s pair: the forward (`fn`; what `lower` sees) given the
    packed words, then the sampler given their sampling tail, both possibly behind jdet's
    executable cache (`warm` prepares both: the sampler from the logits' shape and placement,
    `vocab_size` and `logits_sharding`, without running the forward). Batch-1 greedy decode of
    the embedded model, the two in one process alternating (load ~7): 168.6 tok/s split, 167.7
    as one program (median of 8), the same bits."""

    def __init__(
        self, fn: Callable, sampler: Callable, vocab_size: int, logits_sharding: Any
    ) -> None:
        self.fn = fn
        self.sampler = sampler
        self.vocab_size = vocab_size
        self.logits_sharding = logits_sharding

    def __call__(self, params: Any, kv: Any, batch: Any, sampling: Any) -> Any:
        batch, sampling, words, layout = pack(batch, sampling)
        kv, logits = self.fn(params, kv, batch, words, layout)
        start, own = _sampling_layout(layout)  # the sampler's words only: its key has no T, P
        return kv, self.sampler(logits, sampling, words[start:], own)

    def warm(self, params: Any, kv: Any, batch: Any, sampling: Any) -> str | None:
        batch, sampling, words, layout = pack(batch, sampling)
        how = exec_cache.prepare(self.fn, params, kv, batch, words, layout)
        exec_cache.prepare(self.sampler, *self._sampler_args(sampling, words, layout))
        return how

    def lower(self, params: Any, kv: Any, batch: Any, sampling: Any) -> Any:
        batch, _, words, layout = pack(batch, sampling)
        return self.fn.lower(params, kv, batch, words, layout)

    def _sampler_args(self, sampling: Any, words: np.ndarray, layout: Layout) -> tuple:
        """The sampler's arguments for a step of `layout`, the logits as their shape and
        placement (the forward's output: f32 [N, V], placed as the step's sampled tokens)."""
        start, own = _sampling_layout(layout)
        (rows,) = next(shape for _, name, shape, _ in layout.fields if name == "logits_rows")
        logits = jax.ShapeDtypeStruct((rows, self.vocab_size), jnp.float32,
                                      sharding=self.logits_sharding)  # fmt: skip
        return logits, sampling, words[start:], own

    def peak_bytes(self, params: Any, kv: Any, batch: Any, *samplings: Any) -> int:
        """Working memory of a step of these arguments (XLA's memory analysis): the f32 logits
        between the two programs plus the largest of their temporaries, the sampler's for each
        of `samplings` (one per variant the engine runs: their temporaries differ, and each is
        an executable warm-up runs; compiled here beside the forward, in a second thread)."""
        packed = [pack(batch, s) for s in samplings]
        batch, _, words, layout = packed[0]
        args = [self._sampler_args(s, w, lay) for _, s, w, lay in packed]
        compiled = getattr(type(self.sampler), "compiled", None)  # behind the executable cache

        def sampler_temps() -> list[int]:
            return [int((compiled(self.sampler, *a) if compiled is not None
                         else self.sampler.lower(*a).compile()).memory_analysis()
                        .temp_size_in_bytes) for a in args]  # fmt: skip

        with ThreadPoolExecutor(1) as pool:
            smp = pool.submit(sampler_temps)
            fwd = self.fn.lower(params, kv, batch, words, layout).compile().memory_analysis()
            smp_temps = smp.result()
        logits = max(a[0].shape[0] * a[0].shape[1] * 4 for a in args)
        return logits + max(int(fwd.temp_size_in_bytes), *smp_temps)


class SplitScore(PackedStep):
    """A CPU engine's score function in "tp" and "batch", score(params, kv, batch, targets) ->
    (kv, f32 [T]): the step's forward (`fn`: `split_step_fn`'s, possibly behind jdet's
    executable cache) given the score batch with neutral sampling rows, so that its packed words
    have the step's layout, then `logprobs`, the sampler's log-softmax, on every row's logits.

    Why: a score used to be a program of its own (jdet/step.py `make_score_fn`), compiled again
    for every step shape the engine had already compiled for generation. A score batch of T
    tokens has T logits rows and a step of bucket T has S = min(T, max_num_seqs) rows, so up to
    max_num_seqs tokens the score runs the step's own forward executable (the same shape, the
    same layout), and a larger one compiles a forward once. The log-probs are the sampler's
    function (`token_logprobs` is its log-softmax and gather) of the same f32 logits, so a
    generated token's log-prob and its score are one computation on a CPU (test_golden's
    recorded score hashes at TP 1, 2 and 4 are unchanged). `place` puts the token ids on the
    device as the engine's steps get them (`ModelRunner.place_tokens`): a host array would be
    another executable."""

    def __init__(self, fn: Callable, logprobs: Callable, place: Callable) -> None:
        self.fn = fn
        self.logprobs = logprobs
        self.place = place

    def _packed(self, batch: Any) -> tuple[Any, Any, Layout]:
        batch, _, words, layout = pack(self.place(batch), _neutral_rows(batch.page_table.shape[0]))
        return batch, words, layout

    def __call__(self, params: Any, kv: Any, batch: Any, targets: Any) -> Any:
        batch, words, layout = self._packed(batch)
        kv, logits = self.fn(params, kv, batch, words, layout)
        return kv, self.logprobs(logits, targets)

    def warm(self, params: Any, kv: Any, batch: Any, targets: Any) -> str | None:
        return exec_cache.prepare(self.fn, params, kv, *self._packed(batch))

    def lower(self, params: Any, kv: Any, batch: Any, targets: Any) -> Any:
        return self.fn.lower(params, kv, *self._packed(batch))


@functools.cache
def _neutral_rows(S: int) -> Any:
    """SamplingInputs of S greedy rows: what `pack` needs to lay a score batch out as a step of
    S sequences (their values reach no output: `SplitScore` runs no sampler)."""
    z = np.zeros(S, np.float32)
    return SamplingInputs(
        temperature=z, top_k=np.zeros(S, np.int32), top_p=z + 1, seed=np.zeros(S, np.uint32),
        position=np.zeros(S, np.int32),
    )  # fmt: skip
