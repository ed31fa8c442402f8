"""`paged_attention_kernels.PREFETCH_KV`: loading KV block b+1 while block b is folded changes no
bit (the same values in the same operations), for the split and looped structures, prefill and
decode rows, in interpret mode on a CPU and compiled on the GPU. The control shows the comparison
sees a change of the reduction plan at these sizes (another KV block size)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import paged_attention_kernels as pak
from tests.pallas_kernels.test_paged_attention import (
    GPU,
    assert_bits_equal,
    attend,
    build_batch,
    make_world,
)


@pytest.fixture
def prefetch(monkeypatch):
    def set_prefetch(on: bool) -> None:
        monkeypatch.setattr(pak, "PREFETCH_KV", on)
        jax.clear_caches()  # the kernels are traced inside jitted launchers

    yield set_prefetch
    jax.clear_caches()


def _both(w, entries, t_pad, s_pad, set_prefetch):
    args, rows = build_batch(w, entries, t_pad=t_pad, s_pad=s_pad)
    out = {}
    for on in (False, True):
        set_prefetch(on)
        out[on] = {s: attend(w, args, structure=s) for s in ("split", "looped")}
    return out, rows


def _check(w, entries, t_pad, s_pad, set_prefetch):
    out, _ = _both(w, entries, t_pad, s_pad, set_prefetch)
    for s in ("split", "looped"):
        assert_bits_equal(out[True][s], out[False][s], f"prefetch on vs off, {s}")
    assert_bits_equal(out[True]["split"], out[True]["looped"], "split vs looped, prefetch on")
    # control: the same comparison sees another reduction plan (KV blocks of one page)
    set_prefetch(True)
    assert w.block_kv != w.page_size
    w.block_kv = w.page_size
    args, _ = build_batch(w, entries, t_pad=t_pad, s_pad=s_pad)
    assert (attend(w, args, structure="split") != out[True]["split"]).any()


def test_prefetched_kv_blocks_change_no_bit(prefetch):
    # a prefill chunk spanning several partitions and blocks, a decode, a short chunk
    w = make_world(3, [75, 13, 40], kh=2, h=8, e=64, dtype=jnp.bfloat16)
    _check(w, [(0, 0, 75), (1, 12, 1), (2, 33, 7)], 90, 4, prefetch)


@pytest.mark.gpu
def test_gpu_prefetched_kv_blocks_change_no_bit(prefetch):
    w = make_world(4, [1100, 300], **{**GPU, "block_kv": 64})
    _check(w, [(0, 0, 1100), (1, 299, 1)], 1152, 2, prefetch)
