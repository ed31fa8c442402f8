"""A step's small host arrays travel packed in one uint32 array and are cut back apart inside the
step executable (serving/engine/host_inputs.py): every field must come back bitwise (-0.0, NaN
payloads, large uint32 seeds included), and the layout must be a function of the shapes alone (one
executable per step shape)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jdet.batch import StepBatch
from jdet.step import SamplingInputs
from serving.engine.host_inputs import PACKED_BATCH, PACKED_SAMPLING, Layout, pack


def _inputs(seed: int, T: int = 8, S: int = 4, P: int = 3):
    rng = np.random.default_rng(seed)
    i32 = lambda *s: rng.integers(-(2**31), 2**31 - 1, s, dtype=np.int64).astype(np.int32)  # noqa: E731
    f32 = rng.standard_normal(S).astype(np.float32)
    f32[:3] = [-0.0, np.nan, np.inf]
    nan_payload = np.array([0x7FC01234], np.uint32).view(np.float32)[0]
    top_p = rng.random(S).astype(np.float32)
    top_p[0] = nan_payload
    batch = StepBatch(jax.numpy.asarray(i32(T)), i32(T), i32(T), i32(S + 1), i32(S), i32(S, P),
                      i32(S))  # fmt: skip
    sampling = SamplingInputs(
        temperature=f32, top_k=i32(S), top_p=top_p,
        seed=rng.integers(0, 2**32 - 1, S, dtype=np.uint64).astype(np.uint32), position=i32(S),
        logits=None,
    )  # fmt: skip
    return batch, sampling


def _unpacked(batch, sampling, layout=None):
    b, s, words, lay = pack(batch, sampling)
    lay = layout or lay
    return jax.jit(lambda b, s, w: lay.unpack(w, b, s))(b, s, words)


def _bits(x) -> np.ndarray:
    x = np.asarray(x)
    return x.view(np.uint32) if x.dtype == np.float32 else x


def test_every_packed_field_comes_back_bitwise():
    batch, sampling = _inputs(0)
    b, s = _unpacked(batch, sampling)
    for name in PACKED_BATCH:
        want, got = getattr(batch, name), getattr(b, name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(_bits(got), _bits(want)), name
    for name in PACKED_SAMPLING:
        want, got = getattr(sampling, name), getattr(s, name)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(_bits(got), _bits(want)), name
    # the token ids stay apart (an ahead step's are on the device already), untouched
    assert pack(batch, sampling)[0].token_ids is batch.token_ids
    assert np.array_equal(np.asarray(b.token_ids), np.asarray(batch.token_ids))


def test_a_layout_with_swapped_offsets_is_detected():
    """Negative control: cut the words at the wrong offsets (two same-shape fields swapped) and
    the bitwise check above fails."""
    batch, sampling = _inputs(1)
    lay = pack(batch, sampling)[3]
    f = list(lay.fields)
    i, j = [k for k, x in enumerate(f) if x[1] in ("positions", "slot_mapping")]
    f[i], f[j] = f[j], f[i]
    b, _ = _unpacked(batch, sampling, Layout(tuple(f)))
    assert not np.array_equal(np.asarray(b.positions), batch.positions)


def test_the_layout_is_a_function_of_the_shapes_only():
    b1, s1 = _inputs(2)
    b2, s2 = _inputs(3)
    b3, s3 = _inputs(4, T=16)
    b2.positions = jax.numpy.asarray(b2.positions)  # a device array: same layout, same key
    assert pack(b1, s1)[3] is pack(b2, s2)[3]
    assert pack(b1, s1)[3] != pack(b3, s3)[3]
    f = jax.jit(lambda w, lay: lay.num_words)
    f(pack(b1, s1)[2], pack(b1, s1)[3])
    f(pack(b2, s2)[2], pack(b2, s2)[3])
    assert f._cache_size() == 1


def test_a_non_4_byte_field_is_refused_by_name():
    batch, sampling = _inputs(5)
    batch.positions = batch.positions.astype(np.int64)
    with pytest.raises(TypeError, match="positions"):
        pack(batch, sampling)
