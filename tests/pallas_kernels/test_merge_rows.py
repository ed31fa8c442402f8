"""The split attention's merge kernel writing the final [rows, H, E] output itself
(`direct_out`, `_merge_rows_kernel`; Ops.attn_direct_out, issue 11) = the merge + gather +
select it replaces, bitwise, padding rows zeroed.

CPU: interpret mode (conftest), a prefill chunk, two decodes and two padding tokens, out_rows
padded to 64 (the next matmul's rows), two layers. Interpret mode fills an output the kernel
never writes with NaN, like the GPU's uninitialised memory, so the control (the zeroing pass
switched off) shows NaN rows and fails the comparison. Also: the kernel passes the Pallas
Triton lowering (exported for 'cuda'). `gpu`: the compiled kernels, bitwise.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention_kernels
from pallas_kernels.paged_attention import paged_attention
from pallas_kernels.paged_attention_pallas import attention_meta
from tests.jdet.test_step_fusion import _attention_inputs
from tests.pallas_kernels.triton_export import triton_calls_at_8b_decode


def _both(out_rows: int, layer: int, direct: bool):
    q, k, v, b = _attention_inputs()
    meta = attention_meta(b.page_table, b.context_lens, b.query_start, b.positions, t=9, g=4,
                          num_pages=12, page_size=4, partition_size=8)  # fmt: skip
    return np.asarray(paged_attention(
        q, k, v, b.page_table, b.context_lens, b.query_start, b.positions, scale=0.2,
        partition_size=8, layer=jnp.int32(layer), meta=meta, out_rows=out_rows,
        structure="split", direct_out=direct,
    ))  # fmt: skip


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint16)


def test_merge_writing_rows_equals_merge_then_gather():
    out_rows = 64  # (out_rows = T runs on the GPU test; each size is two more compiles here)
    for layer in (0, 2):
        want = _both(out_rows, layer, direct=False)
        got = _both(out_rows, layer, direct=True)
        assert got.shape == want.shape == (out_rows, 8, 32)
        assert np.array_equal(_bits(got), _bits(want)), layer
        assert not want[7:].any()  # padding tokens 7, 8 and rows 9.. are zeros
        assert want[:7].any()


def test_control_rows_left_unwritten_are_seen(monkeypatch):
    """The zeroing pass switched off (no output row counts as free): the rows no token owns keep
    interpret mode's NaN fill, and the comparison fails. out_rows 48: a fresh trace."""
    want = _both(64, 1, direct=False)[:48]  # rows are independent of out_rows
    monkeypatch.setattr(paged_attention_kernels.jnp, "logical_not", lambda x: jnp.zeros_like(x))
    got = _both(48, 1, direct=True)
    assert np.isnan(got.astype(np.float32)[7:]).all()
    assert not np.array_equal(_bits(got), _bits(want))


def test_merge_rows_lowers_to_a_triton_module(monkeypatch):
    """The split + row-writing merge pass the Pallas Triton lowering at the Llama-3-8B decode
    shape (exported for 'cuda' on the CPU; ptxas is not run here)."""
    from pallas_kernels.paged_attention_pallas import _paged_attention_pallas

    def attend(q, kc, vc, pt, cl, qs, pos, layer, meta):
        return _paged_attention_pallas(q, kc, vc, pt, cl, qs, pos, scale=0.1,
                                       partition_size=256, layer=layer, meta=meta, out_rows=64,
                                       structure="split", direct_out=True)  # fmt: skip

    names = triton_calls_at_8b_decode(monkeypatch, attend)
    assert len(names) == 2
    assert 'name = "paged_attention_merge_rows_' in names[1]


@pytest.mark.gpu
@pytest.mark.parametrize("out_rows", [9, 64])
def test_gpu_merge_writing_rows_equals_merge_then_gather(out_rows):
    for layer in (0, 2):
        want = _both(out_rows, layer, direct=False)
        got = _both(out_rows, layer, direct=True)
        assert np.array_equal(_bits(got), _bits(want)), layer
        assert not got[7:].any()
