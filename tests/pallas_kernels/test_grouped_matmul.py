"""grouped_matmul (mixture-of-experts experts): a row's bits do not depend on how many rows its
group (expert) serves, the layout puts every group on whole tiles, TP shards of K are whole
subtrees, and a grouped matmul whose K split follows the rows per group (the negative control)
does change bits. Both backends: the CPU path ('xla') and the Pallas kernel (interpret mode here:
the GPU path; its output buffers start as NaN, so a finite result proves every element written).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import grouped_matmul as gm
from pallas_kernels.combine import combine_tree

G, K, N = 4, 256, 40
BACKENDS = ["xla", "pallas"]


def _rand(seed: int, shape: tuple[int, ...]) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


W = _rand(0, (G, K, N))


def _run(x, ids, backend: str, fn=gm.grouped_matmul, w=W):
    tiles = gm.group_tiles(jnp.asarray(ids, jnp.int32), G, gm.tile_rows(backend))
    xs = gm.gather_rows(x, tiles)
    return np.asarray(gm.scatter_rows(fn(xs, w, tiles, backend=backend), tiles))


def _probe_and_crowd():
    """Three probe rows (groups 2, 0, 2), then a crowd in which group 2 serves 50 more rows."""
    probe = _rand(1, (3, K))
    probe_ids = [2, 0, 2]
    rng = np.random.default_rng(2)
    crowd = _rand(3, (70, K))
    crowd_ids = np.concatenate([np.full(50, 2), rng.integers(0, G, 20)])
    rng.shuffle(crowd_ids)
    x = jnp.concatenate([crowd[:31], probe, crowd[31:]])
    ids = np.concatenate([crowd_ids[:31], probe_ids, crowd_ids[31:]])
    return probe, probe_ids, x, ids


@pytest.mark.parametrize("fn", [gm.grouped_matmul, gm.grouped_tree_matmul], ids=["bio", "tree"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_row_bits_do_not_depend_on_rows_per_group(backend, fn):
    probe, probe_ids, x, ids = _probe_and_crowd()
    alone = np.stack([_run(probe[i : i + 1], probe_ids[i : i + 1], backend, fn)[0]
                      for i in range(3)])  # fmt: skip
    crowd = _run(x, ids, backend, fn)
    assert np.isfinite(crowd).all()
    assert np.array_equal(alone, crowd[31:34])
    ref = np.einsum("rk,rkn->rn", np.asarray(x, np.float64), np.asarray(W, np.float64)[ids])
    assert np.abs(crowd - ref).max() / np.abs(ref).max() < 1e-5


def _split_by_group_size(xs, w, tiles, backend=None):
    """Negative control: K split into 8 f32 partial sums when the row's group fills more than
    one tile, one dot otherwise (a kernel that picks split-K from the tokens per expert)."""
    del backend
    g = jnp.repeat(tiles.tile_group, tiles.block_m)
    wg = w[jnp.maximum(g, 0)]
    many = (tiles.group_sizes[jnp.maximum(g, 0)] > tiles.block_m)[:, None]
    whole = jnp.einsum("pk,pkn->pn", xs, wg, preferred_element_type=jnp.float32)
    parts = jnp.einsum("pck,pckn->pcn", xs.reshape(xs.shape[0], 8, -1),
                       wg.reshape(wg.shape[0], 8, -1, wg.shape[-1]),
                       preferred_element_type=jnp.float32)  # fmt: skip
    return jnp.where(many, _ordered_sum(parts, axis=1), whole)


def _ordered_sum(parts, axis: int):
    """The partial products summed last to first, behind an optimization barrier: XLA may not
    fold the partial dots and their sum back into one dot."""
    parts = lax.optimization_barrier(parts)
    n = parts.shape[axis]
    total = lax.index_in_dim(parts, n - 1, axis, keepdims=False)
    for c in range(n - 2, -1, -1):
        total = total + lax.index_in_dim(parts, c, axis, keepdims=False)
    return total


def test_negative_control_split_by_rows_per_group_changes_row_bits():
    probe, probe_ids, x, ids = _probe_and_crowd()
    alone = np.stack([_run(probe[i : i + 1], probe_ids[i : i + 1], "xla", _split_by_group_size)[0]
                      for i in range(3)])  # fmt: skip
    crowd = _run(x, ids, "xla", _split_by_group_size)
    assert not np.array_equal(alone, crowd[31:34]), "the control found no difference"


def test_layout_puts_each_group_on_whole_tiles_and_marks_the_empty_ones():
    ids = jnp.asarray([3, 1, 3, 3, 1, 0, 3, 3, 3, 3, 3, 3], jnp.int32)
    t = gm.group_tiles(ids, G, 4)
    tg = np.asarray(t.tile_group)
    assert tg.shape == (gm.num_tiles(12, G, 4),)
    # group 0: 1 row (1 tile), 1: 2 rows (1 tile), 2: none, 3: 9 rows (3 tiles); then unused
    assert tg.tolist() == [0, 1, 3, 3, 3, -1, -1]
    slot_row = np.asarray(t.slot_row)
    assert np.array_equal(slot_row[np.asarray(t.row_slot)], np.arange(12))
    # within a group the rows keep their order; empty slots hold the sentinel
    assert slot_row[8:12].tolist() == [0, 2, 3, 6]
    assert slot_row[1:4].tolist() == [12, 12, 12]
    assert np.asarray(t.group_sizes).tolist() == [4, 4, 0, 12]
    # an id of G or more leaves its row out: no slot, no tile, a zero output row
    t = gm.group_tiles(jnp.asarray([G, 1, G + 3, 1], jnp.int32), G, 4)
    assert np.asarray(t.tile_group).tolist()[:2] == [1, -1]
    assert np.asarray(t.row_slot).tolist() == [t.num_slots, 0, t.num_slots, 1]
    y = gm.scatter_rows(jnp.ones((t.num_slots, 3)), t)
    assert np.asarray(y).tolist() == [[0.0] * 3, [1.0] * 3, [0.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [2, 4])
def test_shard_subtrees_combine_to_the_full_tree(backend, c):
    _, _, x, ids = _probe_and_crowd()
    tiles = gm.group_tiles(jnp.asarray(ids, jnp.int32), G, gm.tile_rows(backend))
    xs = gm.gather_rows(x, tiles)
    full = gm.grouped_tree_matmul(xs, W, tiles, jnp.float32, backend=backend)
    ks = K // c
    parts = [
        gm.grouped_tree_partial(xs[:, i * ks : (i + 1) * ks], W[:, i * ks : (i + 1) * ks],
                                tiles, k_total=K, num_shards=c, backend=backend)
        for i in range(c)
    ]  # fmt: skip
    assert np.array_equal(np.asarray(combine_tree(parts)), np.asarray(full))


def test_pallas_kernel_skips_a_zero_tail_with_the_same_bits():
    """`live_n` / `live_k` (the plan's zero FFN padding): blocks past them are not read, and
    the products are bitwise those of the whole padded weight."""
    _, _, x, ids = _probe_and_crowd()
    tiles = gm.group_tiles(jnp.asarray(ids, jnp.int32), G, gm.tile_rows("pallas"))
    xs = gm.gather_rows(x, tiles)
    w = _rand(6, (G, K, 300)).at[:, :, 136:].set(0.0)  # columns past 136: 2 of 3 n blocks live
    full = gm.grouped_matmul(xs, w, tiles, backend="pallas")
    assert np.array_equal(np.asarray(gm.grouped_matmul(xs, w, tiles, backend="pallas",
                                                       live_n=136)), np.asarray(full))  # fmt: skip
    wk = W.at[:, 100:].set(0.0)  # rows past 100: tiles 4.. of the 8 leaves are zero
    full = gm.grouped_tree_matmul(xs, wk, tiles, backend="pallas")
    skip = gm.grouped_tree_matmul(xs, wk, tiles, backend="pallas", live_k=100)
    assert np.array_equal(np.asarray(skip), np.asarray(full))


def test_xla_ragged_dot_baseline_matches_the_reference():
    _, _, x, ids = _probe_and_crowd()
    tiles = gm.group_tiles(jnp.asarray(ids, jnp.int32), G, 8)
    xs = gm.gather_rows(x, tiles)
    a = np.asarray(gm.grouped_matmul_xla(xs, W, tiles))
    b = np.asarray(gm.grouped_matmul_reference(xs, W, tiles))
    assert np.abs(a - b).max() < 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [gm.grouped_matmul, gm.grouped_tree_matmul], ids=["bio", "tree"])
def test_gpu_kernel_row_bits_do_not_depend_on_rows_per_group_at_model_shapes(fn):
    """The compiled kernel (backend 'auto') at a Qwen3-30B-A3B expert's shapes, bf16: three
    probe rows alone vs among 600 rows, 500 of them routed to the probes' expert."""
    g, k, n = 128, 2048, 768
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((600, k), np.float32), jnp.bfloat16)
    ids = np.concatenate([np.full(500, 7), rng.integers(0, g, 100)]).astype(np.int32)
    rng.shuffle(ids)
    probe = [int(np.flatnonzero(ids == 7)[i]) for i in (0, 1, 2)]

    def run(rows):
        tiles = gm.group_tiles(jnp.asarray(ids[rows]), g, gm.tile_rows())
        out = fn(gm.gather_rows(x[np.asarray(rows)], tiles), w, tiles)
        return np.asarray(gm.scatter_rows(out, tiles).astype(jnp.float32))

    crowd = run(list(range(600)))
    alone = np.stack([run([p])[0] for p in probe])
    assert np.isfinite(crowd).all()
    assert np.array_equal(alone, crowd[probe])


