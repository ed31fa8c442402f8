"""A step's host inputs on the device in one transfer (ModelRunner.place_inputs).

Why: a step's inputs are ~20 small host arrays (positions, slots, query starts, context lengths,
page table, logits rows, the sampling rows, the neutral logits transforms), and jit copied each
to the device by itself. On the H100 machine that was the engine's largest host cost: `dispatch`
took 0.87 ms of a 0.6B decode step with the device work removed (benchmarks/host_bench.py
--device null). Here their 4-byte words are concatenated on the host, moved once, and cut back
into the arrays by a small jitted function: bit casts and reshapes, so no value changes. The
arrays come out committed with the placement of a step's sampled tokens, as `place_tokens`
places host token ids: one executable of the step whichever way an input came.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class InputPlacer:
    """`inputs(batch, sampling)`: the pytrees with every numpy leaf replaced by a device array
    placed with `sharding`; leaves already on the device are kept. The token ids are placed by
    `fallback(batch)` (ModelRunner.place_tokens); if another leaf is not made of 4-byte words
    (none today) the rest stays on the host, as before."""

    def __init__(self, sharding: Any, fallback: Callable[[Any], Any]) -> None:
        self.sharding = sharding
        self.fallback = fallback
        self._unpackers: dict[tuple, Callable] = {}  # one small executable per input layout

    def inputs(self, batch: Any, sampling: Any) -> tuple[Any, Any]:
        # One layout per step shape, so warm-up compiles every unpack executable: the token ids
        # go by themselves (an ahead step's are already on the device), and so do the extra
        # leaves of a rejection-mode step's SpecSampling (its draft tokens, q) around the usual
        # SamplingInputs (`.inputs`), which steps without a verify do not have.
        batch = self.fallback(batch)
        core = getattr(sampling, "inputs", None)
        if core is not None:
            batch, core = self._pack(batch, core)
            extra = jax.device_put(dataclasses.replace(sampling, inputs=None), self.sharding)
            return batch, dataclasses.replace(extra, inputs=core)
        return self._pack(batch, sampling)

    def _pack(self, batch: Any, sampling: Any) -> tuple[Any, Any]:
        leaves, treedef = jax.tree_util.tree_flatten((batch, sampling))
        idx = [i for i, a in enumerate(leaves) if isinstance(a, np.ndarray)]
        if not idx:
            return batch, sampling
        if any(leaves[i].dtype.itemsize != 4 for i in idx):
            return batch, sampling
        arrays = [np.ascontiguousarray(leaves[i]) for i in idx]
        layout = tuple((a.shape, a.dtype.str) for a in arrays)
        unpack = self._unpackers.get(layout)
        if unpack is None:
            unpack = self._unpackers[layout] = unpacker(layout, self.sharding)
        words = np.concatenate([a.reshape(-1).view(np.uint32) for a in arrays])
        for i, a in zip(idx, unpack(words), strict=True):
            leaves[i] = a
        return jax.tree_util.tree_unflatten(treedef, leaves)


def unpacker(layout: tuple, sharding: Any) -> Callable:
    """jit(words -> the arrays of `layout` [(shape, dtype str)], each placed with `sharding`)."""

    def unpack(words: jax.Array) -> tuple:
        out, off = [], 0
        for shape, dtype in layout:
            n = int(np.prod(shape, dtype=np.int64))
            part = jax.lax.bitcast_convert_type(words[off : off + n], np.dtype(dtype))
            out.append(part.reshape(shape))
            off += n
        return tuple(out)

    return jax.jit(unpack, out_shardings=sharding)
