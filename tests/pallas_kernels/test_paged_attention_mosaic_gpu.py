"""The Mosaic GPU paged attention family compiled on Hopper (`-m gpu`): the bit invariance the
engine needs before it can be wired into `Ops` (docs/PREFILL_ATTENTION.md, "How the bits are
shown equal").

One sequence (3 partitions and a partial one at PS 256; pages permuted; a stacked cache read at
layer 1) scored one-shot by the looped kernel (one and two consumer warpgroups) and by the
split pair; as ragged chunks (sizes 1, 15, 16, 17, 255, 256, 257, random) in one batch; and as
single-token decodes at contexts ending on and beside block and partition edges, through the
split pair: all `np.array_equal`. Accuracy: allclose to `paged_attention_reference`. Controls
that must differ, asserted: blocks of 128 instead of 64; the merge folding partitions in
decreasing order; the Triton kernel (another compiler: the comparison can see a difference).
Elsewhere (no GPU, or not Hopper) the tests skip with the reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.pallas_kernels import mosaic_bits as mb

pytestmark = pytest.mark.gpu

N, PS, E, H, KH = 1100, 256, 128, 32, 8
# sum N; ends 255, 256, 257, 511, 512, 513, 770, 1026 (beside and on partition edges)
CHUNKS = [1, 15, 16, 17, 206, 1, 1, 254, 1, 1, 257, 256, 74]


def _hopper() -> None:
    dev = jax.devices()[0]
    cc = getattr(dev, "compute_capability", "")
    if dev.platform != "gpu" or not str(cc).startswith("9"):
        pytest.skip(f"Mosaic GPU wgmma kernels need Hopper (sm_90); got {dev.device_kind} {cc}")


def _mosaic(**kw):
    from pallas_kernels.paged_attention_mosaic import paged_attention_mosaic

    kw = dict(scale=E**-0.5, partition_size=PS, block_kv=64, layer=jnp.int32(1)) | kw
    return jax.jit(lambda *args: paged_attention_mosaic(*args, **kw))


@pytest.fixture(scope="module")
def case():
    _hopper()
    c = mb.stacked_case(N, H, KH, E, seed=1)
    return c, mb.bits(mb.one_shot(_mosaic(structure="looped"), c, N))


def test_looped_split_and_two_consumers_give_one_set_of_bits(case):
    c, looped = case
    assert np.array_equal(mb.bits(mb.one_shot(_mosaic(structure="split"), c, N)), looped)
    assert np.array_equal(mb.bits(mb.one_shot(_mosaic(consumers=2), c, N)), looped)
    assert np.array_equal(mb.bits(mb.one_shot(_mosaic(mask_all=True), c, N)), looped)


def test_accurate_against_the_reference(case):
    from pallas_kernels.paged_attention import paged_attention_reference

    c, looped = case
    ref = mb.one_shot(lambda q, k, v, *a: paged_attention_reference(q, k[1], v[1], *a,
                                                                    scale=E**-0.5), c, N)
    np.testing.assert_allclose(looped.view(jnp.bfloat16).astype(np.float32),
                               np.asarray(ref, np.float32), atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize("structure", ["split", "looped"])
def test_chunks_and_decodes_give_the_one_shot_bits(case, structure):
    c, looped = case
    pos = mb.boundary_positions(N, 64, PS, extra=6)
    chunks, decs = mb.chunked_and_decodes(_mosaic(structure=structure), c, CHUNKS, pos)
    assert np.array_equal(mb.bits(chunks), looped)
    assert np.array_equal(mb.bits(decs), looped[pos])


def test_decode_batch_of_many_sequences_gives_the_one_shot_bits(case):
    """32 single-token decodes at random positions (the B 32 decode shape) through `auto`
    (split here) and the looped kernel."""
    c, looped = case
    pos = sorted(np.random.default_rng(3).choice(N, 32, replace=False).tolist())
    for structure in ("auto", "looped"):
        _, decs = mb.chunked_and_decodes(_mosaic(structure=structure), c, [1], pos)
        assert np.array_equal(mb.bits(decs), looped[pos]), structure


def test_controls_differ(case):
    """Another block_kv, a reversed merge, and the Triton kernel give other bits: the
    comparisons above can see a change of plan or of compiler."""
    from pallas_kernels.paged_attention import paged_attention

    c, looped = case
    b128 = mb.bits(mb.one_shot(_mosaic(block_kv=128), c, N))
    assert not np.array_equal(b128, looped)
    rev = mb.bits(mb.one_shot(_mosaic(structure="split", reverse_merge=True), c, N))
    assert not np.array_equal(rev, looped)
    tri = jax.jit(lambda *a: paged_attention(*a, scale=E**-0.5, partition_size=PS,
                                             layer=jnp.int32(1)))  # fmt: skip
    assert not np.array_equal(mb.bits(mb.one_shot(tri, c, N)), looped)
