"""The decode step's launch savings (issue 11) change no bit.

jdet/model.py hoists per-step work out of the layer scan and carries the residual stream padded
to the matmuls' CTA rows on Hopper:
- `Ops.attention_meta`: the paged-attention kernel's batch-derived operands, computed once per
  step instead of once per layer (`meta=`), and the attention's output rows padded for the next
  matmul (`out_rows=`);
- the norm kernel reads layer l's weight out of the stacked [L, D] norm weights (`layer=`);
- `Ops.row_pad`: the rows the residual stream carries (T elsewhere than Hopper);
- `Ops.residual_norm`: o_proj's tree combine, the residual add and the MLP norm in one kernel
  (`rms_norm.add_rms_norm`) where the tree matmul runs on Hopper's Mosaic kernel.
Each is checked bitwise against the plain call, on the Pallas kernels in interpret mode (the
same kernels the GPU compiles) and, for the row padding, through the whole model. Negative
controls show each comparison detects a one-ulp change.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.batch import build_batch
from jdet.model import forward
from jdet.ops import Ops
from jdet.plan import Plan
from tests.sharding.tiny import PAGE, pages_for, prompts, tiny_cfg, tiny_params


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("JDET_PALLAS_INTERPRET", "1")


def _bump(a: np.ndarray) -> np.ndarray:
    """a with one element moved by one ulp."""
    b = np.array(a, copy=True)
    bits = b.reshape(-1).view(np.uint16 if b.dtype.itemsize == 2 else np.uint32)
    bits[0] += 1  # the next representable value away from zero
    return b


# -- RMSNorm with the stacked weights -------------------------------------------------------------
@pytest.mark.parametrize("d", [64, 96])  # 96: ragged lanes (block_d 128)
def test_stacked_norm_weight_equals_the_sliced_row(interpret, d):
    from pallas_kernels import rms_norm

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((5, d)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal((4, d)), jnp.bfloat16)
    for layer in range(4):
        got = np.asarray(rms_norm(x, w, 1e-6, layer=jnp.int32(layer)))
        want = np.asarray(rms_norm(x, w[layer], 1e-6))
        assert np.array_equal(got, want), layer
    # control: a one-ulp change of that layer's row shows up
    w2 = jnp.asarray(_bump(np.asarray(w[2])))
    assert not np.array_equal(
        np.asarray(rms_norm(x, w, 1e-6, layer=jnp.int32(2))), np.asarray(rms_norm(x, w2, 1e-6))
    )


def test_stacked_norm_weight_is_checked():
    from pallas_kernels import rms_norm

    x = jnp.zeros((2, 8), jnp.float32)
    with pytest.raises(ValueError, match=r"w\[L, D\]"):
        rms_norm(x, jnp.zeros((8,), jnp.float32), layer=jnp.int32(0))


# -- combine + residual add + RMSNorm in one kernel ----------------------------------------------
def _add_norm_inputs(t: int, d: int, groups: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.bfloat16)
    parts = jnp.asarray(0.5 * rng.standard_normal((groups, t, d)), jnp.float32)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal((3, d)), jnp.bfloat16)
    return x, parts, w


def _add_norm_unfused(x, parts, w, layer: int):
    """The three-step path: tree combine + cast (tree_matmul), residual add (XLA), norm."""
    from pallas_kernels import rms_norm
    from pallas_kernels.combine import combine_tree

    r = x + combine_tree(list(parts)).astype(x.dtype)
    return np.asarray(r), np.asarray(rms_norm(r, w, 1e-6, layer=jnp.int32(layer)))


def _check_add_norm(t: int, d: int, groups: int) -> None:
    from pallas_kernels.rms_norm import add_rms_norm

    x, parts, w = _add_norm_inputs(t, d, groups)
    for layer in (0, 2):
        r, h = add_rms_norm(x, parts, w, 1e-6, layer=jnp.int32(layer))
        want_r, want_h = _add_norm_unfused(x, parts, w, layer)
        assert np.array_equal(np.asarray(r), want_r), (groups, layer)
        assert np.array_equal(np.asarray(h), want_h), (groups, layer)
    # control: the comparison sees a change of one part's element (by one bf16 step of x's scale)
    p2 = parts.at[0, 0, 0].add(2.0 ** -6)
    bumped = np.asarray(add_rms_norm(x, p2, w, 1e-6, layer=jnp.int32(0))[0])
    assert not np.array_equal(bumped, _add_norm_unfused(x, parts, w, 0)[0])


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_add_rms_norm_equals_combine_add_norm(interpret, groups):
    _check_add_norm(5, 96, groups)  # 96: ragged lanes (block_d 128)


def test_add_rms_norm_is_checked():
    from pallas_kernels.rms_norm import add_rms_norm

    x, parts, w = _add_norm_inputs(3, 8, 2)
    with pytest.raises(ValueError, match=r"parts\[G, T, D\]"):
        add_rms_norm(x, parts[:, :2], w, 1e-6, layer=jnp.int32(0))


def test_residual_norm_fusion_only_without_a_cross_device_combine():
    from sharding.tp import make_tp_ops

    assert make_tp_ops("tp", 1).fuse_residual_norm  # the engine's runtime at TP = 1
    assert not make_tp_ops("tp", 2).fuse_residual_norm


# -- paged attention with hoisted operands and padded output rows ----------------------------------
def _attention_inputs(dtype=jnp.bfloat16):
    rng = np.random.default_rng(1)
    L, K, P, B, E, H = 3, 2, 12, 4, 32, 8
    k = jnp.asarray(rng.standard_normal((L, K, P, B, E)), dtype)
    v = jnp.asarray(rng.standard_normal((L, K, P, B, E)), dtype)
    # a prefill chunk (5 tokens from position 3) and two decodes, plus 2 padding tokens
    seqs = [([1] * 5, 3, [4, 1]), ([1], 9, [2, 7, 0]), ([1], 6, [5, 9])]
    b, _ = build_batch(seqs, B, pad_tokens=9)
    q = jnp.asarray(rng.standard_normal((9, H, E)), dtype)
    return q, k, v, b


_META_STATIC = ("t", "g", "num_pages", "page_size", "partition_size", "block_rows")


def test_attention_meta_and_out_rows_change_no_bit(interpret):
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.paged_attention_pallas import attention_meta

    q, k, v, b = _attention_inputs()
    args = (q, k, v, b.page_table, b.context_lens, b.query_start, b.positions)
    # once for every layer, as the model does; jitted, as in the model's step (run eagerly its
    # small integer ops compiled one by one: ~50 compiles on a CPU)
    meta = jax.jit(attention_meta, static_argnames=_META_STATIC)(
        b.page_table, b.context_lens, b.query_start, b.positions, t=9, g=4, num_pages=12,
        page_size=4, partition_size=8,
    )  # fmt: skip
    for layer in (0, 2):
        kw = dict(scale=0.2, partition_size=8, layer=jnp.int32(layer))
        plain = np.asarray(paged_attention(*args, **kw))
        hoisted = np.asarray(paged_attention(*args, **kw, meta=meta, out_rows=64))
        assert hoisted.shape == (64, 8, 32)
        assert np.array_equal(hoisted[:9], plain), layer
        assert not hoisted[9:].any()  # the padding rows the next matmul wants are zeros
    # control: the comparison sees a change of one query element (a one-ulp change of a bf16
    # query can round away in the bf16 output)
    q2 = q.at[0, 0, 0].add(0.5)
    changed = np.asarray(paged_attention(q2, *args[1:], **kw))
    assert not np.array_equal(changed, plain)


def test_attention_meta_of_another_layout_is_refused(interpret):
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.paged_attention_pallas import attention_meta

    q, k, v, b = _attention_inputs()
    meta = jax.jit(attention_meta, static_argnames=_META_STATIC)(
        b.page_table, b.context_lens, b.query_start, b.positions, t=9, g=2, num_pages=12,
        page_size=4, partition_size=8,
    )  # fmt: skip
    with pytest.raises(ValueError, match="attention_meta"):
        paged_attention(q, k, v, b.page_table, b.context_lens, b.query_start, b.positions,
                        scale=0.2, partition_size=8, layer=jnp.int32(0), meta=meta)  # fmt: skip


# -- the whole model with the residual stream padded --------------------------------------------
def _model_logits(ops: Ops, cfg, params, dtype=jnp.float32) -> np.ndarray:
    toks = prompts(cfg, (7, 3), seed=3)
    pages = pages_for([len(t) for t in toks])
    b, _ = build_batch([(t, 0, p) for t, p in zip(toks, pages, strict=True)], PAGE,
                       logits="all", pad_tokens=12)  # fmt: skip
    kv_shape = (cfg.num_layers, cfg.num_kv_heads, sum(map(len, pages)), PAGE, cfg.head_dim)
    kv = {"k": jnp.zeros(kv_shape, dtype), "v": jnp.zeros(kv_shape, dtype)}
    b = jax.tree.map(jnp.asarray, b)
    _, logits = _jit_forward(ops, cfg)(params, kv, b)
    return np.asarray(logits)


_FORWARDS: dict = {}


def _jit_forward(ops: Ops, cfg):
    """One compiled forward per (ops, cfg, interpret mode): the control reuses the plain one's
    executable (the kernels a forward traces depend on JDET_PALLAS_INTERPRET)."""
    key = (ops, cfg, os.environ.get("JDET_PALLAS_INTERPRET"))
    if key not in _FORWARDS:
        _FORWARDS[key] = jax.jit(lambda p, kv, b: forward(p, cfg, kv, b, ops))
    return _FORWARDS[key]


class _PaddedOps(Ops):
    """Ops whose residual stream is padded as on Hopper (row_pad is T off Hopper)."""

    def row_pad(self, t: int) -> int:
        return -(-t // 64) * 64


def test_padded_residual_stream_changes_no_bit():
    mode = "tp"  # "batch" runs the same model code with a BIO o/down projection
    cfg = tiny_cfg()
    params = tiny_params(cfg)
    ops = Plan(cfg, mode).ops()
    plain = _model_logits(ops, cfg, params)
    padded = _model_logits(_PaddedOps(mode, attn_partition=ops.attn_partition), cfg, params)
    assert np.array_equal(plain, padded)
    # control: a one-ulp change of one layer's attention-norm weight is seen
    layers = dict(params["layers"])
    layers["attn_norm"] = jnp.asarray(_bump(np.asarray(layers["attn_norm"])))
    bumped = _model_logits(ops, cfg, {**params, "layers": layers})
    assert not np.array_equal(plain, bumped)


class _FoldOps(Ops):
    """Ops that fold down_proj's combine + add into the next layer's norm off Hopper too (there
    `residual_norm` is its unfused fallback, so only the model's restructured scan is tested)."""

    def fold_down_norm(self) -> bool:
        return True


class _MisfoldOps(_FoldOps):
    """Control: the fold normalising with layer l's own weight instead of layer l+1's."""


def test_down_norm_fold_changes_no_bit(monkeypatch):
    mode = "tp"
    cfg = tiny_cfg(num_layers=3)
    params = tiny_params(cfg)  # random per-layer norm weights: a misindexed fold shows
    ops = Plan(cfg, mode).ops()
    assert not ops.fold_down_norm()  # off the Mosaic kernel the plain model runs
    plain = _model_logits(ops, cfg, params)
    folded = _model_logits(_FoldOps(mode, attn_partition=ops.attn_partition), cfg, params)
    assert np.array_equal(plain, folded)
    import jdet.model

    monkeypatch.setattr(jdet.model.jnp, "roll", lambda a, shift, axis: a)
    misfolded = _model_logits(_MisfoldOps(mode, attn_partition=ops.attn_partition), cfg, params)
    assert not np.array_equal(plain, misfolded)


# -- compiled on the GPU ---------------------------------------------------------------------
class _UnfusedOps(Ops):
    """The step as it was: no hoisted attention operands, no padded residual stream (and, with
    fuse_residual_norm=False, o_proj's combine + residual add + norm as three steps)."""

    def attention_meta(self, batch, kv, q_heads):
        return None

    def row_pad(self, t: int) -> int:
        return t


@pytest.mark.gpu
def test_gpu_kernels_with_hoisted_operands_change_no_bit():
    from pallas_kernels import rms_norm
    from pallas_kernels.paged_attention import paged_attention
    from pallas_kernels.paged_attention_pallas import attention_meta

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((16, 4096)), jnp.bfloat16)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal((3, 4096)), jnp.bfloat16)
    for layer in range(3):
        got = np.asarray(rms_norm(x, w, 1e-5, layer=jnp.int32(layer)))
        assert np.array_equal(got, np.asarray(rms_norm(x, w[layer], 1e-5)))
    q, k, v, b = _attention_inputs()
    args = (q, k, v, b.page_table, b.context_lens, b.query_start, b.positions)
    meta = attention_meta(b.page_table, b.context_lens, b.query_start, b.positions, t=9, g=4,
                          num_pages=12, page_size=4, partition_size=8)  # fmt: skip
    for layer in range(3):
        kw = dict(scale=0.2, partition_size=8, layer=jnp.int32(layer))
        plain = np.asarray(paged_attention(*args, **kw))
        hoisted = np.asarray(paged_attention(*args, **kw, meta=meta, out_rows=64))
        assert np.array_equal(hoisted[:9], plain) and not hoisted[9:].any()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["tp", "batch"])
