"""The grouped matmul's launch choices (pallas_kernels/grouped_launch.py) never change a bit: a
narrower block_n, other warps or pipeline depth, and the tree's leaves split over programs
(k_split, their subtrees combined after the launch) give every row the default launch's bits,
in both Pallas kernels (interpret mode); the negative control (a launch that changed the plan:
the same K reduced as one sequential leaf instead of the tree) does change bits, asserted.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import grouped_launch as glaunch
from pallas_kernels import grouped_layout as gl
from pallas_kernels import grouped_matmul as gm
from pallas_kernels.grouped_slots import grouped_pallas_slots
from pallas_kernels.tree_matmul import tree_plan

G, K, N, PER_SRC = 4, 256, 200, 2


def _rand(seed: int, shape: tuple[int, ...]) -> jnp.ndarray:
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


X = _rand(1, (12, K))
WS = (_rand(2, (1, G, K, N)), _rand(3, (1, G, K, N)))  # stacks of one layer
LW = jnp.zeros((1,), jnp.int32)
PLAN = tree_plan(K, jnp.float32)  # 8 leaves of one 32-wide K step


def _tiles():
    ids = np.random.default_rng(4).integers(0, G, 24)
    ids[::5] = G  # rows left out
    return gl.group_tiles(jnp.asarray(ids, jnp.int32), G, 16)


def _rows(ws, *, tree: bool, live=None, **launch) -> list[np.ndarray]:
    """The row-order kernel's outputs (f32), K as the plan's tree or as one leaf."""
    t = _tiles()
    leaves = dict(leaf_k=PLAN.leaf_k, num_leaves=PLAN.num_leaves) if tree else dict(leaf_k=K,
                                                                                     num_leaves=1)
    outs = gm._grouped_pallas(X, ws, LW, t.tile_group, t.slot_row, t.row_slot, per_src=PER_SRC,
                              out_dtype=jnp.dtype(jnp.float32), live_n=live, **leaves, **launch)
    return [np.asarray(o) for o in outs]


def _slots(ws, **launch) -> list[np.ndarray]:
    t = _tiles()
    xs = gl.gather_rows(X, t, PER_SRC)
    outs = grouped_pallas_slots(xs, ws, LW, t.tile_group, leaf_k=PLAN.leaf_k,
                                num_leaves=PLAN.num_leaves, out_dtype=jnp.dtype(jnp.float32),
                                **launch)  # fmt: skip
    return [np.asarray(gl.scatter_rows(o, t)) for o in outs]


def _same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g).all() and g.any()
        assert np.array_equal(g, w)


@pytest.mark.parametrize("launch", [dict(block_n=64), dict(block_n=32, num_warps=8),
                                    dict(num_stages=2)], ids=["bn64", "bn32w8", "stages2"])
def test_a_narrower_block_n_or_other_warps_keep_the_bits(launch):
    """gate|up as a pair (one leaf) and a down tree, in the row-order and slot-order kernels;
    the pair with a zero column tail (live_n) too."""
    _same(_rows(WS, tree=False, **launch), _rows(WS, tree=False))
    tail = tuple(w.at[..., 130:].set(0.0) for w in WS)  # live_n's contract: zeros past it
    _same(_rows(tail, tree=False, live=130, **launch), _rows(tail, tree=False, live=130))
    _same(_rows(WS[:1], tree=True, **launch), _rows(WS[:1], tree=True))
    _same(_slots(WS[:1], **launch), _slots(WS[:1]))


@pytest.mark.parametrize("k_split", [2, 4, 8])
def test_leaves_split_over_programs_combine_to_the_same_bits(k_split):
    """Each program a whole subtree, combined by combine_tree after the launch; with a narrower
    block_n too. The tree's result in one program is the reference."""
    want = _rows(WS[:1], tree=True)
    _same(_rows(WS[:1], tree=True, k_split=k_split), want)
    _same(_rows(WS[:1], tree=True, k_split=k_split, block_n=64), want)
    _same(_rows(WS, tree=True, k_split=k_split), _rows(WS, tree=True))  # two weights


def test_negative_control_a_launch_that_changes_the_plan_changes_bits():
    """The same K as one sequential leaf instead of the 8-leaf tree: the check above sees it."""
    assert not np.array_equal(_rows(WS[:1], tree=False)[0], _rows(WS[:1], tree=True)[0])


def test_launches_that_would_change_the_plan_are_refused():
    with pytest.raises(ValueError, match="k_split"):
        _rows(WS[:1], tree=True, k_split=3)
    with pytest.raises(ValueError, match="k_split"):
        _rows(WS[:1], tree=False, k_split=2)  # one leaf: nothing to split
    with pytest.raises(ValueError, match="block_n"):
        _rows(WS[:1], tree=False, block_n=48)


def test_the_launch_follows_static_shapes_only(monkeypatch):
    fast = glaunch.Launch(block_n=64, k_split=4)
    monkeypatch.setattr(glaunch, "DEFAULTS", {"pair": (), "tree": ((256, fast),), "single": ()})
    assert glaunch.launch_for(128, 1, 8) == fast
    assert glaunch.launch_for(128, 1, 2).k_split == 2  # a TP shard's 2 leaves: capped
    assert glaunch.launch_for(256, 1, 8) == glaunch.Launch()
    assert glaunch.launch_for(128, 2, 1) == glaunch.Launch()


