"""The "pull" tree all-reduce (one Mosaic GPU kernel, pallas_kernels/allreduce_mosaic.py) on 2
and 4 Hopper GPUs: bitwise the pairwise tree (`tree_sum_reference`, the kernel's `reference`)
on every device, for decode-sized partials of a model dimension, with the leaf groups, residual
and padding rows the TP layers give it, and the same bits as the XLA-collective schedules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.mesh import shard_map
from sharding.tree_allreduce import tree_allreduce, tree_allreduce_parts, tree_sum_reference

pytestmark = pytest.mark.gpu

ONE, HALF_ULP = np.float32(1.0), np.float32(2.0**-24)  # 1 + 2^-24 rounds back to 1 (ties to even)


def _sizes() -> list[int]:
    sizes = [n for n in (2, 4) if n <= jax.device_count()]
    if not sizes:
        pytest.skip("needs at least 2 GPUs")
    return sizes


def _spread(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values over six decades, so that an addition order shows in the low bits."""
    return (rng.standard_normal(shape) * 10.0 ** rng.uniform(-3, 3, shape)).astype(np.float32)


def _plant(leaves: np.ndarray) -> np.ndarray:
    """Leaves [n, G, ...] with element 0 of the first four (rank-major) set to 1, h, h, 0
    (h = 2^-24) and of the others to 0: the tree gives (1 + h) + (h + 0) = 1 exactly (1 + h
    ties to 1), while an order that adds the two h first gives 1 + 2^-23."""
    flat = leaves.reshape(-1, leaves[0, 0].size)  # a view: [n * G leaves, elements]
    flat[:, 0] = 0.0
    planted = (ONE, HALF_ULP, HALF_ULP, 0.0)[: len(flat)]
    flat[: len(planted), 0] = planted
    return leaves


def _run(fn, *arrays: np.ndarray) -> np.ndarray:
    """fn on each device's slice of every array (leading axis: the device); [n, ...] back."""
    n = arrays[0].shape[0]
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    f = shard_map(lambda *a: fn(*(x[0] for x in a))[None], mesh=mesh,
                  in_specs=tuple(P("tp") for _ in arrays), out_specs=P("tp"))  # fmt: skip
    return np.asarray(jax.jit(f)(*arrays))


@pytest.mark.parametrize("d", [4096, 8192])
@pytest.mark.parametrize("t", [1, 16, 64])
def test_gpu_pull_equals_the_pairwise_tree_bitwise_on_every_device(t, d):
    for n in _sizes():
        rng = np.random.default_rng(1000 * n + t)
        x = _spread(rng, (n, t, d))
        out = _run(lambda a: tree_allreduce(a, "tp", algorithm="pull"), x)
        ref = tree_sum_reference(list(x))
        for r in range(n):
            assert np.array_equal(out[r], ref), f"n={n}: device {r} differs from the tree"


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("live", [1, 16, 64])
def test_gpu_pull_with_groups_residual_and_padding_equals_the_reference_and_xla(live, groups):
    """The TP layers' form: this device's partial as the tree matmul's leaf groups, the bf16
    residual added in the kernel, 64 rows of which the first `live` are the step's (the rest
    come back as the residual's). Equal to the reference and to "gather"/"exchange" (the
    XLA-collective schedules, which add the groups and the residual in XLA)."""
    from pallas_kernels.allreduce_mosaic import reference

    rows, d = 64, 4096
    for n in _sizes():
        rng = np.random.default_rng(10 * n + live)
        parts = _plant(_spread(rng, (n, groups, rows, d)))
        res = np.broadcast_to(_spread(rng, (rows, d)).astype(jnp.bfloat16), (n, rows, d))
        want = reference(list(parts), res[0], live)
        got = {}
        for algorithm in ("pull", "gather", "exchange"):
            got[algorithm] = _run(
                lambda p, x, a=algorithm: tree_allreduce_parts(p, "tp", residual=x,
                                                               live_rows=live, algorithm=a),
                parts, np.ascontiguousarray(res),
            )  # fmt: skip
        for r in range(n):
            assert got["pull"][r].dtype == want.dtype == jnp.bfloat16
            assert np.array_equal(got["pull"][r], want), f"n={n}: device {r}"
            for xla in ("gather", "exchange"):
                assert np.array_equal(got[xla][r], want), f"n={n}: {xla} on device {r}"
        plain = _run(lambda p: tree_allreduce_parts(p, "tp", algorithm="pull"), parts)
        assert all(np.array_equal(plain[r], reference(list(parts))) for r in range(n))


def _right_fold_allreduce(parts: jax.Array) -> jax.Array:
    """The negative control's all-reduce: the same leaves, summed right to left,
    l0 + (l1 + (l2 + ...)): the two planted 2^-24 meet first."""
    leaves = jax.lax.all_gather(parts, "tp").reshape(-1, *parts.shape[1:])
    acc = leaves[-1]
    for i in range(leaves.shape[0] - 2, -1, -1):
        acc = leaves[i] + acc
    return acc


def test_gpu_negative_control_another_order_fails_the_tree_comparison():
    """The comparison above tells orders apart for certain: on the planted leaves the right
    fold gives 1 + 2^-23 where the tree (and the pull kernel) gives 1."""
    for n in _sizes():
        groups = 4 // n if n < 4 else 1  # four leaves or more: 2 x 2, 4 x 1
        rng = np.random.default_rng(n)
        parts = _plant(_spread(rng, (n, groups, 16, 4096)))
        ref = tree_sum_reference([tree_sum_reference(list(p)) for p in parts])
        pull = _run(lambda p: tree_allreduce_parts(p, "tp", algorithm="pull"), parts)
        other = _run(_right_fold_allreduce, parts)
        assert ref[0, 0] == ONE and pull[0][0, 0] == ONE
        assert other[0][0, 0] == ONE + 2 * HALF_ULP
        assert np.array_equal(pull[0], ref) and not np.array_equal(other[0], ref)
