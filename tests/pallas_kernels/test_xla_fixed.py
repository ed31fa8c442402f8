"""The CPU fast path (`pallas_kernels.xla_fixed`, backend "xla"): accuracy against float64 / the
f32 references, and bitwise row invariance (np.array_equal) to the batch size M in
{1, 2, 3, 7, 16, 64, 512}, to column shards, to chunking, decode vs prefill and batch composition.

Negative controls: the same comparisons applied to a *variant* whose reduction order provably
depends on the batch (a K split, a sum chunking or a KV block size chosen from M / T) must report
a difference, so each comparison is shown to be able to fail on a CPU (where XLA's own ops can
happen to be invariant at these sizes).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _platform, kernel_backend
from pallas_kernels.matmul import matmul
from pallas_kernels.paged_attention import paged_attention, paged_attention_reference
from pallas_kernels.rms_norm import rms_norm, rms_norm_reference
from pallas_kernels.tree_matmul import combine_tree, tree_matmul, tree_matmul_partial
from pallas_kernels.vocab import log_softmax, log_softmax_reference, logsumexp
from pallas_kernels.xla_fixed import prefix_sum, sort_descending
from tests.pallas_kernels.test_paged_attention import assert_bits_equal, build_batch, make_world
from tests.pallas_kernels.variants import chunked_sum_by_rows, split_k_by_m

M_SIZES = (1, 2, 3, 7, 16, 64, 512)
XLA = {"backend": "xla"}


def _rand(key: int, shape: tuple[int, ...], dtype, scale: float = 1.0) -> jax.Array:
    """Normal samples made by numpy and cast there (ml_dtypes' bfloat16), then put on the device.
    Why not jax.random: on a CPU each new shape of jax.random.normal (and of its cast) is an XLA
    compile of its own (~0.3-1 s each, dozens in this module), for inputs any generator gives."""
    x = scale * np.random.default_rng(key).standard_normal(shape, np.float32)
    return jnp.asarray(x.astype(jnp.dtype(dtype)))


def _rel_err(out, ref) -> float:
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _rows_changed(f, x: jax.Array, sizes=M_SIZES) -> list[int]:
    """The M values at which f(x[:M]) differs bitwise from the rows of f(x[:max]). The rows are
    cut on the host: an eager slice of a device array is an XLA compile per M."""
    x = np.asarray(x)
    full = np.asarray(f(x[: max(sizes)]))
    return [m for m in sizes if not np.array_equal(np.asarray(f(x[:m])), full[:m])]


# -- matmul and tree matmul --------------------------------------------------------------------

MM = {"bio": functools.partial(matmul, backend="xla"),
      "tree": functools.partial(tree_matmul, backend="xla")}  # fmt: skip


@pytest.mark.parametrize("kind", list(MM))
@pytest.mark.parametrize(
    "dtype,k,n,tol", [(jnp.bfloat16, 192, 200, 1e-6), (jnp.float32, 100, 33, 1e-6)]
)
def test_xla_matmul_matches_float64(kind, dtype, k, n, tol):
    a, b = _rand(0, (70, k), dtype), _rand(1, (k, n), dtype)
    out = MM[kind](a, b, jnp.float32)
    assert out.shape == (70, n) and out.dtype == jnp.float32
    assert _rel_err(out, np.asarray(a, np.float64) @ np.asarray(b, np.float64)) < tol
    assert MM[kind](a, b).dtype == jnp.dtype(dtype)


@pytest.mark.parametrize("kind", list(MM))
@pytest.mark.parametrize("dtype,k,n", [(jnp.bfloat16, 256, 768), (jnp.float32, 768, 256)])
def test_xla_matmul_row_bits_do_not_depend_on_batch_size(kind, dtype, k, n):
    a, b = _rand(2, (512, k), dtype), _rand(3, (k, n), dtype, 0.1)
    assert _rows_changed(lambda x: MM[kind](x, b, jnp.float32), a) == []


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_xla_matmul_column_shard_bits_equal_the_whole_weight(dtype):
    """A TP column shard (N/2, N/8: narrower than a 128-column block) gives its columns' bits."""
    a, b = _rand(4, (7, 256), dtype), _rand(5, (256, 768), dtype, 0.1)
    full = np.asarray(matmul(a, b, jnp.float32, **XLA))
    for tp in (2, 8):
        w = 768 // tp
        part = np.asarray(matmul(a, b[:, w : 2 * w], jnp.float32, **XLA))
        assert np.array_equal(part, full[:, w : 2 * w]), f"column shard of TP={tp}"


@pytest.mark.parametrize("dtype,k", [(jnp.bfloat16, 1024), (jnp.float32, 768)])
def test_xla_pairwise_combination_of_shard_subtrees_equals_tree_matmul(dtype, k):
    a, b = _rand(6, (37, k), dtype), _rand(7, (k, 96), dtype, 0.1)
    full = np.asarray(tree_matmul(a, b, jnp.float32, **XLA))
    for c in (2, 4, 8):
        w = k // c
        parts = [
            tree_matmul_partial(a[:, i * w : (i + 1) * w], b[i * w : (i + 1) * w], k_total=k,
                                shard=i, num_shards=c, **XLA)  # fmt: skip
            for i in range(c)
        ]
        assert np.array_equal(np.asarray(combine_tree(parts)), full), f"C={c}"


def test_negative_control_a_split_k_chosen_from_m_changes_row_bits():
    a, b = _rand(2, (512, 256), jnp.float32), _rand(3, (256, 768), jnp.float32, 0.1)
    assert _rows_changed(lambda x: split_k_by_m(x, b), a) == [1, 2, 3, 7]


# -- RMSNorm and the vocabulary reductions -----------------------------------------------------


@pytest.mark.parametrize("dtype,d", [(jnp.bfloat16, 256), (jnp.float32, 1000)])
def test_xla_rms_norm_matches_reference_and_rows_are_invariant(dtype, d):
    x, w = _rand(8, (512, d), dtype), _rand(9, (d,), dtype)
    out = rms_norm(x, w, 1e-6, **XLA)
    assert out.dtype == jnp.dtype(dtype)
    ref = rms_norm_reference(x.astype(jnp.float32), w.astype(jnp.float32))
    assert _rel_err(out, ref) < (1e-6 if dtype == jnp.float32 else 1e-2)
    assert _rows_changed(lambda v: rms_norm(v, w, 1e-6, **XLA).astype(jnp.float32), x) == []


@pytest.mark.parametrize("v", [8192, 5000])
def test_xla_log_softmax_and_logsumexp_match_reference_and_rows_are_invariant(v):
    x = _rand(10, (512, v), jnp.float32, 4.0)
    assert _rel_err(log_softmax(x, **XLA), log_softmax_reference(x)) < 1e-6
    lse64 = np.log(np.exp(np.asarray(x, np.float64)).sum(-1))
    assert np.abs(np.asarray(logsumexp(x, **XLA)) - lse64).max() < 1e-5
    assert _rows_changed(lambda r: log_softmax(r, **XLA), x) == []
    assert _rows_changed(lambda r: logsumexp(r, **XLA), x) == []


@pytest.mark.parametrize("v", [8192, 283])
def test_xla_prefix_sum_matches_float64_and_rows_are_invariant(v):
    """The sampler's top-p cumulative mass on a CPU (jdet/sampling.py `_cumulative`)."""
    x = jnp.abs(_rand(12, (512, v), jnp.float32)) / v
    ref = np.cumsum(np.asarray(x, np.float64), axis=-1)
    assert _rel_err(prefix_sum(x), ref) < 1e-6
    # small integers: every partial sum is exact, so any order gives numpy's bits
    ints = np.random.default_rng(13).integers(0, 8, (3, v)).astype(np.float32)
    assert np.array_equal(np.asarray(prefix_sum(jnp.asarray(ints))), np.cumsum(ints, axis=-1))
    assert _rows_changed(jax.jit(prefix_sum), x) == []


def test_negative_control_a_prefix_block_chosen_from_the_row_count_changes_row_bits():
    x = jnp.abs(_rand(12, (512, 8192), jnp.float32)) / 8192
    changed = _rows_changed(jax.jit(lambda r: prefix_sum(r, 64 if r.shape[0] < 8 else 128)), x)
    assert changed == [1, 2, 3, 7], changed


def _sort_input() -> np.ndarray:
    """Logits as the sampler sorts them: -inf (masked), +-0, ties, +inf, a wide range."""
    rng = np.random.default_rng(14)
    x = (rng.standard_normal((5, 1000)) * 4).astype(np.float32)
    x[:, :100] = np.round(x[:, :100])
    for value, frac in ((-np.inf, 0.2), (0.0, 0.05), (-0.0, 0.05), (np.inf, 0.01)):
        x[rng.random(x.shape) < frac] = value
    return x


def test_sort_descending_gives_the_float_sorts_values():
    """The sampler's top-k/top-p sort on a CPU (jdet/sampling.py `_descending`)."""
    x = _sort_input()
    out = np.asarray(sort_descending(jnp.asarray(x)))
    assert np.array_equal(out, np.sort(x, axis=-1)[:, ::-1])
    assert np.array_equal(out, np.asarray(-jnp.sort(-jnp.asarray(x), axis=-1)))


def test_negative_control_raw_float_bits_as_keys_misorder_the_negatives():
    x = _sort_input()
    raw = np.sort(x.view(np.int32), axis=-1)[:, ::-1].copy().view(np.float32)
    assert not np.array_equal(raw, np.sort(x, axis=-1)[:, ::-1])


def test_negative_control_a_row_sum_chunked_by_row_count_changes_row_bits():
    x = _rand(11, (512, 8192), jnp.float32, 4.0)
    # jitted: one compile per M (eagerly, each of its ops compiled per M: ~140 compiles)
    changed = _rows_changed(jax.jit(chunked_sum_by_rows), x)
    assert changed and set(changed) <= {1, 2, 3, 7}, changed


# -- paged attention -----------------------------------------------------------------------------


def attend(w, args, **kw) -> np.ndarray:
    kw = {"scale": w.e**-0.5, "partition_size": w.part, "block_kv": w.block_kv, **XLA, **kw}
    return np.asarray(paged_attention(*args, **kw).astype(jnp.float32))


def run_chunked(w, seq: int, length: int, chunk: int, block_of=None) -> np.ndarray:
    """Rows 0..length-1 of `seq` prefilled `chunk` tokens per call; `block_of(n)` picks the KV
    block from the chunk length (the negative control's variant)."""
    outs = []
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        args, rows = build_batch(w, [(seq, start, n)], junk_seed=start + 1)
        kw = {} if block_of is None else {"block_kv": block_of(n)}
        outs.append(attend(w, args, **kw)[rows[0]])
    return np.concatenate(outs)


CONFIGS = {
    "gqa4_e64_f32": dict(kh=2, h=8, e=64, dtype=jnp.float32),
    "mqa_e128_bf16": dict(kh=1, h=4, e=128, dtype=jnp.bfloat16),
    "g3_e64_f32": dict(kh=2, h=6, e=64, dtype=jnp.float32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_xla_attention_matches_f32_reference_on_a_mixed_batch(name):
    cfg = CONFIGS[name]
    w = make_world(1, [75, 13, 40, 1], **cfg)
    args, rows = build_batch(w, [(0, 0, 75), (1, 12, 1), (2, 33, 7), (3, 0, 1)], t_pad=90, s_pad=6)
    out = attend(w, args)
    # jitted: eagerly each of its ops is an XLA compile of its own (~50 per call)
    ref = jax.jit(paged_attention_reference, static_argnames="scale")(*args, scale=w.e**-0.5)
    ref = np.asarray(ref.astype(jnp.float32))
    tol = 1e-5 if cfg["dtype"] == jnp.float32 else 2e-2
    for r in rows:
        assert _rel_err(out[r], ref[r]) < tol, (name, r)
    assert np.all(out[84:] == 0.0) and np.all(np.isfinite(out))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_xla_attention_rows_do_not_depend_on_chunking_decode_or_batch(dtype):
    w = make_world(2, [75, 30, 9], kh=2, h=8, e=64, dtype=dtype)
    whole = run_chunked(w, 0, 75, 75)
    # chunks 1 and 7 and the decodes are steps of one token group (T <= xla_attention.TB), whose
    # real tokens attend one at a time; 16, 64 and the whole run groups of TB tokens: both paths
    for chunk in (1, 7, 16, 64):
        assert_bits_equal(run_chunked(w, 0, 75, chunk), whole, f"chunk={chunk}")
    for p in (60, 74):  # decode beside another sequence, page table wider than needed
        args, r = build_batch(w, [(1, 29, 1), (0, p, 1)], pmax=16, s_pad=3, junk_seed=p)
        assert_bits_equal(attend(w, args)[r[1]], whole[p : p + 1], f"decode position {p}")
    entries = [(1, 0, 30), (0, 0, 75), (2, 0, 9)]
    args, rows = build_batch(w, entries, t_pad=130, s_pad=5, junk_seed=3)
    assert_bits_equal(attend(w, args)[rows[1]], whole, "in a batch")


def test_xla_attention_rows_do_not_depend_on_pages_or_padding_and_read_the_stacked_cache():
    w = make_world(5, [75, 20])
    entries = [(0, 20, 55), (1, 19, 1)]
    args, rows = build_batch(w, entries)
    ref = attend(w, args)
    perm = np.random.default_rng(0).permutation(w.num_pages)
    for kw in (dict(page_perm=perm), dict(t_pad=93, s_pad=5), dict(t_pad=64, pmax=16)):
        out = attend(w, build_batch(w, entries, junk_seed=7, **kw)[0])
        for r in rows:
            assert_bits_equal(out[r], ref[r], str(kw))
    q, k, v, *rest = args
    k_all, v_all = jnp.stack([k * 2, k]), jnp.stack([v, v * 3])
    for layer in range(2):
        got = attend(w, (q, k_all, v_all, *rest), layer=jnp.int32(layer))
        assert_bits_equal(got, attend(w, (q, k_all[layer], v_all[layer], *rest)), f"L{layer}")


def test_xla_attention_token_alone_equals_its_group_with_one_kv_head_per_device():
    """A TP shard's shape (one kv head, G = 2): a token attending alone (a one-group step) holds
    per-token state of 2 elements where the group's holds 16; the bits are the same."""
    w = make_world(3, [75], kh=1, h=2, e=64)
    whole = run_chunked(w, 0, 75, 75)
    assert_bits_equal(run_chunked(w, 0, 75, 1), whole, "chunk=1, one kv head")


def test_negative_control_a_kv_block_chosen_from_the_chunk_changes_the_bits():
    w = make_world(2, [75], kh=2, h=8, e=64)
    whole = run_chunked(w, 0, 75, 75, block_of=lambda n: 16)
    varied = run_chunked(w, 0, 75, 7, block_of=lambda n: 8 if n < 16 else 16)
    assert np.abs(varied - whole).max() < 1e-5
    assert (varied != whole).any()


# -- dispatch ------------------------------------------------------------------------------------


def test_cpu_dispatch_defaults_to_xla_and_the_env_var_restores_interpret_mode(monkeypatch):
    if _platform.platform() != "cpu":
        pytest.skip("backend dispatch on a CPU")
    monkeypatch.delenv(_platform.INTERPRET_ENV, raising=False)
    name = "xla-fixed-cpu" if _platform.small_row_blocks() else "xla-fixed-cpu/8-row"
    assert _platform.resolve(None, "k") == "xla" and kernel_backend() == name
    a, b = _rand(12, (5, 64), jnp.float32), _rand(13, (64, 40), jnp.float32)
    assert np.array_equal(np.asarray(matmul(a, b)), np.asarray(matmul(a, b, backend="xla")))
    monkeypatch.setenv(_platform.INTERPRET_ENV, "1")
    assert _platform.resolve("auto", "k") == "pallas"
    assert kernel_backend() == "pallas-interpret"
    with pytest.raises(ValueError, match="backend must be"):
        rms_norm(a, a[0], backend="triton")


# -- the CPU storage of a 16-bit KV cache (uint16, jdet/kv_cache.py) ------------------------------


def test_a_uint16_stored_cache_gives_the_bits_of_the_bf16_cache_in_every_attention_and_write():
    from jdet.kv_cache import write_kv
    from pallas_kernels.paged_attention import paged_attention_xla

    w = make_world(6, [40, 9], dtype=jnp.bfloat16)
    args, rows = build_batch(w, [(0, 0, 40), (1, 8, 1)], t_pad=48, s_pad=3)
    q, k, v, *rest = args
    k_all, v_all = jnp.stack([k, v]), jnp.stack([v, k])  # bf16 [L=2, K, P, B, E]
    bits = [jax.lax.bitcast_convert_type(c, jnp.uint16) for c in (k_all, v_all)]
    assert q.dtype == jnp.bfloat16 and bits[0].dtype == jnp.uint16
    one = jnp.int32(1)
    # xla_fixed (the CPU path); interpret mode bitcasts the whole cache back first (as_float)
    got = attend(w, (q, *bits, *rest), layer=one)
    assert_bits_equal(got, attend(w, (q, k_all, v_all, *rest), layer=one), "xla_fixed")
    plain = functools.partial(paged_attention_xla, scale=w.e**-0.5, layer=one)  # "none" off a GPU
    got, want = plain(q, *bits, *rest), plain(q, k_all, v_all, *rest)
    assert_bits_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)), "")
    new = _rand(14, (5, w.kh, w.e), jnp.bfloat16)
    slots = jnp.array([3, -1, 17, 8, 40], jnp.int32)
    got = write_kv(bits[0], one, new, slots)
    assert got.dtype == jnp.uint16
    want = write_kv(k_all, one, new, slots)
    assert np.array_equal(np.asarray(jax.lax.bitcast_convert_type(got, jnp.bfloat16)),
                          np.asarray(want), equal_nan=True)  # fmt: skip
    # a control that can fail: the same rows written as float16 are other bits
    assert not np.array_equal(np.asarray(write_kv(bits[0], one, new.astype(jnp.float16), slots)),
                              np.asarray(got))  # fmt: skip


