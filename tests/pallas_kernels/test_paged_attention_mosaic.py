"""The Mosaic GPU looped paged attention (pallas_kernels/paged_attention_mosaic.py) on a CPU.

CI cannot run Mosaic GPU kernels; it checks what a CPU can: the Pallas -> Mosaic GPU lowering
(layouts, barriers, TMA copies; only the PTX compilation needs a device) and, marked slow, the
kernel's pipeline and plan under Mosaic GPU's interpreter (wgmma replaced by plain dots there,
so these bits are not the GPU's): looped == split, one-shot == ragged chunks == single decodes
through the split path on a stacked cache at layer 1 with permuted pages, and controls that
must differ (another block_kv; the merge folding partitions in decreasing order). The same
checks compiled on Hopper: test_paged_attention_mosaic_gpu.py; speed:
benchmarks/attention_mosaic.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

PAGE = 16


def _lower(f, *args) -> str:
    try:
        from jax.experimental.pallas import mosaic_gpu  # noqa: F401
    except ImportError as exc:  # pragma: no cover - a JAX without Mosaic GPU
        pytest.skip(f"no Mosaic GPU Pallas in this JAX: {exc}")
    return jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _shapes(n: int, h: int, kh: int, e: int, layers: int | None):
    s = jax.ShapeDtypeStruct
    pool = (kh, n // PAGE + 2, PAGE, e) if layers is None else (layers, kh, n // PAGE + 2, PAGE, e)
    return (s((n, h, e), jnp.bfloat16), s(pool, jnp.bfloat16), s(pool, jnp.bfloat16),
            s((1, n // PAGE), jnp.int32), s((1,), jnp.int32), s((2,), jnp.int32),
            s((n,), jnp.int32))  # fmt: skip


@pytest.mark.parametrize(("block_kv", "consumers", "layers", "structure"),
                         [(64, 1, 2, "looped"), (128, 2, None, "looped"), (64, 1, 2, "split")])
def test_the_mosaic_kernel_lowers_for_cuda_on_a_cpu(block_kv, consumers, layers, structure):
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    e = 128

    def f(q, k, v, pt, lens, qs, pos):
        layer = None if layers is None else jnp.int32(layers - 1)
        return paged_attention_mosaic(q, k, v, pt, lens, qs, pos, scale=e**-0.5,
                                      partition_size=256, layer=layer, block_kv=block_kv,
                                      consumers=consumers, structure=structure)  # fmt: skip

    text = _lower(f, *_shapes(512, 32, 8, e, layers))
    launches = 2 if structure == "split" else 1  # split: the partials, then the merge
    assert sum("custom_call @mosaic_gpu" in ln for ln in text.splitlines()) == launches


def test_auto_splits_only_the_smallest_decode_bucket():
    from pallas_kernels.paged_attention_mosaic import launch_plan
    from pallas_kernels.paged_attention_mosaic_decode import auto_structure

    assert auto_structure(1, (1, 512), 8, 4, 128, 16, 256) == "split"  # B 1 ctx 8k
    assert auto_structure(16, (16, 512), 8, 4, 128, 16, 256) == "split"  # the 16-token bucket
    assert auto_structure(32, (32, 64), 8, 4, 128, 16, 256) == "looped"  # B 32 ctx 1k
    assert auto_structure(512, (256, 512), 8, 4, 128, 16, 256) == "looped"  # a prompt chunk
    assert auto_structure(8192, (1, 512), 8, 4, 128, 16, 256) == "looped"  # prefill 8k
    # a decode bucket whose partials pass the cap: looped
    assert auto_structure(16, (4096, 8192), 8, 4, 128, 16, 256) == "looped"
    # the launch: one consumer split, two looped (query tiles of 64 rows per consumer)
    assert launch_plan(16, (16, 512), 8, 4, 128, 16, 256) == ("split", 1)
    assert launch_plan(8192, (1, 512), 8, 4, 128, 16, 256) == ("looped", 2)


def test_the_tma_probe_lowers_for_cuda_on_a_cpu():
    from benchmarks.paged_tma_probe import attention

    n, h, kh, e = 256, 8, 2, 128
    s = jax.ShapeDtypeStruct
    args = (s((n, h, e), jnp.bfloat16), s((kh, n // PAGE, PAGE, e), jnp.bfloat16),
            s((kh, n // PAGE, PAGE, e), jnp.bfloat16), s((n // PAGE,), jnp.int32))  # fmt: skip
    text = _lower(lambda q, k, v, pt: attention(q, k, v, pt, block_kv=64, steps=2, paged=True),
                  *args)  # fmt: skip
    assert "mosaic_gpu" in text


def _case(n: int, h: int, kh: int, e: int):
    k = jax.random.split(jax.random.PRNGKey(n), 4)
    pps = n // PAGE
    kc = jax.random.normal(k[0], (kh, pps + 2, PAGE, e), jnp.bfloat16)
    vc = jax.random.normal(k[1], (kh, pps + 2, PAGE, e), jnp.bfloat16)
    pt = (jax.random.permutation(k[2], pps) + 2)[None].astype(jnp.int32)
    q = jax.random.normal(k[3], (n, h, e), jnp.bfloat16)
    return (q, kc, vc, pt, jnp.array([n], jnp.int32), jnp.array([0, n], jnp.int32),
            jnp.arange(n, dtype=jnp.int32))  # fmt: skip


@pytest.mark.slow
def test_the_interpreted_kernel_is_accurate_and_chunks_give_the_one_shot_bits():
    """Two partitions of one block each (pages permuted), G = 4: allclose to the reference, and
    the rows of two ragged chunks in one batch equal the one-shot rows; the control (XLA's
    attention) differs."""
    from pallas_kernels.paged_attention import paged_attention_reference, paged_attention_xla
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    n, e = 96, 64
    args = q, kc, vc, pt, _, _, _ = _case(n, 4, 1, e)
    kw = dict(scale=e**-0.5, partition_size=64, block_kv=64, interpret=True)
    full = paged_attention_mosaic(*args, **kw)
    ref = paged_attention_reference(*args, scale=e**-0.5)
    np.testing.assert_allclose(np.asarray(full, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2, rtol=2e-2)  # fmt: skip
    c = 37
    chunks = paged_attention_mosaic(q, kc, vc, jnp.repeat(pt, 2, axis=0),
                                    jnp.array([c, n], jnp.int32), jnp.array([0, c, n], jnp.int32),
                                    jnp.arange(n, dtype=jnp.int32), **kw)  # fmt: skip
    bits = np.asarray(full).view(np.uint16)
    assert np.array_equal(np.asarray(chunks).view(np.uint16), bits)
    xla = np.asarray(paged_attention_xla(*args, scale=e**-0.5)).view(np.uint16)
    assert not np.array_equal(xla, bits)


# The interpreter's split layout: (n, partitions of 64 with blocks of 64): 3 partitions, the
# last partial; chunks ending on and beside block/partition edges (sizes 1, 15, 16, 17, ...)
N, PS = 130, 64
CHUNKS = [1, 15, 16, 17, 14, 1, 1, 62, 1, 1, 1]


def _mosaic(**kw):
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    e = 64
    kw = dict(scale=e**-0.5, partition_size=PS, block_kv=64, layer=jnp.int32(1),
              interpret=True) | kw  # fmt: skip
    return lambda *args: paged_attention_mosaic(*args, **kw)


@pytest.fixture(scope="module")
def split_case():
    from tests.pallas_kernels import mosaic_bits as mb

    case = mb.stacked_case(N, 4, 1, 64)
    return case, mb.bits(mb.one_shot(_mosaic(structure="split"), case, N))


@pytest.mark.slow
def test_interpreted_split_is_the_looped_kernel_and_reversed_merge_differs(split_case):
    """One prefill (3 partitions) through the split pair equals the looped kernel bitwise and
    is accurate; the merge folding partitions in decreasing order gives other bits."""
    from pallas_kernels.paged_attention import paged_attention_reference
    from tests.pallas_kernels import mosaic_bits as mb

    case, split = split_case
    assert np.array_equal(mb.bits(mb.one_shot(_mosaic(structure="looped"), case, N)), split)
    ref = mb.one_shot(lambda q, k, v, *a: paged_attention_reference(q, k[1], v[1], *a,
                                                                    scale=64**-0.5), case, N)
    np.testing.assert_allclose(split.view(jnp.bfloat16).astype(np.float32),
                               np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)  # fmt: skip
    rev = mb.bits(mb.one_shot(_mosaic(structure="split", reverse_merge=True), case, N))
    assert not np.array_equal(rev, split)


@pytest.mark.slow
def test_interpreted_split_chunks_and_decodes_give_the_one_shot_bits(split_case):
    """Ragged chunks and single-token decodes (contexts ending on and beside block/partition
    edges) in one batch through the split pair: the one-shot rows, bitwise."""
    from tests.pallas_kernels import mosaic_bits as mb

    case, split = split_case
    pos = mb.boundary_positions(N, 64, PS)
    chunks, decs = mb.chunked_and_decodes(_mosaic(structure="split"), case, CHUNKS, pos)
    assert np.array_equal(mb.bits(chunks), split)
    assert np.array_equal(mb.bits(decs), split[pos])


@pytest.mark.slow
def test_interpreted_block_kv_is_part_of_the_plan(split_case):
    """Control: blocks of 128 (the same partitions of 128) give other bits than blocks of 64."""
    from tests.pallas_kernels import mosaic_bits as mb

    case, _ = split_case
    b64, b128 = (mb.bits(mb.one_shot(_mosaic(structure="looped", partition_size=128, block_kv=bk),
                                     case, N)) for bk in (64, 128))  # fmt: skip
    assert not np.array_equal(b64, b128)


def test_jdet_attention_mosaic_names_the_backend_and_picks_the_family(monkeypatch):
    """JDET_ATTENTION=mosaic on Hopper (faked here): the backend's kernel name changes (so the
    fingerprint and the executable keys do), the invariant modes run the Mosaic family at every
    step, "none" at steps its looped launch runs; without it, or off Hopper, the Triton kernel."""
    from jdet.ops import Ops
    from pallas_kernels import _platform

    monkeypatch.delenv(_platform.ATTENTION_ENV, raising=False)
    assert not _platform.backend().mosaic_attention  # this CPU
    monkeypatch.setenv(_platform.ATTENTION_ENV, "mosaic")
    assert not _platform.backend().mosaic_attention  # still a CPU: not Hopper
    monkeypatch.setattr(_platform, "platform", lambda: "gpu")
    monkeypatch.setattr(_platform, "is_hopper", lambda: True)
    on = _platform.backend()
    assert on.hopper and on.mosaic_attention and on.kernels != "mosaic-gpu"
    assert Ops().attn_kernel(16) == Ops(invariance="batch").attn_kernel(8192) == "mosaic"
    assert Ops(invariance="none").attn_kernel(16) == "triton"
    assert Ops(invariance="none").attn_kernel(32) == "mosaic"
    monkeypatch.delenv(_platform.ATTENTION_ENV)
    off = _platform.backend()
    assert off.hopper and not off.mosaic_attention and off.kernels == "mosaic-gpu"
    assert Ops().attn_kernel(8192) == "triton"
