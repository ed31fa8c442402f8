"""The model with `Ops.rope_kv` (RoPE + K/V write + the query's tile layout in one kernel,
pallas_kernels/rope_kv.py; issue 11) on vs off, bitwise, and the chunked-prefill invariance with it
on. CPU: every kernel in interpret mode (JDET_PALLAS_INTERPRET=1, the GPU's kernels), bf16
weights and a uint16-stored bf16 cache (jdet/kv_cache.py). Two layouts: Llama-style fused q|k|v
rows (the kernel reads the projection's rows in place) and the tiny Qwen3-style model (biases +
qk-norm: the kernel takes the normalised q, k, v). Negative control: the kernel fed slots shifted
by one (its writes miss the pages attention reads) changes the logits the comparisons see.
`gpu`: the compiled steps (prefill + greedy decodes, tokens and log-probs) flag on vs off.
`Ops.attn_direct_out` (the merge kernel writing the output rows itself) rides along.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.batch import build_batch
from jdet.kv_cache import init_kv_cache
from jdet.model import forward
from jdet.ops import Ops
from jdet.params import init_params
from jdet.plan import prepare_params
from tests.sharding.tiny import PAGE, prompts, tiny_cfg, tiny_params

T_PAD = 12  # every step padded to one token count: one compile per (ops, config)


@pytest.fixture
def interpret(monkeypatch):
    monkeypatch.setenv("JDET_PALLAS_INTERPRET", "1")


class _FastOps(Ops):
    """The invariant Ops with plain XLA matmuls and norms: only the attention and rope_kv (what
    the flag changes) run as interpreted Pallas kernels, which keeps the compiles CI-sized."""

    def matmul(self, x, w, out_dtype=None):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype or x.dtype)

    def row_matmul(self, x, w):
        return self.matmul(x, w)

    def rms_norm(self, x, w, eps, layer=None, **_):  # **_: e.g. `rows` (only a kernel's hint)
        w = w if layer is None else w[layer]
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
        return (y.astype(x.dtype) * w).astype(x.dtype)

    def residual_norm(self, x, a, w, norm_w, eps, layer, **_):
        x = x + self.row_matmul(a, w)
        return x, self.rms_norm(x, norm_w, eps, layer)


def _llama(ops_cls=_FastOps, **shape):
    cfg = tiny_cfg(model_type="llama", qkv_bias=False, o_bias=False, qk_norm=False,
                   num_layers=2, **shape)  # fmt: skip
    p = init_params(cfg, seed=0, dtype=jnp.bfloat16, scale=0.08)
    rng = np.random.default_rng(1)
    layers = {n: (jnp.asarray(1 + 0.2 * rng.standard_normal(a.shape), a.dtype)
                  if n.endswith("norm") else a) for n, a in p["layers"].items()}  # fmt: skip
    p = {**p, "layers": layers}
    return cfg, prepare_params(p, cfg, 1, fuse=True), ops_cls("tp", fused=True, untied=True)


def _qwen(ops_cls=_FastOps, **shape):
    cfg = tiny_cfg(num_layers=2, **shape)
    return cfg, tiny_params(cfg, dtype=jnp.bfloat16), ops_cls("tp")


_FORWARDS: dict = {}


def _fwd(ops: Ops, cfg):
    if (ops, cfg) not in _FORWARDS:
        _FORWARDS[(ops, cfg)] = jax.jit(lambda p, kv, b: forward(p, cfg, kv, b, ops))
    return _FORWARDS[(ops, cfg)]


def _run(ops: Ops, cfg, params, chunks: list[list[tuple[list[int], int, list[int]]]]):
    """Steps of (tokens, start, pages) per sequence on one fresh cache: (logits per step, kv)."""
    kv = init_kv_cache(cfg, 8, PAGE, jnp.bfloat16)
    out = []
    for seqs in chunks:
        b, _ = build_batch(seqs, PAGE, logits="all", pad_tokens=T_PAD, pad_seqs=2, pad_pages=3)
        kv, logits = _fwd(ops, cfg)(params, kv, jax.tree.map(jnp.asarray, b))
        out.append(np.asarray(logits)[: sum(len(t) for t, _, _ in seqs)])
    return out, kv


def _one_shot_and_chunked(ops, cfg, params):
    """Sequence X (9 tokens) prefilled alone in one step, and in two chunks (4 tokens batched
    with a 3-token sequence Y, then 5 tokens): X's logits rows of both."""
    x, y = prompts(cfg, (9, 3), seed=4)
    px, py = [5, 2, 0], [7, 6]  # physical pages, not in order
    (one,), _ = _run(ops, cfg, params, [[(x, 0, px)]])
    (c1, c2), _ = _run(ops, cfg, params, [[(y, 0, py), (x[:4], 0, px)], [(x[4:], 4, px)]])
    return one, np.concatenate([c1[3:], c2])


