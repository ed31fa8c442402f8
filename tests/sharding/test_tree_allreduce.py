"""The tree all-reduce on its own: pairwise-tree bits, identical on every device, any schedule."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sharding.mesh import shard_map
from sharding.tree_allreduce import (
    PULL_MAX_BYTES,
    auto_schedule,
    psum_parts,
    pull_runs_here,
    tree_allreduce,
    tree_allreduce_parts,
    tree_sum_reference,
)

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


# -- "pull" (one Mosaic GPU kernel, Hopper only) and the row-parallel contract ------------------
def test_auto_never_picks_pull_off_a_hopper_gpu():
    assert not pull_runs_here()  # a CPU process
    for n in (2, 4, 8):
        for nbytes in (4, 16 << 10, PULL_MAX_BYTES, 4 << 20):
            assert auto_schedule(nbytes, n) != "pull"
    # where it runs, auto takes it for decode-sized payloads only
    assert auto_schedule(PULL_MAX_BYTES, 2, pull=True) == "pull"
    assert auto_schedule(PULL_MAX_BYTES + 4, 2, pull=True) == "exchange"
    assert auto_schedule(PULL_MAX_BYTES + 4, 4, pull=True) == "gather"


@pytest.mark.parametrize("call", ["tree_allreduce", "tree_allreduce_parts"])
def test_explicit_pull_off_a_hopper_gpu_is_refused_by_name(call):
    x = _spread(np.random.default_rng(0), (2, 16, 256))
    if call == "tree_allreduce":
        op = lambda a: tree_allreduce(a, "tp", algorithm="pull")  # noqa: E731
    else:
        op = lambda a: tree_allreduce_parts(a[None], "tp", algorithm="pull")  # noqa: E731
    with pytest.raises(ValueError, match="'pull' is a Mosaic GPU kernel for Hopper GPUs"):
        _run(op, x)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("algorithm", ["auto", "xla_auto", "exchange", "halving_ag"])
def test_parts_residual_and_padding_rows_keep_the_tree_bits(n, algorithm):
    """tree_allreduce_parts = the pull kernel's reference (allreduce_mosaic.reference): the
    groups of every device summed as one tree, the residual added as XLA adds it (bf16), rows
    past live_rows the residual's. The GPU tests hold the pull kernel to the same reference."""
    from pallas_kernels.allreduce_mosaic import reference

    rng = np.random.default_rng(n)
    rows, live, cols = 8, 5, 256
    for groups in (1, 2, 4):
        parts = _spread(rng, (n, groups, rows, cols))
        res = _spread(rng, (rows, cols)).astype(jnp.bfloat16)
        got = _run_parts(parts, res, live, algorithm)
        want = reference(list(parts), res, live)
        assert got.dtype == want.dtype == jnp.bfloat16
        for r in range(n):
            assert np.array_equal(got[r], want), f"device {r}, {groups} groups"
        plain = _run_parts(parts, None, None, algorithm)  # no residual, every row: f32
        assert all(np.array_equal(plain[r], reference(list(parts))) for r in range(n))
    # the reference is the plain tree: its groups, then the devices
    assert np.array_equal(reference(list(parts)), tree_sum_reference([_tree(p) for p in parts]))


def _tree(groups: np.ndarray) -> np.ndarray:
    return tree_sum_reference(list(groups))


def _run_parts(parts: np.ndarray, res, live, algorithm: str) -> np.ndarray:
    n = parts.shape[0]
    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))

    def body(p):
        residual = None if res is None else jnp.asarray(res)
        return tree_allreduce_parts(p[0], "tp", residual=residual, live_rows=live,
                                    algorithm=algorithm)[None]  # fmt: skip

    f = shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    return np.asarray(jax.jit(f)(parts))


def test_psum_parts_has_the_same_contract():
    rng = np.random.default_rng(5)
    parts = _spread(rng, (2, 1, 8, 256))
    res = _spread(rng, (8, 256)).astype(jnp.bfloat16)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
    f = shard_map(lambda p: psum_parts(p[0], "tp", residual=jnp.asarray(res), live_rows=5)[None],
                  mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))  # fmt: skip
    got = np.asarray(jax.jit(f)(parts))
    want = np.concatenate([res[:5] + (parts[0, 0, :5] + parts[1, 0, :5]).astype(res.dtype),
                           res[5:]])  # fmt: skip
    assert np.array_equal(got[0], want) and np.array_equal(got[1], want)


def test_the_pull_split_tiles_every_supported_range_exactly():
    from pallas_kernels.allreduce_mosaic import MAX_BLOCKS, MAX_TILE_UNITS, UNIT, split

    for units in range(1, 4097):
        s = split(units)
        if s is None:
            continue
        blocks, tile = s
        assert blocks * tile == units and blocks <= MAX_BLOCKS and tile <= MAX_TILE_UNITS
    for d in (1024, 4096, 8192):  # every decode size up to 64 rows of a model dimension fits
        for t in range(1, 65):
            assert split(t * d // UNIT) is not None, (t, d)
    assert split(16) == (16, 1)  # one 4096-wide row: 16 CTAs, not 2
    assert split(256) == (32, 8)


def test_the_pull_kernel_names_what_it_cannot_take():
    from pallas_kernels.allreduce_mosaic import unsupported

    assert unsupported((2, 64, 4096), jnp.float32, 2, ((64, 4096), jnp.bfloat16), 16) is None
    assert "power of two" in unsupported((3, 64, 4096), jnp.float32, 2)
    assert "power-of-two" in unsupported((1, 64, 4096), jnp.float32, 3)
    assert "float32, bfloat16 or float16" in unsupported((1, 64, 4096), jnp.int32, 2)
    assert "live rows" in unsupported((1, 64, 4096), jnp.float32, 2, None, 65)
    assert "whole 256s" in unsupported((1, 3, 40), jnp.float32, 2)
    assert "use an NCCL schedule" in unsupported((1, 4096, 8192), jnp.float32, 2)


@pytest.mark.parametrize(("n", "groups", "rows", "live", "res"), [
    (2, 1, 16, 16, None), (2, 2, 64, 16, jnp.bfloat16), (2, 2, 64, 1, jnp.bfloat16),
    (4, 2, 64, 32, jnp.bfloat16), (8, 1, 64, 64, None), (2, 1, 128, 106, jnp.float32),
])  # fmt: skip
def test_the_pull_kernel_lowers_for_cuda_on_a_cpu(n, groups, rows, live, res):
    """The Mosaic GPU lowering (layouts, remote refs, semaphores) runs in CI, without a GPU:
    what only compiles on a device is the PTX. One custom call, using XLA's collective
    metadata (the peers' addresses)."""
    from pallas_kernels.allreduce_mosaic import allreduce

    mesh = Mesh(np.array(jax.devices()[:n]), ("tp",))
    cols = 4096

    def body(p, *r):
        return allreduce(p[0], "tp", n, residual=r[0][0] if r else None, live=live)[None]

    args = [jax.ShapeDtypeStruct((n, groups, rows, cols), jnp.float32)]
    if res is not None:
        args.append(jax.ShapeDtypeStruct((n, rows, cols), res))
    f = shard_map(body, mesh=mesh, in_specs=tuple(P("tp") for _ in args), out_specs=P("tp"))
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "custom_call @mosaic_gpu" in ln]
    assert len(calls) == 1 and "uses_xla_collective_metadata = true" in calls[0]