def test_init_kv_cache_stores_16_bit_floats_as_uint16_on_a_cpu():
    from jdet.kv_cache import init_kv_cache, storage_dtype

    if _platform.platform() != "cpu":
        assert storage_dtype(jnp.bfloat16) == jnp.bfloat16
        return
    assert storage_dtype(jnp.bfloat16) == storage_dtype(jnp.float16) == jnp.uint16
    assert storage_dtype(jnp.float32) == jnp.float32
    from tests.sharding.tiny import BASE

    kv = init_kv_cache(BASE, 4, 16, jnp.bfloat16)
    assert kv["k"].dtype == kv["v"].dtype == jnp.uint16 and not np.asarray(kv["k"]).any()


# -- weights blocked once (xla_fixed.BlockedWeight; jdet/plan.py matmul_weights) ----------------


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_a_weight_blocked_once_gives_the_bits_of_the_array_in_bio_and_tree_plans(dtype):
    """The CPU "tp" runtime at TP 1 holds its weights as BlockedWeight; TP > 1 cuts them in the
    step: both must run the same dots. f32 weights with bf16 activations are the runtime's case."""
    from pallas_kernels.tree_matmul import tree_plan
    from pallas_kernels.xla_fixed import block_weight

    a = _rand(8, (37, 1024), dtype)
    w = _rand(9, (1024, 200), jnp.float32, 0.1)  # N not a multiple of the 128-column block
    plan = tree_plan(1024, jnp.float32)
    tree_blocked = block_weight(w, num_leaves=plan.num_leaves, leaf_k=plan.leaf_k)
    bio_blocked = block_weight(w, num_leaves=1, leaf_k=1024)
    assert tree_blocked.shape == bio_blocked.shape == (1024, 200)
    for m in (1, 8, 37):
        want = np.asarray(tree_matmul(a[:m], w, jnp.float32, **XLA))
        got = tree_matmul_partial(a[:m], tree_blocked, k_total=1024, shard=0, num_shards=1, **XLA)
        assert np.array_equal(np.asarray(got), want), f"tree, M={m}"
        want = np.asarray(matmul(a[:m], w, dtype, **XLA))
        assert np.array_equal(np.asarray(matmul(a[:m], bio_blocked, dtype, **XLA)), want)
    # control: the leaves paired otherwise ((l1 + l2) + ...: rotated, not mirrored, since a
    # mirrored tree adds the same pairs) are another sum, which the comparison sees
    from pallas_kernels.xla_fixed import BlockedWeight

    swapped = BlockedWeight(jnp.roll(tree_blocked.blocks, 1, axis=0), 1024, 200)
    got = tree_matmul_partial(a, swapped, k_total=1024, shard=0, num_shards=1, **XLA)
    assert not np.array_equal(np.asarray(got), np.asarray(tree_matmul(a, w, jnp.float32, **XLA)))