def _split_by_group_size_per_tile(xs, w, tiles, backend=None):
    """`_split_by_group_size` per tile instead of per row (the weights gathered once a tile, so
    model shapes fit a GPU): K in 8 f32 partial sums, added last to first behind an
    optimization barrier, when the tile's group fills more than one tile. (A group's slots are
    its rows padded to whole tiles, so a lone row's group has block_m of them: a threshold
    below block_m would split the lone probes too, and alone and crowd would agree.)"""
    del backend
    t, bm = tiles.tile_group.shape[0], tiles.block_m
    g = jnp.maximum(tiles.tile_group, 0)
    wt, xt = w[g], xs.reshape(t, bm, -1)
    whole = jnp.einsum("tmk,tkn->tmn", xt, wt, preferred_element_type=jnp.float32)
    parts = jnp.einsum("tmck,tckn->tcmn", xt.reshape(t, bm, 8, -1),
                       wt.reshape(t, 8, -1, wt.shape[-1]),
                       preferred_element_type=jnp.float32)  # fmt: skip
    many = (tiles.group_sizes[g] > bm)[:, None, None]
    return jnp.where(many, _ordered_sum(parts, axis=1), whole).reshape(t * bm, -1)


@pytest.mark.gpu
def test_gpu_negative_control_split_by_rows_per_group_changes_row_bits_at_model_shapes():
    """The model-shape test's harness can fail: a kernel whose split of K follows the rows
    per group gives the probes other bits alone than among 500 rows of their expert."""
    with pytest.raises(AssertionError):
        test_gpu_kernel_row_bits_do_not_depend_on_rows_per_group_at_model_shapes(
            _split_by_group_size_per_tile
        )
