"""RoPE + K/V cache write + the query's tile layout in one kernel (pallas_kernels/rope_kv.py,
issue 11) against the XLA path it replaces: jdet/ops.py `apply_rope`, jdet/kv_cache.py
`write_kv` and the paged attention's own gather of q into its tiles.

CPU: the kernel in interpret mode (conftest sets JDET_PALLAS_INTERPRET=1), bitwise
(np.array_equal) on the query tiles, the whole K and V caches and the attention output, for the
fused q|k|v rows, for separate q, k, v and for Qwen3's (normed q|k rows, fused rows), with a
prefill chunk, decodes and padding tokens (slot -1) in one step; the model's forward with
`Ops.rope_kv` on = off. A check that the kernel lowers
to a Triton module (exported for 'cuda' on the CPU; ptxas is not run here). Negative controls: a
kernel writing one slot further, and one RoPE table entry changed, are seen by the same comparisons.
`gpu`: the compiled kernel against the XLA path, and the model's steps with the flag on vs off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jdet.batch import build_batch
from jdet.kv_cache import write_kv
from jdet.ops import apply_rope
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention_pallas import attention_meta
from pallas_kernels.rope_kv import rope_kv, rope_kv_reference

L, P, B = 3, 12, 4  # layers, pages, page size
PART = 8  # attention partition (tokens)


def _world(kh: int = 2, h: int = 6, e: int = 32, dtype=jnp.bfloat16, seed: int = 0):
    """Random fused rows (more rows than tokens, junk in the extra ones), caches full of junk,
    and a step holding a prefill chunk (5 tokens from position 3), two decodes and 2 padding
    tokens."""
    rng = np.random.default_rng(seed)
    seqs = [([1] * 5, 3, [4, 1]), ([1], 9, [2, 7, 0]), ([1], 6, [5, 9])]
    b, _ = build_batch(seqs, B, pad_tokens=9)
    b = jax.tree.map(jnp.asarray, b)
    t = b.token_ids.shape[0]
    qkv = jnp.asarray(rng.standard_normal((16, (h + 2 * kh) * e)), dtype)
    inv = 1.0 / (10000.0 ** (np.arange(0, e, 2) / e))
    fr = np.asarray(b.positions, np.float32)[:, None] * inv[None, :].astype(np.float32)
    emb = jnp.asarray(np.concatenate([fr, fr], -1), jnp.float32)
    cos, sin = jnp.cos(emb), jnp.sin(emb)
    shape = (L, kh, P, B, e)
    kc = jnp.asarray(rng.standard_normal(shape), dtype)
    vc = jnp.asarray(rng.standard_normal(shape), dtype)
    meta = attention_meta(b.page_table, b.context_lens, b.query_start, b.positions, t=t,
                          g=h // kh, num_pages=P, page_size=B, partition_size=PART)  # fmt: skip
    split = qkv[:t].reshape(t, h + 2 * kh, e)
    q, k, v = split[:, :h], split[:, h : h + kh], split[:, h + kh :]
    return dict(b=b, qkv=qkv, q=q, k=k, v=v, cos=cos, sin=sin, kc=kc, vc=vc, meta=meta, h=h)


@jax.jit
def _rope_and_write(q, k, v, cos, sin, kc, vc, layer, slots):
    qr, kr = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return qr, write_kv(kc, layer, kr, slots), write_kv(vc, layer, v, slots)


def _xla_path(w, layer: int):
    """What jdet/model.py does without the flag: apply_rope and write_kv, jitted as in the model
    (XLA CPU contracts x*cos + rot*sin into an FMA under jit, not op by op)."""
    return _rope_and_write(w["q"], w["k"], w["v"], w["cos"], w["sin"], w["kc"], w["vc"],
                           jnp.int32(layer), w["b"].slot_mapping)  # fmt: skip


def _tiles_of(qr, w) -> np.ndarray:
    """The attention kernel's own gather + transpose + pad of q[T, H, E] (as in
    _paged_attention_pallas)."""
    t, h, e = qr.shape
    nt, bq = w["meta"]["tok_c"].shape
    rows = w["meta"]["lim"].shape[1]
    kh = w["k"].shape[1]
    gp = rows // bq
    qg = jnp.pad(qr.reshape(t, kh, h // kh, e), ((0, 0), (0, 0), (0, gp - h // kh), (0, 0)))
    return np.asarray(qg[w["meta"]["tok_c"]].transpose(0, 2, 1, 3, 4).reshape(nt, kh, rows, e))


def _kernel(w, layer: int, source: str, slots=None, cos=None):
    if source == "normed":  # (q|k rows as rms_norm.head_rms_norm lays them out, fused rows)
        t, kh = w["q"].shape[0], w["k"].shape[1]
        qk = w["qkv"][:t].reshape(t, w["h"] + 2 * kh, -1)[:, : w["h"] + kh]
        src = (qk.reshape(t * (w["h"] + kh), -1), w["qkv"])
    else:
        src = w["qkv"] if source == "fused" else (w["q"], w["k"], w["v"])
    slots = w["b"].slot_mapping if slots is None else slots
    return rope_kv(src, w["cos"] if cos is None else cos, w["sin"], slots, w["kc"], w["vc"],
                   w["meta"]["tok_c"], layer=jnp.int32(layer), q_heads=w["h"],
                   rows=w["meta"]["lim"].shape[1])  # fmt: skip


def _attention(q, kc, vc, w, layer: int, q_heads=None) -> np.ndarray:
    b = w["b"]
    return np.asarray(paged_attention(
        q, kc, vc, b.page_table, b.context_lens, b.query_start, b.positions, scale=0.2,
        partition_size=PART, layer=jnp.int32(layer), meta=w["meta"], q_heads=q_heads,
    ))  # fmt: skip


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint16) if x.dtype.itemsize == 2 else x.view(np.uint32)


@pytest.mark.parametrize("source", ["fused", "split", "normed"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rope_kv_equals_the_xla_path(source, dtype):
    w = _world(dtype=dtype)
    for layer in (0, 2):
        qr, kc, vc = _xla_path(w, layer)
        tiles, kc2, vc2 = _kernel(w, layer, source)
        assert np.array_equal(_bits(tiles.tiles), _bits(_tiles_of(qr, w))), layer
        assert np.array_equal(_bits(kc2), _bits(kc)), layer
        assert np.array_equal(_bits(vc2), _bits(vc)), layer
        assert not np.array_equal(_bits(kc2), _bits(w["kc"]))  # it did write
        if dtype == jnp.bfloat16:  # the attention on the kernel's tiles = on q[T, H, E]
            got = _attention(tiles.tiles, kc2, vc2, w, layer, q_heads=w["h"])
            assert np.array_equal(got, _attention(qr, kc, vc, w, layer)), layer
        # the pure-jnp reference agrees: bitwise in bf16; in f32 to the rounding of one product
        # (XLA CPU contracts RoPE's product + sum into an FMA or not depending on the fusion
        # around it, so a separately compiled reference may differ in the last f32 bit)
        ref = jax.jit(rope_kv_reference, static_argnames="rows")(
            w["q"], w["k"], w["v"], w["cos"], w["sin"], w["b"].slot_mapping, w["kc"], w["vc"],
            w["meta"]["tok_c"], layer=jnp.int32(layer), rows=w["meta"]["lim"].shape[1],
        )  # fmt: skip
        for a, r in zip((tiles.tiles, kc2, vc2), ref, strict=True):
            if dtype == jnp.bfloat16:
                assert np.array_equal(_bits(a), _bits(r)), layer
            else:
                np.testing.assert_allclose(np.asarray(a), np.asarray(r), rtol=1e-6, atol=1e-6)


def test_negative_controls_are_seen():
    """A kernel that writes one slot further, or a RoPE table off in one entry, fails the
    comparisons the test above passes (so they can fail)."""
    w = _world()
    qr, kc, vc = _xla_path(w, 1)
    s = w["b"].slot_mapping
    shifted = jnp.where(s >= 0, s + 1, s)
    _, kc2, vc2 = _kernel(w, 1, "fused", slots=shifted)
    assert not np.array_equal(_bits(kc2), _bits(kc))
    assert not np.array_equal(_bits(vc2), _bits(vc))
    cos = w["cos"].at[0, 0].add(2.0**-6)  # one entry of the table, by a bf16 step of ~1
    tiles, kc3, _ = _kernel(w, 1, "fused", cos=cos)
    assert not np.array_equal(_bits(tiles.tiles), _bits(_tiles_of(qr, w)))
    assert not np.array_equal(_bits(kc3), _bits(kc))


def test_uint16_stored_cache_gets_the_same_bits():
    """The CPU's storage of a 16-bit cache (jdet/kv_cache.py) is bitcast around the kernel."""
    w = _world()
    _, kc, vc = _kernel(w, 2, "fused")
    u = {n: jax.lax.bitcast_convert_type(w[n], jnp.uint16) for n in ("kc", "vc")}
    _, ku, vu = _kernel({**w, **u}, 2, "fused")
    assert ku.dtype == jnp.uint16 and vu.dtype == jnp.uint16
    assert np.array_equal(np.asarray(ku), _bits(kc)) and np.array_equal(np.asarray(vu), _bits(vc))