def test_gpu_padded_step_equals_the_unfused_step(mode):
    """bf16 on the GPU (Mosaic matmuls on Hopper): row padding + hoisted operands = the old step."""
    cfg = tiny_cfg(hidden_size=256, intermediate_size=1024, vocab_size=1024, num_layers=3)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params(cfg))
    ops = Plan(cfg, mode).ops()
    new = _model_logits(ops, cfg, params, jnp.bfloat16)
    unfused = _UnfusedOps(mode, attn_partition=ops.attn_partition, fuse_residual_norm=False)
    old = _model_logits(unfused, cfg, params, jnp.bfloat16)
    assert np.array_equal(new, old)
    layers = dict(params["layers"])  # control: a one-ulp change of a norm weight is seen
    layers["mlp_norm"] = jnp.asarray(_bump(np.asarray(layers["mlp_norm"])))
    bumped = _model_logits(ops, cfg, {**params, "layers": layers}, jnp.bfloat16)
    assert not np.array_equal(new, bumped)


@pytest.mark.gpu
def test_gpu_add_rms_norm_equals_combine_add_norm():
    for groups in (1, 2, 8):
        _check_add_norm(64, 4096, groups)


@pytest.mark.gpu
def test_gpu_residual_norm_fusion_changes_no_bit():
    """The Llama-shaped step with and without the fused combine + add + norm (decode, T = 1
    padded to 64 rows, and a 300-token prefill whose tree runs whole in registers: G = 1)."""
    cfg = tiny_cfg(hidden_size=512, intermediate_size=1024, vocab_size=1024, num_layers=2)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), tiny_params(cfg))
    ops = Plan(cfg, "tp").ops()
    assert ops.fuse_residual_norm
    assert ops.fold_down_norm()  # the default: down_proj's combine folded into the next norm too
    from pallas_kernels.tree_matmul import tree_matmul_parts

    wo = params["layers"]["wo"][0]
    assert tree_matmul_parts(jnp.ones((64, wo.shape[0]), jnp.bfloat16), wo) is not None
    new = _model_logits(ops, cfg, params, jnp.bfloat16)
    old = _model_logits(dataclasses.replace(ops, fuse_residual_norm=False), cfg, params,
                        jnp.bfloat16)  # fmt: skip
    assert np.array_equal(new, old)