def test_a_weight_blocked_for_another_plan_is_refused_by_name():
    from pallas_kernels.xla_fixed import block_weight

    w = _rand(10, (512, 256), jnp.float32)
    bio = block_weight(w, num_leaves=1, leaf_k=512)
    with pytest.raises(ValueError, match="blocked as 1 leaves of 512"):
        tree_matmul(_rand(11, (8, 512), jnp.float32), bio, **XLA)


def _in_place(mm):
    """mm of x with layer `layer` of stacked blocked weights, read in place (a traced index)."""
    return jax.jit(lambda x, held, layer: mm(x, held.at_layer(layer), jnp.float32))


def test_bf16_weights_held_as_bits_in_groups_read_in_place_give_the_f32_blocks_bits():
    """jdet/plan.py holds blocked bf16 weights as their bits (uint16), widened to f32 a group of
    n blocks at a time, a stacked layer read in place (`at_layer`, a traced index): the dots must
    be exactly those of the f32 weight, for BIO (N = 1000: 8 blocks, 4 groups, the last one
    zero-padded) and tree plans (8 leaves, one block per group), and an LM-head-wide weight."""
    from pallas_kernels import xla_blocked
    from pallas_kernels.tree_matmul import tree_plan
    from pallas_kernels.xla_fixed import block_weight

    a = _rand(12, (37, 1024), jnp.bfloat16)
    for k, n, kind in ((256, 1000, "bio"), (1024, 256, "tree"), (256, 8192, "bio")):
        w = np.asarray(_rand(13 + k, (3, k, n), jnp.bfloat16, 0.1))  # 3 stacked layers
        plan = tree_plan(k, jnp.float32)
        leaves = (plan.num_leaves, plan.leaf_k) if kind == "tree" else (1, k)
        held = block_weight(w, num_leaves=leaves[0], leaf_k=leaves[1], compute=jnp.float32)
        assert held.blocks.dtype == jnp.uint16 and held.dtype == jnp.float32
        assert held.shape == (3, k, n) and held.at_layer(jnp.int32(1)).shape == (k, n)
        nb = held.blocks.shape[-3]
        assert xla_blocked.group_size(nb, leaves[0] * leaves[1] * 128 * 4) < nb  # grouped
        mm = MM[kind]
        layer_in_place = _in_place(mm)
        for layer in (0, 2):
            f32 = np.asarray(w[layer], np.float32)
            for m in (1, 8, 37):
                want = np.asarray(mm(a[:m, :k], f32, jnp.float32))
                got = layer_in_place(a[:m, :k], held, jnp.int32(layer))
                assert np.array_equal(np.asarray(got), want), (kind, k, n, layer, m)
        # control: the groups assembled out of order (n blocks rotated by one) are other
        # columns, which the comparison sees
        rolled = xla_blocked.BlockedWeight(jnp.roll(held.blocks, 1, axis=-3), k, n, "float32")
        got = layer_in_place(a[:8, :k], rolled, jnp.int32(2))
        assert not np.array_equal(np.asarray(got), np.asarray(mm(a[:8, :k], w[2], jnp.float32)))


