"""The 1-D tensor-parallel mesh and the `shard_map` entry point for both supported jax versions.

Why one axis: jdet splits a model only by tensor parallelism (on one host or several), so the
mesh is `tp` devices on a line. TP sizes are powers of two because the cross-device reduction is a
binary tree (see `tree_allreduce`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jdet.tp_layout import check_tp_size
from sharding.distributed import check_spans_processes, mesh_devices

TP_AXIS = "tp"


def make_tp_mesh(tp: int, devices: Sequence[Any] | None = None) -> Mesh:
    """A mesh of the first `tp` devices on the single axis 'tp': this process's own, or in a
    multi-process job every process's in process order (sharding/distributed.py)."""
    if devices is None:
        check_spans_processes(tp)
    devs = list(mesh_devices() if devices is None else devices)
    check_tp_size(tp, len(devs))
    # Mesh() rather than jax.make_mesh: make_mesh insists on using every device (and its default
    # axis type changed across versions), while TP=2 on an 8-GPU host must take a subset.
    return Mesh(np.array(devs[:tp]), (TP_AXIS,))


def tp_size(mesh: Mesh) -> int:
    return int(mesh.shape[TP_AXIS])


def shard_map(
    f: Callable, *, mesh: Mesh, in_specs: Any, out_specs: Any, check: bool = False
) -> Callable:
    """`jax.shard_map` where present (jax >= 0.6), else `jax.experimental.shard_map.shard_map`.

    Replication checking is off by default: outputs of `tree_allreduce` are equal on every device
    by construction (same operands, same order), which the checker cannot see through ppermute.
    """
    if hasattr(jax, "shard_map"):
        return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check)
    from jax.experimental.shard_map import shard_map as _sm  # pragma: no cover (old jax)

    return _sm(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_rep=check)
