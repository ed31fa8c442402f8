"""The tree all-reduce on its own: pairwise-tree bits, identical on every device, any schedule."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.mesh import shard_map
from sharding.tree_allreduce import auto_schedule, tree_allreduce, tree_sum_reference

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 (host) devices")


def _spread(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Values over ~8 decades so that the summation order shows in the low bits."""
    mag = 10.0 ** rng.uniform(-4, 4, shape)
    return (rng.standard_normal(shape) * mag).astype(np.float32)


def _run(fn, x: np.ndarray) -> np.ndarray:
    n = x.shape[0]
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    f = shard_map(lambda a: fn(a[0])[None], mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    out = np.full(x.shape, np.nan, np.float32)  # poison: every row must be overwritten
    out[...] = np.asarray(jax.jit(f)(x))
    return out


def _left_fold(parts: np.ndarray) -> np.ndarray:
    acc = parts[0]
    for p in parts[1:]:
        acc = acc + p
    return acc


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize(
    "algorithm", ["pairs", "gather", "exchange", "halving", "halving_ag", "auto"]
)
@pytest.mark.parametrize("shape", [(3, 40), (1, 7)])  # (1, 7): 7 elements do not split over n
def test_tree_allreduce_equals_pairwise_reference_bitwise_on_every_device(n, algorithm, shape):
    rng = np.random.default_rng(1000 * n + shape[1])
    x = _spread(rng, (n, *shape))
    out = _run(lambda a: tree_allreduce(a, "tp", algorithm=algorithm), x)
    ref = tree_sum_reference(list(x))
    for r in range(n):
        assert np.array_equal(out[r], ref), f"device {r} differs from the pairwise tree sum"
    if n >= 4:  # the inputs can tell orders apart: a serial sum gives other bits
        assert not np.array_equal(_left_fold(x), ref)


def test_all_schedules_give_identical_bits_for_a_prefill_sized_activation():
    rng = np.random.default_rng(7)
    x = _spread(rng, (8, 64, 256))  # 64 KiB per device
    a = _run(lambda v: tree_allreduce(v, "tp", algorithm="exchange"), x)
    b = _run(lambda v: tree_allreduce(v, "tp", algorithm="halving"), x)
    c = _run(lambda v: tree_allreduce(v, "tp", algorithm="halving_ag"), x)
    g = _run(lambda v: tree_allreduce(v, "tp", algorithm="gather"), x)
    p = _run(lambda v: tree_allreduce(v, "tp", algorithm="pairs"), x)
    assert np.array_equal(a, b) and np.array_equal(a, c) and np.array_equal(a, g)
    assert np.array_equal(a, p)


def test_pairs_schedule_compiles_to_one_two_member_all_reduce_per_tree_level():
    """What makes "pairs" the tree: log2(n) all-reduces over pairs {r, r ^ d}, never one n-way
    all-reduce (XLA's all-reduce folder would make one of psum(psum(x)) without the barrier)."""
    mesh = Mesh(np.array(jax.devices()[:8]), ("tp",))
    f = shard_map(lambda a: tree_allreduce(a, "tp", algorithm="pairs"), mesh=mesh,
                  in_specs=P("tp"), out_specs=P("tp"))  # fmt: skip
    hlo = jax.jit(f).lower(np.ones((8, 4), np.float32)).compile().as_text()
    groups = [ln.split("replica_groups=")[1].split("}}")[0] + "}}"
              for ln in hlo.splitlines() if " all-reduce(" in ln]  # fmt: skip
    assert groups == [
        "{{0,1},{2,3},{4,5},{6,7}}", "{{0,2},{1,3},{4,6},{5,7}}", "{{0,4},{1,5},{2,6},{3,7}}"
    ], groups


def test_tree_allreduce_rejects_a_non_power_of_two_axis():
    mesh = Mesh(np.array(jax.devices()[:3]), ("tp",))
    f = shard_map(lambda a: tree_allreduce(a, "tp"), mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    with pytest.raises(ValueError, match="power-of-two"):
        jax.jit(f)(np.ones((3, 4), np.float32))


def _serial_allreduce(a, axis_name):
    """The negative control's all-reduce: every device sums the gathered parts left to right
    (((0+1)+2)+3)..., an order that differs from the tree for n >= 4."""
    parts = jax.lax.all_gather(a, axis_name)
    return _left_fold(list(parts))


@pytest.mark.parametrize("n", [4, 8])
def test_negative_control_an_all_reduce_in_serial_order_fails_the_tree_comparison(n):
    """The comparison the tests above make (every device vs the pairwise tree, bitwise) fails
    for an all-reduce that sums in another order: it can detect a wrong combination order."""
    rng = np.random.default_rng(3)
    x = _spread(rng, (n, 4, 64))
    out = _run(lambda a: _serial_allreduce(a, "tp"), x)
    ref = tree_sum_reference(list(x))
    assert np.allclose(out[0], ref, rtol=1e-5, atol=1e-3 * np.abs(x).max())
    assert not np.array_equal(out[0], ref), "a serial all-reduce matched the tree bitwise"


@pytest.mark.parametrize(("n", "rows", "expected"), [(2, 128, "exchange"), (4, 1100, "halving_ag")])
def test_auto_schedule_for_large_payloads_keeps_the_tree_bits(n, rows, expected):
    rng = np.random.default_rng(n)
    x = _spread(rng, (n, rows, 1024))  # 512 KiB / 4.3 MiB per device: past the gather limits
    assert auto_schedule(x[0].nbytes, n) == expected
    out = _run(lambda a: tree_allreduce(a, "tp"), x)
    ref = tree_sum_reference(list(x))
    assert all(np.array_equal(out[r], ref) for r in range(n))