def test_launches_lower_to_triton_at_model_shapes(monkeypatch):
    """The Pallas Triton lowering (no ptxas) of the sweep's launches at Qwen3-30B-A3B's expert
    shapes, exported for 'cuda' on the CPU: the row-order pair at block_n 32 and 8 warps, the
    down tree with k_split 4 at block_n 64, the slot-order pair at block_n 64."""
    from jax import export

    from pallas_kernels import _platform

    monkeypatch.setattr(_platform, "interpret_default", lambda: False)
    g, d, f, bf = 128, 2048, 1024, jnp.bfloat16

    def moe(h, wg, wu, wd, ids, layer):
        tiles = gl.group_tiles(ids, g, 64)
        lay = (tiles.tile_group, tiles.slot_row, tiles.row_slot)
        gate, up = gm._grouped_pallas(h, (wg, wu), layer, *lay, per_src=8, leaf_k=d,
                                      num_leaves=1, out_dtype=jnp.dtype(bf), live_n=768,
                                      block_n=32, num_warps=8)  # fmt: skip
        act = (gate.astype(jnp.float32) * up).astype(bf)
        p = tree_plan(f, bf)
        (tree,) = gm._grouped_pallas(act, (wd,), layer, *lay, per_src=1, leaf_k=p.leaf_k,
                                     num_leaves=p.num_leaves, out_dtype=jnp.dtype(jnp.float32),
                                     live_k=768, k_split=4, block_n=64)  # fmt: skip
        gs, _ = grouped_pallas_slots(gl.gather_rows(h, tiles, 8), (wg, wu), layer,
                                     tiles.tile_group, leaf_k=d, num_leaves=1,
                                     out_dtype=jnp.dtype(bf), live_n=768, block_n=64)  # fmt: skip
        return tree, gs

    sd = jax.ShapeDtypeStruct
    args = (sd((16, d), bf), sd((2, g, d, f), bf), sd((2, g, d, f), bf), sd((2, g, f, d), bf),
            sd((128,), jnp.int32), sd((1,), jnp.int32))  # fmt: skip
    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    text = export.export(jax.jit(moe), platforms=["cuda"], disabled_checks=[check])(*args)
    calls = [ln for ln in text.mlir_module().splitlines() if "__gpu$xla.gpu.triton" in ln]
    assert len(calls) == 3


def test_the_default_launch_reaches_the_kernels_with_the_same_bits(monkeypatch):
    """grouped_matmul_pair and grouped_tree_matmul (backend 'pallas') under DEFAULTS that put a
    small step's gate|up in slot order at block_n 64 and its tree in 4 subtrees at block_n 32:
    the kernels the rules name run, and every row keeps the default launch's bits."""
    t = _tiles()
    w1, w2 = WS[0][0], WS[1][0]

    def both():
        pair = gm.grouped_matmul_pair(X, w1, w2, t, per_src=PER_SRC, backend="pallas")
        tree = gm.grouped_tree_matmul(X, w1, t, per_src=PER_SRC, backend="pallas")
        return [np.asarray(o) for o in (*pair, tree)]

    want = both()
    rules = {"pair": ((100, glaunch.Launch(order="slot", block_n=64)),),
             "tree": ((100, glaunch.Launch(k_split=4, block_n=32)),), "single": ()}
    monkeypatch.setattr(glaunch, "DEFAULTS", rules)
    _same(both(), want)
    jaxpr = str(jax.make_jaxpr(lambda x: gm.grouped_matmul_pair(x, w1, w2, t, per_src=PER_SRC,
                                                               backend="pallas"))(X))
    assert "grouped_matmul_pair_slots" in jaxpr
    with pytest.raises(ValueError, match="row-order"):
        glaunch.slot_order(glaunch.Launch(order="slot", k_split=2), 8, 256)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16])
def test_gpu_launches_keep_the_bits_at_model_shapes(monkeypatch, tokens):
    """Compiled, at Qwen3-30B-A3B's expert shapes (bf16, F padded to 1024, 768 live): a decode
    step's gate|up and down tree (8 rows in `row_tiles`, 128 rows of which 8 real in
    `group_tiles`) at the default launch and at narrower block_n, 8 warps, k_split and slot
    order; and the negative control: the down as one sequential leaf differs from the tree."""
    g, d, f, bf = 128, 2048, 1024, jnp.bfloat16
    rng = np.random.default_rng(7)
    wg, wu = (jnp.asarray(rng.standard_normal((g, d, f), np.float32) * 0.02, bf).at[..., 768:]
              .set(0) for _ in range(2))  # fmt: skip
    wd = jnp.asarray(rng.standard_normal((g, f, d), np.float32) * 0.02, bf).at[:, 768:].set(0)
    x = jnp.asarray(rng.standard_normal((tokens, d), np.float32), bf)
    ids = np.full(tokens * 8, g, np.int32)
    ids[:8] = rng.choice(g, 8, replace=False)
    tiles = gm.layout(jnp.asarray(ids), g)

    def run():
        gate, up = gm.grouped_matmul_pair(x, wg, wu, tiles, per_src=8, live_n=768)
        act = (gate.astype(jnp.float32) * up).astype(bf)
        down = gm.grouped_tree_matmul(act, wd, tiles, jnp.float32, live_k=768)
        return [np.asarray(o.astype(jnp.float32)) for o in (gate, up, down)], act

    want, act = run()
    L = glaunch.Launch
    for pair, tree in ((L(block_n=64), L(k_split=4)), (L(block_n=32, num_warps=8),
                       L(block_n=64, k_split=2)), (L(order="slot"), L(order="slot", block_n=64))):
        monkeypatch.setattr(glaunch, "DEFAULTS", {"pair": ((1024, pair),),
                                                  "tree": ((1024, tree),), "single": ()})
        got, _ = run()
        _same(got, want)
    bio = gm.grouped_matmul(act, wd, tiles, jnp.float32, live_k=768)
    assert not np.array_equal(np.asarray(bio)[:8], want[2][:8])
