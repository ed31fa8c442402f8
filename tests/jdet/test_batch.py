"""`decode_batch` (whole-array numpy, the per-step decode path) lays a step out exactly as the
general `build_batch` does: every field bitwise equal, padding included."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jdet.batch import build_batch, decode_batch


def random_decode(rng: np.random.Generator, S: int, page: int) -> tuple:
    """S sequences with random page lists (distinct pages) and a position inside their pages."""
    perm = rng.permutation(4096)
    tokens, positions, pages, used = [], [], [], 0
    for _ in range(S):
        n = int(rng.integers(1, 9))
        pages.append(perm[used : used + n].tolist())
        used += n
        positions.append(int(rng.integers(0, n * page)))
        tokens.append(int(rng.integers(0, 50000)))
    return tokens, positions, pages


def fields(b) -> dict:
    return {f.name: getattr(b, f.name) for f in dataclasses.fields(b)}


def assert_same(a, b) -> None:
    fa, fb = fields(a), fields(b)
    for k in fa:
        assert fa[k].dtype == fb[k].dtype, k
        assert np.array_equal(fa[k], fb[k]), k


def via_build_batch(tokens, positions, pages, page, **pad):
    items = [([t], p, pg) for t, p, pg in zip(tokens, positions, pages, strict=True)]
    return build_batch(items, page, pad_tokens=pad["pad_tokens"], pad_seqs=pad["pad_seqs"],
                       pad_pages=pad["pad_pages"], pad_rows=pad["pad_seqs"])[0]  # fmt: skip


@pytest.mark.parametrize("S", [1, 3, 8, 17])
@pytest.mark.parametrize("page", [1, 4, 16])
def test_decode_batch_equals_build_batch_bitwise(S, page):
    rng = np.random.default_rng(S * 100 + page)
    for pads in ((0, 0, 0), (5, 2, 3)):
        tokens, positions, pages = random_decode(rng, S, page)
        pad = dict(pad_tokens=S + pads[0], pad_seqs=S + pads[1],
                   pad_pages=max(len(p) for p in pages) + pads[2])  # fmt: skip
        got = decode_batch(tokens, positions, pages, page, **pad)
        assert_same(got, via_build_batch(tokens, positions, pages, page, **pad))


def test_the_comparison_sees_a_one_slot_difference():
    """Negative control: a batch whose one sequence sits one position later differs (slot,
    position and context length), and assert_same reports it."""
    rng = np.random.default_rng(0)
    tokens, positions, pages = random_decode(rng, 4, 4)
    positions[2] = max(0, positions[2] - 1)
    pad = dict(pad_tokens=8, pad_seqs=4, pad_pages=8)
    moved = list(positions)
    moved[2] += 1
    with pytest.raises(AssertionError):
        assert_same(decode_batch(tokens, moved, pages, 4, **pad),
                    via_build_batch(tokens, positions, pages, 4, **pad))  # fmt: skip


def test_decode_batch_refuses_what_build_batch_refuses():
    with pytest.raises(ValueError, match="needs 9 slots but has 2 pages"):
        decode_batch([1], [8], [[3, 4]], 4, pad_tokens=1, pad_seqs=1, pad_pages=2)
    with pytest.raises(ValueError, match="padding sizes"):
        decode_batch([1, 2], [0, 0], [[3], [4]], 4, pad_tokens=1, pad_seqs=2, pad_pages=1)
    with pytest.raises(ValueError, match="one of each per sequence"):
        decode_batch([1], [0, 0], [[3], [4]], 4, pad_tokens=2, pad_seqs=2, pad_pages=1)
    with pytest.raises(ValueError, match="decode position is -1"):
        decode_batch([1], [-1], [[3]], 4, pad_tokens=1, pad_seqs=1, pad_pages=1)


def test_decode_batch_fields_do_not_overlap():
    """The fields share one buffer: writing one must leave every other unchanged."""
    b = decode_batch([5, 6], [3, 9], [[1, 2], [3, 4, 5]], 4, pad_tokens=4, pad_seqs=3,
                     pad_pages=3)  # fmt: skip
    f = fields(b)
    for k in f:
        before = {j: v.copy() for j, v in f.items() if j != k}
        f[k][...] = 12345
        for j, v in before.items():
            assert np.array_equal(f[j], v), (k, j)