def test_bad_shapes_are_refused():
    w = _world()
    with pytest.raises(ValueError, match="fused rows"):
        rope_kv(w["qkv"][:, :-1], w["cos"], w["sin"], w["b"].slot_mapping, w["kc"], w["vc"],
                w["meta"]["tok_c"], layer=jnp.int32(0), q_heads=w["h"], rows=64)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of kv heads"):
        rope_kv(w["qkv"], w["cos"], w["sin"], w["b"].slot_mapping, w["kc"], w["vc"],
                w["meta"]["tok_c"], layer=jnp.int32(0), q_heads=5, rows=64)  # fmt: skip
    w3 = _world(e=48)
    with pytest.raises(ValueError, match="power of two"):
        _kernel(w3, 0, "fused")


def test_rope_kv_lowers_to_a_triton_module(monkeypatch):
    """The kernel passes the Pallas Triton lowering (exported for 'cuda' on the CPU, at the
    Llama-3-8B decode shape), as one custom call that updates both caches in place."""
    import re

    from jax import export

    from pallas_kernels import _platform
    from pallas_kernels.rope_kv import _rope_kv

    monkeypatch.setattr(_platform, "interpret_default", lambda: False)
    kh, h, e, nt, bq = 8, 32, 128, 2, 16
    sd = jax.ShapeDtypeStruct
    cache = sd((2, kh, 64, 16, e), jnp.bfloat16)
    args = (sd((64, (h + 2 * kh) * e), jnp.bfloat16), sd((1, e), jnp.float32),
            sd((1, e), jnp.float32), sd((1,), jnp.int32), cache, cache, sd((nt, bq), jnp.int32),
            sd((), jnp.int32))  # fmt: skip

    def f(qkv, cos, sin, slots, kc, vc, tok_c, layer):
        return _rope_kv(qkv, cos, sin, slots, kc, vc, tok_c, layer, q_heads=h, rows=64,
                        num_warps=4)  # fmt: skip

    check = export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    exp = export.export(jax.jit(f), platforms=["cuda"], disabled_checks=[check])(*args)
    text = exp.mlir_module()
    calls = [ln for ln in text.splitlines() if "stablehlo.custom_call" in ln]
    assert len(calls) == 1 and "__gpu$xla.gpu.triton" in calls[0]
    assert 'name = "rope_kv_r64_e128"' in calls[0]
    aliased = re.findall(r"output_tuple_indices = \[(\d)\]", calls[0])
    assert sorted(aliased) == ["1", "2"]  # both caches, in place


# -- compiled on the GPU ---------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("source", ["fused", "split", "normed"])
def test_gpu_rope_kv_equals_the_xla_path(source):
    """Compiled Triton kernel vs XLA's fusions, bitwise (tiles, caches, attention output). If
    this fails on the tiles / K cache only, Triton and XLA contract RoPE's products and sums
    into FMAs differently (pallas_kernels/rope_kv.py docstring)."""
    w = _world(kh=8, h=32, e=128)
    for layer in (0, 2):
        qr, kc, vc = _xla_path(w, layer)
        tiles, kc2, vc2 = _kernel(w, layer, source)
        assert np.array_equal(_bits(vc2), _bits(vc)), layer
        assert np.array_equal(_bits(kc2), _bits(kc)), layer
        assert np.array_equal(_bits(tiles.tiles), _bits(_tiles_of(qr, w))), layer
        got = _attention(tiles.tiles, kc2, vc2, w, layer, q_heads=w["h"])
        assert np.array_equal(got, _attention(qr, kc, vc, w, layer)), layer
