"""grouped_matmul (mixture-of-experts experts): a row's bits do not depend on how many rows its
group (expert) serves nor on the layout (sorted or one row per tile), the layout puts every group
on whole tiles (by comparisons or by a sort: the same integers), TP shards of K are whole
subtrees, gate and up in one launch are each the single product's bits, and a grouped matmul
whose K split follows the rows per group (the negative control) does change bits. Both backends:
the CPU path ('xla') and the Pallas kernel (interpret mode here: the GPU path; its output buffers
start as NaN, so a finite result proves every element written).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from pallas_kernels import grouped_layout as gl
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.combine import combine_tree

G, K, N = 4, 256, 40
BACKENDS = ["xla", "pallas"]


def _rand(seed: int, shape: tuple[int, ...]) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


W = _rand(0, (G, K, N))


def _run(x, ids, backend: str, fn=gm.grouped_matmul, w=W, layout=gl.group_tiles):
    tiles = layout(jnp.asarray(ids, jnp.int32), G, gm.tile_rows(backend))
    return np.asarray(fn(x, w, tiles, backend=backend))


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


def _split_by_group_size(x, w, tiles, backend=None):
    """Negative control: K split into 8 f32 partial sums when the row's group fills more than
    one tile, one dot otherwise (a kernel that picks split-K from the tokens per expert)."""
    del backend
    xs = gl.gather_rows(x, tiles)
    g = jnp.repeat(tiles.tile_group, tiles.block_m)
    wg = w[jnp.maximum(g, 0)]
    many = (tiles.group_sizes[jnp.maximum(g, 0)] > tiles.block_m)[:, None]
    whole = jnp.einsum("pk,pkn->pn", xs, wg, preferred_element_type=jnp.float32)
    parts = jnp.einsum("pck,pckn->pcn", xs.reshape(xs.shape[0], 8, -1),
                       wg.reshape(wg.shape[0], 8, -1, wg.shape[-1]),
                       preferred_element_type=jnp.float32)  # fmt: skip
    return gl.scatter_rows(jnp.where(many, _ordered_sum(parts, axis=1), whole), tiles)


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
    t = gl.group_tiles(ids, G, 4)
    tg = np.asarray(t.tile_group)
    assert tg.shape == (gl.num_tiles(12, G, 4),)
    # group 0: 1 row (1 tile), 1: 2 rows (1 tile), 2: none, 3: 9 rows (3 tiles); then unused
    assert tg.tolist() == [0, 1, 3, 3, 3, -1, -1]
    slot_row = np.asarray(t.slot_row)
    assert np.array_equal(slot_row[np.asarray(t.row_slot)], np.arange(12))
    # within a group the rows keep their order; empty slots hold the sentinel
    assert slot_row[8:12].tolist() == [0, 2, 3, 6]
    assert slot_row[1:4].tolist() == [12, 12, 12]
    assert np.asarray(t.group_sizes).tolist() == [4, 4, 0, 12]
    # an id of G or more leaves its row out: no slot, no tile, a zero output row
    t = gl.group_tiles(jnp.asarray([G, 1, G + 3, 1], jnp.int32), G, 4)
    assert np.asarray(t.tile_group).tolist()[:2] == [1, -1]
    assert np.asarray(t.row_slot).tolist() == [t.num_slots, 0, t.num_slots, 1]
    y = gl.scatter_rows(jnp.ones((t.num_slots, 3)), t)
    assert np.asarray(y).tolist() == [[0.0] * 3, [1.0] * 3, [0.0] * 3, [1.0] * 3]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("c", [2, 4])
def test_shard_subtrees_combine_to_the_full_tree(backend, c):
    _, _, x, ids = _probe_and_crowd()
    tiles = gl.group_tiles(jnp.asarray(ids, jnp.int32), G, gm.tile_rows(backend))
    full = gm.grouped_tree_matmul(x, W, tiles, jnp.float32, backend=backend)
    ks = K // c
    parts = [
        gm.grouped_tree_partial(x[:, i * ks : (i + 1) * ks], W[:, i * ks : (i + 1) * ks],
                                tiles, k_total=K, num_shards=c, backend=backend)
        for i in range(c)
    ]  # fmt: skip
    assert np.array_equal(np.asarray(combine_tree(parts)), np.asarray(full))


def test_pallas_kernel_skips_a_zero_tail_with_the_same_bits():
    """`live_n` / `live_k` (the plan's zero FFN padding): blocks past them are not read, and
    the products are bitwise those of the whole padded weight."""
    _, _, x, ids = _probe_and_crowd()
    tiles = gl.group_tiles(jnp.asarray(ids, jnp.int32), G, gm.tile_rows("pallas"))
    w = _rand(6, (G, K, 300)).at[:, :, 136:].set(0.0)  # columns past 136: 2 of 3 n blocks live
    full = np.asarray(gm.grouped_matmul(x, w, tiles, backend="pallas"))
    assert np.isfinite(full).all() and np.abs(full[:, :136]).min() > 0
    skip = gm.grouped_matmul(x, w, tiles, backend="pallas", live_n=136)
    assert np.array_equal(np.asarray(skip), full)  # the skipped columns: zeros written
    pair = gm.grouped_matmul_pair(x, w, w, tiles, backend="pallas", live_n=136)
    assert all(np.array_equal(np.asarray(p), full) for p in pair)
    wk = W.at[:, 100:].set(0.0)  # rows past 100: tiles 4.. of the 8 leaves are zero
    for fn in (gm.grouped_tree_matmul, gm.grouped_matmul):
        full = fn(x, wk, tiles, backend="pallas")
        skip = fn(x, wk, tiles, backend="pallas", live_k=100)
        assert np.array_equal(np.asarray(skip), np.asarray(full))


def test_xla_ragged_dot_baseline_matches_the_reference():
    _, _, x, ids = _probe_and_crowd()
    tiles = gl.group_tiles(jnp.asarray(ids, jnp.int32), G, 8)
    a = np.asarray(gm.grouped_matmul_xla(x, W, tiles))
    b = np.asarray(gm.grouped_matmul_reference(x, W, tiles))
    assert np.abs(a - b).max() < 1e-4


@pytest.mark.parametrize("groups, block_m", [(4, 4), (128, 8), (128, 64)])
def test_comparison_layout_is_the_sorted_layout(groups, block_m):
    """group_tiles' two computations (comparisons up to COMPARE_MAX_ROWS rows, a sort beyond)
    give the same integers, rows left out included."""
    rng = np.random.default_rng(groups + block_m)
    by_comparison = jax.jit(gl._layout_by_comparison, static_argnums=(1, 2))
    by_sort = jax.jit(gl._layout_by_sort, static_argnums=(1, 2))
    for r in (1, 3, 40, gl.COMPARE_MAX_ROWS):
        ids = rng.integers(0, groups + 2, r).astype(np.int32)  # ids >= groups: left out
        ids[rng.random(r) < 0.5] = rng.integers(0, 3)  # a crowded group
        ids = jnp.minimum(jnp.asarray(ids), groups)
        a = by_comparison(ids, groups, block_m)
        b = by_sort(ids, groups, block_m)
        for name in ("slot_row", "row_slot", "tile_group", "group_sizes"):
            assert np.array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name))), (
                r, name)


def test_row_tiles_put_each_row_alone_in_its_tile():
    t = gl.row_tiles(jnp.asarray([3, G, 1, 3], jnp.int32), G, 4)
    assert not t.live_first
    assert np.asarray(t.tile_group).tolist() == [3, -1, 1, 3]
    assert np.asarray(t.row_slot).tolist() == [0, t.num_slots, 8, 12]
    assert np.asarray(t.slot_row).tolist() == [0, 4, 4, 4] + [4] * 4 + [2, 4, 4, 4, 3, 4, 4, 4]
    assert np.asarray(t.group_sizes).tolist() == [0, 4, 0, 8]
    with pytest.raises(ValueError, match="group_tiles"):  # the CPU path runs the leading tiles
        gm.grouped_matmul(_rand(7, (4, K)), W, gl.row_tiles(jnp.zeros(4, jnp.int32), G, 8),
                          backend="xla")  # fmt: skip


def test_layout_is_one_row_per_tile_only_for_few_rows_on_the_pallas_kernel():
    def lay(rows: int, backend: str) -> gl.GroupedTiles:  # traced only: the choice is static
        return jax.eval_shape(lambda i: gm.layout(i, 128, backend), jnp.zeros(rows, jnp.int32))

    assert not lay(8, "pallas").live_first  # 8 * 8 <= 2 * 128
    assert lay(17, "pallas").live_first
    assert lay(8, "xla").live_first  # the CPU path: always sorted
    assert lay(8, "pallas").block_m == gm.tile_rows("pallas")


@pytest.mark.parametrize("fn", [gm.grouped_matmul, gm.grouped_tree_matmul], ids=["bio", "tree"])
def test_row_bits_are_the_same_in_either_layout(fn):
    """The Pallas kernel's rows through `row_tiles` (each alone in a tile, a group's weight read
    once per row) and through `group_tiles` (crowded tiles): the same bits."""
    _, _, x, ids = _probe_and_crowd()
    ids = ids.copy()
    ids[::5] = G  # rows left out: zeros in both
    sorted_ = _run(x, ids, "pallas", fn)
    alone = _run(x, ids, "pallas", fn, layout=gl.row_tiles)
    assert np.isfinite(alone).all()
    assert np.array_equal(alone, sorted_)
    assert not np.abs(alone[::5]).any() and np.abs(alone[1::5]).min() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_gate_and_up_in_one_launch_are_the_single_products(backend):
    _, _, x, ids = _probe_and_crowd()
    w2 = _rand(8, (G, K, N))
    tiles = gl.group_tiles(jnp.asarray(ids, jnp.int32), G, gm.tile_rows(backend))
    a, b = gm.grouped_matmul_pair(x, W, w2, tiles, backend=backend)
    assert np.array_equal(np.asarray(a), np.asarray(gm.grouped_matmul(x, W, tiles,
                                                                      backend=backend)))
    assert np.array_equal(np.asarray(b), np.asarray(gm.grouped_matmul(x, w2, tiles,
                                                                      backend=backend)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_read_their_token_and_rows_left_out_are_zero(backend):
    """per_src = k: row t*k + j reads token t (the experts' gate/up read h directly); a token
    left out (id G: a step's padding) gives zero rows; every other row is the reference's."""
    k, tokens = 3, _rand(9, (11, K))
    ids = np.random.default_rng(10).integers(0, G, 11 * k).astype(np.int32)
    ids[6:9] = G  # token 2 left out
    tiles = gl.group_tiles(jnp.asarray(ids), G, gm.tile_rows(backend))
    y = np.asarray(gm.grouped_matmul(tokens, W, tiles, jnp.float32, per_src=k, backend=backend))
    ref = np.asarray(gm.grouped_matmul_reference(tokens, W, tiles, jnp.float32, per_src=k))
    assert not y[6:9].any()
    assert np.abs(y - ref).max() / np.abs(ref).max() < 1e-5
    with pytest.raises(ValueError, match="rows"):
        gm.grouped_matmul(tokens[:10], W, tiles, per_src=k, backend=backend)


def _both_kernels(x, ws, tiles, per_src, leaf_k, num_leaves, out_dtype, live_k=None,
                  live_n=None):  # fmt: skip
    """The same layout through the row-order kernel and the slot-order kernel (grouped_slots.py)
    -> (row order, slot order), each a tuple of [R, N] in row order."""
    from pallas_kernels.grouped_slots import grouped_pallas_slots

    lw = jnp.zeros((1,), jnp.int32)
    ws = tuple(w[None] for w in ws)
    kw = dict(leaf_k=leaf_k, num_leaves=num_leaves, out_dtype=jnp.dtype(out_dtype),
              live_k=live_k, live_n=live_n)  # fmt: skip
    rows = gm._grouped_pallas(x, ws, lw, tiles.tile_group, tiles.slot_row, tiles.row_slot,
                              per_src=per_src, **kw)  # fmt: skip
    xs = gl.gather_rows(x, tiles, per_src)
    slots = tuple(gl.scatter_rows(o, tiles)
                  for o in grouped_pallas_slots(xs, ws, lw, tiles.tile_group, **kw))  # fmt: skip
    return rows, slots


def test_slot_order_kernel_gives_the_row_order_kernels_bits():
    """Interpret mode: the kernel large steps run (grouped_slots.py) and the row-order kernel
    give every row the same bits (gate|up as a pair, a 4-leaf tree); rows left out are zeros."""
    from pallas_kernels.tree_matmul import tree_plan

    _, _, x, ids = _probe_and_crowd()
    ids = ids.copy()
    ids[::7] = G
    tiles = gl.group_tiles(jnp.asarray(np.repeat(ids, 2), jnp.int32), G, gm.tile_rows("pallas"))
    w2 = _rand(11, (G, K, N))
    a, b = _both_kernels(x, (W, w2), tiles, 2, K, 1, jnp.float32)
    plan = tree_plan(K, jnp.float32)
    assert plan.num_leaves > 1
    c, d = _both_kernels(x[: len(ids)].repeat(2, 0), (W,), tiles, 1, plan.leaf_k,
                         plan.num_leaves, jnp.float32)  # fmt: skip
    for got, want in zip(b + d, a + c, strict=True):
        got, want = np.asarray(got), np.asarray(want)
        assert np.isfinite(got).all() and not got[::14].any()
        assert np.array_equal(got, want)


def test_steps_of_many_rows_run_the_slot_order_kernel():
    """The choice is static (the row count): traced only."""
    from pallas_kernels.grouped_slots import SLOT_ORDER_MIN_ROWS

    def kernels(rows: int) -> str:
        def f(x, i):
            return gm.grouped_matmul(x, W, gl.group_tiles(i, G, 16), backend="pallas")

        return str(jax.make_jaxpr(f)(jnp.zeros((rows, K)), jnp.zeros(rows, jnp.int32)))

    assert "grouped_matmul_slots" in kernels(SLOT_ORDER_MIN_ROWS)
    assert "grouped_matmul_slots" not in kernels(SLOT_ORDER_MIN_ROWS - 1)


@pytest.mark.parametrize("tokens", [1, 64])
def test_grouped_kernels_lower_to_triton_at_model_shapes(monkeypatch, tokens):
    """The Pallas Triton lowering (what rejects a bad block shape, index or mask; no ptxas) of
    the gate|up pair, the down tree and a BIO down at another pipeline depth, at Qwen3-30B-A3B's
    expert shapes over a 2-layer stack, exported for 'cuda' on the CPU: one token's rows in
    `row_tiles`, 64 tokens' in `group_tiles`, where the slot-order kernel's gate|up and down
    are lowered too (tests/pallas_kernels/triton_export.py's way)."""
    from jax import export

    from pallas_kernels import _platform
    from pallas_kernels.tree_matmul import tree_plan

    monkeypatch.setattr(_platform, "interpret_default", lambda: False)
    g, d, f, bf = 128, 2048, 1024, jnp.bfloat16

    def moe(h, wg, wu, wd, ids, layer):
        tiles = (gl.row_tiles if tokens == 1 else gl.group_tiles)(ids, g, 64)
        lay = (tiles.tile_group, tiles.slot_row, tiles.row_slot)
        gate, up = gm._grouped_pallas(h, (wg, wu), layer, *lay, per_src=8, leaf_k=d,
                                      num_leaves=1, out_dtype=jnp.dtype(bf), live_n=768)
        act = (gate.astype(jnp.float32) * up).astype(bf)
        p = tree_plan(f, bf)
        (tree,) = gm._grouped_pallas(act, (wd,), layer, *lay, per_src=1, leaf_k=p.leaf_k,
                                     num_leaves=p.num_leaves, out_dtype=jnp.dtype(jnp.float32),
                                     live_k=768)
        (bio,) = gm._grouped_pallas(act, (wd,), layer, *lay, per_src=1, leaf_k=f, num_leaves=1,
                                    out_dtype=jnp.dtype(jnp.float32), live_k=768, num_stages=4)
        if tokens == 1:
            return tree + bio
        # the slot-order kernel (pallas_kernels/grouped_slots.py), gate|up and the down tree
        from pallas_kernels.grouped_slots import grouped_pallas_slots

        gs, us = grouped_pallas_slots(gl.gather_rows(h, tiles, 8), (wg, wu), layer,
                                      tiles.tile_group, leaf_k=d, num_leaves=1,
                                      out_dtype=jnp.dtype(bf), live_n=768)  # fmt: skip
        (ds,) = grouped_pallas_slots((gs.astype(jnp.float32) * us).astype(bf), (wd,), layer,
                                     tiles.tile_group, leaf_k=p.leaf_k, num_leaves=p.num_leaves,
                                     out_dtype=jnp.dtype(jnp.float32), live_k=768)  # fmt: skip
        return tree + bio + gl.scatter_rows(ds, tiles)

    sd = jax.ShapeDtypeStruct
    args = (sd((64, d), bf), sd((2, g, d, f), bf), sd((2, g, d, f), bf), sd((2, g, f, d), bf),
            sd((tokens * 8,), jnp.int32), sd((1,), jnp.int32))  # fmt: skip
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = export.export(jax.jit(moe), platforms=["cuda"], disabled_checks=[check])(*args)
    calls = [ln for ln in text.mlir_module().splitlines() if "__gpu$xla.gpu.triton" in ln]
    assert len(calls) == (3 if tokens == 1 else 5)


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
        tiles = gl.group_tiles(jnp.asarray(ids[rows]), g, gm.tile_rows())
        return np.asarray(fn(x[np.asarray(rows)], w, tiles).astype(jnp.float32))

    crowd = run(list(range(600)))
    alone = np.stack([run([p])[0] for p in probe])
    assert np.isfinite(crowd).all()
    assert np.array_equal(alone, crowd[probe])


def _split_by_group_size_per_tile(x, w, tiles, backend=None):
    """`_split_by_group_size` per tile instead of per row (the weights gathered once a tile, so
    model shapes fit a GPU): K in 8 f32 partial sums, added last to first behind an
    optimization barrier, when the tile's group fills more than one tile. (A group's slots are
    its rows padded to whole tiles, so a lone row's group has block_m of them: a threshold
    below block_m would split the lone probes too, and alone and crowd would agree.)"""
    del backend
    xs = gl.gather_rows(x, tiles)
    t, bm = tiles.tile_group.shape[0], tiles.block_m
    g = jnp.maximum(tiles.tile_group, 0)
    wt, xt = w[g], xs.reshape(t, bm, -1)
    whole = jnp.einsum("tmk,tkn->tmn", xt, wt, preferred_element_type=jnp.float32)
    parts = jnp.einsum("tmck,tckn->tcmn", xt.reshape(t, bm, 8, -1),
                       wt.reshape(t, 8, -1, wt.shape[-1]),
                       preferred_element_type=jnp.float32)  # fmt: skip
    many = (tiles.group_sizes[g] > bm)[:, None, None]
    out = jnp.where(many, _ordered_sum(parts, axis=1), whole).reshape(t * bm, -1)
    return gl.scatter_rows(out, tiles)


@pytest.mark.gpu
def test_gpu_negative_control_split_by_rows_per_group_changes_row_bits_at_model_shapes():
    """The model-shape test's harness can fail: a kernel whose split of K follows the rows
    per group gives the probes other bits alone than among 500 rows of their expert."""
    with pytest.raises(AssertionError):
        test_gpu_kernel_row_bits_do_not_depend_on_rows_per_group_at_model_shapes(
            _split_by_group_size_per_tile
        )


@pytest.mark.gpu
@pytest.mark.parametrize("fn", [gm.grouped_matmul, gm.grouped_tree_matmul], ids=["bio", "tree"])
def test_gpu_row_bits_are_the_same_in_either_layout_at_model_shapes(fn):
    """The compiled kernel at a Qwen3-30B-A3B expert's shapes, bf16: one decoding token's 8
    rows through `row_tiles` (the decode layout) and among 200 rows of `group_tiles`."""
    g, k, n = 128, 2048, 768
    rng = np.random.default_rng(6)
    w = jnp.asarray(rng.standard_normal((g, k, n), np.float32) * 0.02, jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((200, k), np.float32), jnp.bfloat16)
    ids = rng.integers(0, g, 200).astype(np.int32)
    ids[:8] = rng.permutation(g)[:8]  # one token's 8 distinct experts
    crowd = fn(x, w, gl.group_tiles(jnp.asarray(ids), g, gm.tile_rows()))
    alone = fn(x[:8], w, gl.row_tiles(jnp.asarray(ids[:8]), g, gm.tile_rows()))
    crowd = np.asarray(crowd.astype(jnp.float32))
    alone = np.asarray(alone.astype(jnp.float32))
    assert np.isfinite(crowd).all() and np.abs(alone).max() > 0
    assert np.array_equal(alone, crowd[:8])


@pytest.mark.gpu
def test_gpu_gate_and_up_in_one_launch_are_the_single_products_at_model_shapes():
    g, k, n = 128, 2048, 1024
    rng = np.random.default_rng(7)
    wg, wu = (jnp.asarray(rng.standard_normal((g, k, n), np.float32) * 0.02, jnp.bfloat16)
              for _ in range(2))  # fmt: skip
    h = jnp.asarray(rng.standard_normal((64, k), np.float32), jnp.bfloat16)
    ids = jnp.asarray(rng.integers(0, g, 64 * 8).astype(np.int32))
    tiles = gl.group_tiles(ids, g, gm.tile_rows())
    gate, up = gm.grouped_matmul_pair(h, wg, wu, tiles, per_src=8, live_n=768)
    for got, w in ((gate, wg), (up, wu)):
        one = gm.grouped_matmul(h, w, tiles, per_src=8, live_n=768)
        assert np.array_equal(np.asarray(got.astype(jnp.float32)),
                              np.asarray(one.astype(jnp.float32)))  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [32, 64, 512])
def test_gpu_slot_order_kernel_gives_the_row_order_kernels_bits_at_model_shapes(tokens):
    """The two compiled Pallas kernels (grouped_matmul.py picks by the step's rows) at
    Qwen3-30B-A3B's expert shapes, bf16, the "tp" plan's padded width: gate|up (K 2048, N 1024,
    768 live), the down tree and a BIO down (K 1024, 768 live): every row the same bits."""
    from pallas_kernels.tree_matmul import tree_plan

    g, d, f = 128, 2048, 1024
    rng = np.random.default_rng(8)

    def draw(shape, scale):
        return jnp.asarray(rng.standard_normal(shape, np.float32) * scale, jnp.bfloat16)

    wg, wu, wd = draw((g, d, f), 0.02), draw((g, d, f), 0.02), draw((g, f, d), 0.02)
    h = draw((tokens, d), 1.0)
    ids = rng.integers(0, g, tokens * 8).astype(np.int32)
    ids[5::13] = g  # rows left out
    tiles = gl.group_tiles(jnp.asarray(ids), g, gm.tile_rows())
    bf, f32 = jnp.bfloat16, jnp.float32
    rows, slots = _both_kernels(h, (wg, wu), tiles, 8, d, 1, bf, live_n=768)
    act = (rows[0].astype(f32) * rows[1].astype(f32)).astype(bf)
    p = tree_plan(f, bf)
    for leaf_k, leaves in ((p.leaf_k, p.num_leaves), (f, 1)):
        r, s = _both_kernels(act, (wd,), tiles, 1, leaf_k, leaves, f32, live_k=768)
        rows, slots = rows + r, slots + s
    for got, want in zip(slots, rows, strict=True):
        got, want = np.asarray(got.astype(f32)), np.asarray(want.astype(f32))
        assert np.isfinite(got).all() and not got[5::13].any() and np.abs(got).max() > 0
        assert np.array_equal(got, want)