def _shifted(ops: Ops) -> Ops:
    """Control: `ops` whose kernel writes each token's K/V one slot further than attention
    reads."""

    class Shifted(type(ops)):
        def rope_kv_write(self, qkv, cos, sin, kv, layer, batch, meta, q_heads):
            s = batch.slot_mapping
            shifted = dataclasses.replace(batch, slot_mapping=jnp.where(s >= 0, s + 1, s))
            return super().rope_kv_write(qkv, cos, sin, kv, layer, shifted, meta, q_heads)

    return Shifted(**{f.name: getattr(ops, f.name) for f in dataclasses.fields(Ops)})


def _check_flag(cfg, params, ops) -> None:
    on = dataclasses.replace(ops, rope_kv=True)
    one_off, chunked_off = _one_shot_and_chunked(ops, cfg, params)
    one_on, chunked_on = _one_shot_and_chunked(on, cfg, params)
    assert np.isfinite(one_on).all()
    assert np.array_equal(one_on, one_off)  # flag on = off
    assert np.array_equal(chunked_on, chunked_off)
    assert np.array_equal(chunked_on, one_on)  # chunked = one-shot with the flag on
    # + the merge kernel writing the output rows itself (Ops.attn_direct_out)
    both = dataclasses.replace(on, attn_direct_out=True)
    one_both, chunked_both = _one_shot_and_chunked(both, cfg, params)
    assert np.array_equal(one_both, one_off) and np.array_equal(chunked_both, chunked_off)
    # control: a kernel writing one slot off is seen by the same comparisons
    bad = _shifted(on)
    one_bad, chunked_bad = _one_shot_and_chunked(bad, cfg, params)
    assert not np.array_equal(one_bad, one_off)
    assert not np.array_equal(chunked_bad, chunked_off)


@pytest.mark.slow  # ~45 CPU s per compile of the interpreted attention in the model, x6
@pytest.mark.parametrize("model", ["llama_fused", "qwen3"])
def test_rope_kv_flag_changes_no_bit_and_keeps_chunked_prefill_invariance(interpret, model):
    _check_flag(*(_llama() if model == "llama_fused" else _qwen()))


def test_flag_is_ignored_where_xla_fixed_attention_runs():
    """On a CPU without JDET_PALLAS_INTERPRET the Pallas attention does not run (no `meta`), so
    the flag changes nothing: the same executable's inputs, the same bits."""
    cfg, params, ops = _qwen()
    on = dataclasses.replace(ops, rope_kv=True)
    assert not on.fuses_rope_kv(None)
    seqs = [[(prompts(cfg, (5,), seed=1)[0], 0, [3, 1])]]
    (a,), _ = _run(ops, cfg, params, seqs)
    (b,), _ = _run(on, cfg, params, seqs)
    assert np.array_equal(a, b)


# -- compiled on the GPU ---------------------------------------------------------------------
GPU_SHAPE = dict(hidden_size=512, intermediate_size=1024, vocab_size=1024, num_heads=8,
                 num_kv_heads=2, head_dim=128)  # fmt: skip  # G = 4, E = 128: Llama-3-8B's


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["llama_fused", "qwen3"])
def test_gpu_rope_kv_flag_changes_no_bit_in_the_forward(model):
    """The compiled forward (every kernel the GPU's), logits of a one-shot and a chunked
    prefill: flag on = off, chunked = one-shot; the shifted-slot control differs."""
    build = _llama if model == "llama_fused" else _qwen
    _check_flag(*build(Ops, **GPU_SHAPE))