def test_only_bf16_weights_are_held_as_bits_and_at_layer_needs_stacked_blocks():
    from pallas_kernels.xla_fixed import block_weight

    w16 = np.asarray(_rand(14, (256, 128), jnp.float16))
    with pytest.raises(ValueError, match="only bf16 weights are held as their bits"):
        block_weight(w16, num_leaves=1, leaf_k=256, compute=jnp.float32)
    one = block_weight(np.asarray(_rand(15, (256, 128), jnp.bfloat16)), num_leaves=1,
                       leaf_k=256, compute=jnp.float32)  # fmt: skip
    with pytest.raises(ValueError, match="at_layer needs stacked blocks"):
        one.at_layer(jnp.int32(0))


def test_ffn_padding_blocks_skipped_give_the_padded_weights_bits():
    """jdet/plan.py holds the padded FFN weights (F 768 -> 1024 for the TP tree) without the zero
    blocks past F (`live_n` for gate/up columns, `live_k` for down_proj's tree leaves): the
    products must be bitwise those of the padded f32 arrays, which TP > 1 runs whole. Random
    activations in the padded columns too (the kernel must not read them)."""
    from pallas_kernels.tree_matmul import tree_plan
    from pallas_kernels.xla_fixed import block_weight

    f, f_pad = 768, 1024
    gate = np.array(_rand(16, (3, 256, f_pad), jnp.bfloat16, 0.1))
    gate[..., f:] = 0
    down = np.array(_rand(17, (3, f_pad, 256), jnp.bfloat16, 0.1))
    down[..., f:, :] = 0
    plan = tree_plan(f_pad, jnp.float32)
    held = {
        "bio": block_weight(gate, num_leaves=1, leaf_k=256, compute=jnp.float32, live_n=f),
        "tree": block_weight(down, num_leaves=plan.num_leaves, leaf_k=plan.leaf_k,
                             compute=jnp.float32, live_k=f),
    }  # fmt: skip
    assert held["bio"].blocks.shape[-3] == f // 128 and held["bio"].shape == (3, 256, f_pad)
    assert held["tree"].blocks.shape[-4] == f // plan.leaf_k < plan.num_leaves
    for kind, w in (("bio", gate), ("tree", down)):
        k = w.shape[-2]
        a = _rand(18, (37, k), jnp.bfloat16)
        layer_in_place = _in_place(MM[kind])
        for layer in (0, 2):
            f32 = np.asarray(w[layer], np.float32)
            for m in (1, 8, 37):
                want = np.asarray(MM[kind](a[:m], f32, jnp.float32))
                got = layer_in_place(a[:m], held[kind], jnp.int32(layer))
                assert np.array_equal(np.asarray(got), want), (kind, layer, m)
    # control: the same skipping on a weight whose tail is not zero (cut by jnp, which cannot
    # check it) drops real blocks, and the comparison sees it
    down_full = _rand(19, (1024, 256), jnp.bfloat16, 0.1)
    skipped = block_weight(down_full, num_leaves=plan.num_leaves, leaf_k=plan.leaf_k, live_k=f)
    a = _rand(20, (8, 1024), jnp.bfloat16)
    want = MM["tree"](a, down_full.astype(jnp.float32), jnp.float32)
    got = MM["tree"](a, skipped, jnp.float32)
    assert not np.array_equal(np.asarray(got), np.asarray(want))
    # ... and a numpy weight whose skipped part is not zero is refused by name
    with pytest.raises(ValueError, match="are not zero"):
        block_weight(np.asarray(down_full), num_leaves=plan.num_leaves, leaf_k=plan.leaf_k,
                     live_k=f)  # fmt: skip
