"""A step's small host arrays in one host->device copy, cut back apart inside the step executable.

Why: a decode step's layout (positions, slots, query starts, context lengths, page table, logits
rows) and its sampling rows (temperature, top-k, top-p, seed, position) are 11 small numpy arrays,
and jit copies each numpy argument to the device by itself. On the H100 machine each such copy
costs ~50 us of host time: a trivial jitted function of one step's batch and sampling arguments
took 602 us with them as numpy arrays and 75 us with the same arrays already on the device
(benchmarks/dispatch_probe.py, BENCHMARKS.md run 8), which bounds a small model's engine step (the
host must dispatch step n+1 while the device runs step n). Here their 4-byte words are written into
one uint32 array on the host (~25 us on a CPU: `pack`), passed as one argument, and cut back
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

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
        batch = dataclasses.replace(batch, **got["b"])
        inputs = _inputs(sampling)
        if got["s"]:
            sampling = _with_inputs(sampling, dataclasses.replace(inputs, **got["s"]))
        return batch, sampling


jax.tree_util.register_static(Layout)


def _inputs(sampling: Any) -> Any:
    """The SamplingInputs inside `sampling` (itself, or a speculative step's `.inputs`), or
    None."""
    from jdet.step import SamplingInputs

    if isinstance(sampling, SamplingInputs):
        return sampling
    inner = getattr(sampling, "inputs", None)
    return inner if isinstance(inner, SamplingInputs) else None


def _with_inputs(sampling: Any, inputs: Any) -> Any:
    from jdet.step import SamplingInputs

    if isinstance(sampling, SamplingInputs):
        return inputs
    return dataclasses.replace(sampling, inputs=inputs)


def pack(batch: Any, sampling: Any) -> tuple[Any, Any, np.ndarray, Layout]:
    """(batch, sampling with the packed fields set to None, the uint32 words, their Layout).

    A packed field that is a device array (no step builds one today) is brought to the host:
    correct, only slower; the layout never depends on where an array came from. Written for the
    host's decode path (~20 us on a CPU): no dataclasses.replace, one concatenate, one Layout per
    set of shapes."""
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
    wrapper per engine re-traced every shape: ~1.3 CPU s per engine of the embedded model)."""
    return _packed_step_fn(step, invariance)


@functools.cache
def _packed_step_fn(step: Callable, invariance: str) -> Callable:
    from jdet.ops import Ops
    from jdet.step import jit_step

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
        from jdet import exec_cache

        return exec_cache.prepare(self.fn, params, kv, *pack(batch, sampling))

    def lower(self, params: Any, kv: Any, batch: Any, sampling: Any) -> Any:
        return self.fn.lower(params, kv, *pack(batch, sampling))

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.fn, attr)