def _greedy(cfg, params, ops_kw: dict, steps: int = 6, num_pages: int | None = None,
            page_offset: int = 0, stale_page: int | None = None):  # fmt: skip
    """The engine's step function (sharding/tp.py make_tp_step at TP 1): a prefill of two
    prompts, then greedy decodes; tokens and log-probs of every step. `num_pages` sizes the pool
    (default: just what the prompts need), `page_offset` moves every page the sequences use up
    by that much, `stale_page` replaces the first sequence's first page in the decode steps' page
    table (a control: the decodes then read the wrong K/V)."""
    from jdet.sampling import SamplingInputs
    from sharding.mesh import make_tp_mesh
    from sharding.tp import init_tp_kv_cache, make_tp_step, shard_params
    from tests.sharding.tiny import pages_for

    mesh = make_tp_mesh(1)
    step = make_tp_step(cfg, "tp", mesh, **ops_kw)
    sp = shard_params(params, cfg, mesh)
    toks = prompts(cfg, (37, 5), seed=2)
    pages = pages_for([len(t) + steps for t in toks], 16)
    pages = [[p + page_offset for p in pp] for pp in pages]
    kv = init_tp_kv_cache(cfg, mesh, num_pages or sum(map(len, pages)), 16, jnp.bfloat16)
    decode_pages = [list(pp) for pp in pages]
    if stale_page is not None:
        decode_pages[0][0] = stale_page
    n = len(toks)
    pad = {"pad_tokens": 48, "pad_pages": max(len(p) for p in pages)}

    def sampling(pos):
        return SamplingInputs(temperature=np.zeros(n, np.float32), top_k=np.zeros(n, np.int32),
                              top_p=np.ones(n, np.float32), seed=np.arange(n, dtype=np.uint32),
                              position=np.asarray(pos, np.int32))  # fmt: skip

    b, _ = build_batch([(t, 0, p) for t, p in zip(toks, pages, strict=True)], 16, **pad)
    pos = [len(t) for t in toks]
    kv, out = step(sp, kv, b, sampling(pos))
    tokens, logprobs = [np.asarray(out.tokens)], [np.asarray(out.logprobs)]
    for _ in range(steps):
        b, _ = build_batch([([int(tokens[-1][i])], pos[i], decode_pages[i]) for i in range(n)], 16,
                           **pad)  # fmt: skip
        pos = [p + 1 for p in pos]
        kv, out = step(sp, kv, b, sampling(pos))
        tokens.append(np.asarray(out.tokens))
        logprobs.append(np.asarray(out.logprobs))
    return np.stack(tokens), np.stack(logprobs)


@pytest.mark.gpu
def test_gpu_rope_kv_flag_changes_no_bit_in_the_engine_step():
    """make_tp_step with rope_kv=1 and/or attn_direct_out=1 (what `decode_bench --variants
    rope_kv=1` runs) vs without: greedy tokens and log-probs bitwise, prefill + decodes,
    Llama-style (fused q|k|v)."""
    cfg = tiny_cfg(model_type="llama", qkv_bias=False, o_bias=False, qk_norm=False,
                   num_layers=2, **GPU_SHAPE)  # fmt: skip
    params = init_params(cfg, seed=0, dtype=jnp.bfloat16, scale=0.08)
    tok_off, lp_off = _greedy(cfg, params, {})
    for kw in ({"rope_kv": 1}, {"attn_direct_out": 1}, {"rope_kv": 1, "attn_direct_out": 1}):
        tok_on, lp_on = _greedy(cfg, params, kw)
        assert np.array_equal(tok_on, tok_off), kw
        assert np.array_equal(lp_on, lp_off), kw


@pytest.mark.gpu
def test_gpu_pool_pages_past_32_bit_element_offsets_give_the_same_bits():
    """A stacked K (or V) pool of more than 2**31 elements (4 GiB of bf16): Pallas's Triton
    lowering then addresses it with 64-bit offsets, so the engine need not cap its pool there.
    The same two sequences with their pages at the top of a 2.2 G-element pool (RoPE + K/V
    write, attention, all layers) give the tokens and log-probs of the small pool; the control
    (an unused, zero page in place of a written one in the decodes' page table) shows the
    comparison sees wrong K/V. (Swapping two written pages is no control: attention sums over the
    same keys either way, and did give the same bits.)"""
    cfg = tiny_cfg(model_type="llama", qkv_bias=False, o_bias=False, qk_norm=False,
                   num_layers=2, **GPU_SHAPE)  # fmt: skip
    params = init_params(cfg, seed=0, dtype=jnp.bfloat16, scale=0.08)
    per_page = cfg.num_layers * cfg.num_kv_heads * 16 * cfg.head_dim
    big = 2**31 // per_page + 64  # pages: the pool just over 2**31 elements
    assert big * per_page > 2**31
    tok, lp = _greedy(cfg, params, {})
    tok_hi, lp_hi = _greedy(cfg, params, {}, num_pages=big, page_offset=big - 16)
    assert np.array_equal(tok_hi, tok) and np.array_equal(lp_hi, lp)
    _, lp_bad = _greedy(cfg, params, {}, num_pages=big, page_offset=big - 16, stale_page=big - 1)
    assert not np.array_equal(lp_bad, lp), "swapped pages went unseen"
