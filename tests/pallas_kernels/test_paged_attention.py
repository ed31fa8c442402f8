"""Paged attention: accuracy against the f32 reference and bitwise invariance of every query row
to batch composition, chunk size, prefill vs decode, physical page placement and padding.

CPU tests run the Pallas kernel in interpret mode (JDET_PALLAS_INTERPRET=1, set by conftest) at
tiny sizes (page 8, partition 32, so several partitions and several KV blocks per partition are
exercised); `gpu` tests repeat the invariance checks compiled at realistic sizes. Every call gets
a freshly drawn cache in which all slots a query must not see (other sequences, positions past
the chunk's end, unused pages) hold fresh random junk, so a masking bug changes the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    paged_attention_xla,
)


@dataclasses.dataclass
class World:
    """Fixed K/V/Q values of a few sequences and their physical pages."""

    k: np.ndarray  # [N, K, L, E]
    v: np.ndarray
    q: np.ndarray  # [N, L, H, E]
    pages: list  # per sequence: physical page ids (distinct across sequences)
    num_pages: int
    page_size: int
    dtype: object
    part: int
    block_kv: int | None

    @property
    def kh(self) -> int:
        return self.k.shape[1]

    @property
    def e(self) -> int:
        return self.k.shape[3]


def make_world(seed, lens, kh=2, h=8, e=64, page=8, dtype=jnp.float32, part=32, block_kv=16,
               spare_pages=3):  # fmt: skip
    rng = np.random.default_rng(seed)
    n, lmax = len(lens), max(lens)
    need = [-(-ln // page) for ln in lens]
    num_pages = sum(need) + spare_pages
    perm = rng.permutation(num_pages)
    pages, c = [], 0
    for k in need:
        pages.append(perm[c : c + k])
        c += k
    return World(
        k=rng.standard_normal((n, kh, lmax, e)).astype(np.float32),
        v=rng.standard_normal((n, kh, lmax, e)).astype(np.float32),
        q=rng.standard_normal((n, lmax, h, e)).astype(np.float32),
        pages=pages, num_pages=num_pages, page_size=page, dtype=dtype, part=part,
        block_kv=block_kv,
    )  # fmt: skip


def build_batch(w: World, entries, *, t_pad=None, s_pad=None, pmax=None, page_perm=None,
                junk_seed=0):  # fmt: skip
    """Kernel inputs for `entries` = [(seq, first position, count)] and each entry's row slice.

    The cache holds each entry's sequence up to its chunk end; every other slot is random junk.
    """
    rng = np.random.default_rng(junk_seed)
    b = w.page_size
    cache_k = rng.standard_normal((w.kh, w.num_pages, b, w.e)).astype(np.float32)
    cache_v = rng.standard_normal((w.kh, w.num_pages, b, w.e)).astype(np.float32)
    perm = np.arange(w.num_pages) if page_perm is None else page_perm
    need_p = max(len(w.pages[s]) for s, _, _ in entries)
    pmax = pmax or need_p
    s_pad = s_pad or len(entries)
    t = sum(n for _, _, n in entries)
    t_pad = t_pad or t
    pt = np.zeros((s_pad, pmax), np.int32)
    lens = np.zeros((s_pad,), np.int32)
    qs = np.full((s_pad + 1,), t, np.int32)
    q = rng.standard_normal((t_pad, w.q.shape[2], w.e)).astype(np.float32)  # junk padding rows
    pos = np.zeros((t_pad,), np.int32)
    rows, row = [], 0
    for i, (s, start, n) in enumerate(entries):
        ctx = start + n
        phys = perm[w.pages[s]]
        pt[i, : len(phys)] = phys
        p = np.arange(ctx)
        cache_k[:, phys[p // b], p % b] = w.k[s, :, :ctx]
        cache_v[:, phys[p // b], p % b] = w.v[s, :, :ctx]
        lens[i] = ctx
        qs[i] = row
        q[row : row + n] = w.q[s, start:ctx]
        pos[row : row + n] = np.arange(start, ctx)
        rows.append(slice(row, row + n))
        row += n
    qs[len(entries) :] = row
    args = (
        jnp.asarray(q, w.dtype), jnp.asarray(cache_k, w.dtype), jnp.asarray(cache_v, w.dtype),
        jnp.asarray(pt), jnp.asarray(lens), jnp.asarray(qs), jnp.asarray(pos),
    )  # fmt: skip
    return args, rows


def attend(w: World, args, fn=paged_attention, structure="auto") -> np.ndarray:
    kw = {"scale": w.e**-0.5, "partition_size": w.part}
    if fn is paged_attention:
        kw.update(block_kv=w.block_kv, structure=structure)
    return np.asarray(fn(*args, **kw).astype(jnp.float32))


def run_chunked(w: World, seq: int, length: int, chunk: int, *, t_pad, pmax=None,
                fn=paged_attention, structure="auto") -> np.ndarray:  # fmt: skip
    """Rows of positions 0..length-1 of `seq`, prefilled `chunk` tokens per call."""
    outs = []
    for start in range(0, length, chunk):
        n = min(chunk, length - start)
        tp = n if t_pad is None else t_pad
        args, rows = build_batch(w, [(seq, start, n)], t_pad=tp, pmax=pmax, junk_seed=start + 1)
        outs.append(attend(w, args, fn, structure)[rows[0]])
    return np.concatenate(outs)


# The f32 oracle jitted: run eagerly it compiles each of its ops per shape (56 small compiles in
# the first mixed-batch test on a CPU); jitted it is one program per configuration. Only compared
# within a tolerance, so XLA's fusion of it changes nothing a test checks.
reference = jax.jit(paged_attention_reference, static_argnames=("scale", "partition_size"))


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str) -> None:
    assert a.shape == b.shape, what
    bad = np.argwhere(a != b)
    assert bad.size == 0, f"{what}: {len(bad)} elements differ, first at {bad[:3].tolist()}"


# --------------------------------------------------------------------------------------------
# CPU (interpret mode)

CONFIGS = {
    "gqa4_e64_f32": dict(kh=2, h=8, e=64, dtype=jnp.float32),
    "mqa_e128_bf16": dict(kh=1, h=4, e=128, dtype=jnp.bfloat16),
    "g3_e64_f32": dict(kh=2, h=6, e=64, dtype=jnp.float32),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_f32_reference_on_a_mixed_batch(name):
    cfg = CONFIGS[name]
    # Lengths off page (8) and partition (32) multiples; 75 spans three partitions.
    w = make_world(1, [75, 13, 40, 1], **cfg)
    entries = [(0, 0, 75), (1, 12, 1), (2, 33, 7), (3, 0, 1)]
    args, rows = build_batch(w, entries, t_pad=90, s_pad=6)
    out = attend(w, args)
    ref = np.asarray(reference(*args, scale=w.e**-0.5).astype(jnp.float32))
    tol = 1e-5 if cfg["dtype"] == jnp.float32 else 2e-2
    for r in rows:
        err = np.abs(out[r] - ref[r]).max() / np.abs(ref[r]).max()
        assert err < tol, (name, r, err)
    assert np.all(out[84:] == 0.0), "padding rows must be zeros"
    assert np.all(np.isfinite(out))


def test_row_bits_do_not_depend_on_chunk_size():
    w = make_world(2, [75], kh=2, h=8, e=64)
    whole = run_chunked(w, 0, 75, 75, t_pad=80, structure="looped")
    for chunk, structure in ((1, "split"), (7, "looped"), (16, "split"), (64, "looped")):
        out = run_chunked(w, 0, 75, chunk, t_pad=80, structure=structure)
        assert_bits_equal(out, whole, f"chunk={chunk} {structure}")


def test_split_kv_and_looped_structures_give_the_same_bits():
    w = make_world(7, [75, 13, 40], kh=1, h=4, e=128, dtype=jnp.bfloat16)
    args, rows = build_batch(w, [(0, 0, 75), (1, 12, 1), (2, 33, 7)], t_pad=90, s_pad=4)
    assert_bits_equal(attend(w, args, structure="split"), attend(w, args, structure="looped"),
                      "split vs looped")  # fmt: skip


def test_prefill_and_decode_rows_are_bitwise_equal():
    # Decode: one token per step (T=1, unpadded), sharing the step with another decoding sequence.
    w = make_world(3, [70, 50])
    whole, rows = build_batch(w, [(0, 0, 70)], t_pad=80)
    ref = attend(w, whole)[rows[0]]
    for p in range(60, 70):
        args, r = build_batch(w, [(1, 40 + p % 10, 1), (0, p, 1)], junk_seed=p)
        assert_bits_equal(attend(w, args)[r[1]], ref[p : p + 1], f"decode position {p}")


def test_row_bits_do_not_depend_on_batch_composition():
    w = make_world(4, [45, 30, 70, 9])
    alone, r0 = build_batch(w, [(0, 10, 35)], t_pad=96, s_pad=4)
    ref = attend(w, alone)[r0[0]]
    for entries in ([(2, 0, 50), (0, 10, 35)], [(1, 29, 1), (0, 10, 35), (3, 0, 9), (2, 69, 1)]):
        args, rows = build_batch(w, entries, t_pad=96, s_pad=4, junk_seed=len(entries))
        i = [e[0] for e in entries].index(0)
        assert_bits_equal(attend(w, args)[rows[i]], ref, f"batch {entries}")


def test_row_bits_do_not_depend_on_physical_pages():
    w = make_world(5, [75, 20])
    entries = [(0, 0, 75), (1, 19, 1)]
    args, rows = build_batch(w, entries, t_pad=80)
    ref = attend(w, args)
    perm = np.random.default_rng(0).permutation(w.num_pages)
    args2, _ = build_batch(w, entries, t_pad=80, page_perm=perm, junk_seed=9)
    out = attend(w, args2)
    for r in rows:
        assert_bits_equal(out[r], ref[r], "page permutation")


def test_row_bits_do_not_depend_on_token_or_sequence_padding():
    w = make_world(6, [75, 20])
    entries = [(0, 20, 55), (1, 19, 1)]
    base, rows = build_batch(w, entries)
    ref = attend(w, base)
    for t_pad, s_pad, pmax in ((57, 2, None), (93, 5, None), (64, 3, 16)):
        args, _ = build_batch(w, entries, t_pad=t_pad, s_pad=s_pad, pmax=pmax, junk_seed=t_pad)
        out = attend(w, args)
        for r in rows:
            assert_bits_equal(out[r], ref[r], f"t_pad={t_pad} s_pad={s_pad} pmax={pmax}")
        assert np.all(out[56:] == 0.0) and np.all(np.isfinite(out))


def test_stacked_cache_with_layer_index_equals_the_sliced_layer():
    """The model passes the whole [L, K, P, B, E] cache and a layer index (no per-layer copy);
    each layer's result must be bitwise the result on that layer alone, in both structures."""
    w = make_world(9, [45, 20])
    args, _ = build_batch(w, [(0, 0, 45), (1, 19, 1)])
    q, k, v, *rest = args
    rng = np.random.default_rng(3)
    k_all = jnp.stack([k, jnp.asarray(rng.standard_normal(k.shape), k.dtype), k * 2])
    v_all = jnp.stack([v * 3, v, jnp.asarray(rng.standard_normal(v.shape), v.dtype)])
    kw = {"scale": w.e**-0.5, "partition_size": w.part, "block_kv": w.block_kv}
    for structure in ("split", "looped"):
        for layer in range(3):
            ref = paged_attention(q, k_all[layer], v_all[layer], *rest, structure=structure, **kw)
            got = paged_attention(q, k_all, v_all, *rest, layer=jnp.int32(layer),
                                  structure=structure, **kw)  # fmt: skip
            assert_bits_equal(np.asarray(got), np.asarray(ref), f"{structure} layer {layer}")


def chunk_dependent_attention(*args, scale, partition_size):
    """Negative-control variant: attention whose KV block is chosen from the chunk's token count
    (an order that provably follows the chunking; the CPU path, to stay fast)."""
    page = args[1].shape[-2]  # k cache [K, P, B, E]: the KV block must be a multiple of B
    block_kv = page if args[0].shape[0] < 16 else 2 * page
    return paged_attention(*args, scale=scale, partition_size=partition_size, block_kv=block_kv,
                           backend="xla")  # fmt: skip


def test_negative_control_plain_xla_attention_chunked_vs_whole():
    """Plain XLA attention (one softmax over the whole context) run chunked vs whole, or where XLA
    CPU happens to be chunk-invariant at these sizes, the chunk-dependent variant: the comparison
    the tests above make must find a difference. On a CPU only the variant runs, and must differ:
    plain XLA CPU found no difference at any of the four chunk sizes (session 6's runs), so trying
    it first only spent ~7 compiles (most of this test's time) before the variant ran anyway."""
    w = make_world(2, [75], kh=2, h=8, e=64, dtype=jnp.bfloat16)
    diffs = {}
    fns = [paged_attention_xla, chunk_dependent_attention]
    if jax.default_backend() == "cpu":
        fns = fns[1:]
    for fn in fns:
        whole = run_chunked(w, 0, 75, 75, t_pad=None, fn=fn)
        diffs = {}
        # largest chunks first, stopping at the first that differs: every distinct chunk length
        # is a compile (t_pad=None), and chunks of 64 (+ 11) already differ in the variant
        for c in (64, 16, 7, 1):
            diffs[c] = int((run_chunked(w, 0, 75, c, t_pad=None, fn=fn) != whole).sum())
            if diffs[c]:
                break
        if any(diffs.values()):
            break
    assert any(diffs.values()), f"no chunk size changed any element ({diffs})"


def test_negative_control_a_different_reduction_plan_changes_the_bits():
    """The bitwise checks above can fail: partitions of 64 instead of 32 change the low bits."""
    w = make_world(8, [75], kh=2, h=8, e=64)
    args, rows = build_batch(w, [(0, 0, 75)], t_pad=80)
    a = attend(w, args)
    w.part = 64
    b = attend(w, args)
    assert np.abs(a - b).max() < 1e-5
    assert (a != b).any()


# --------------------------------------------------------------------------------------------
# GPU (compiled, realistic sizes)

GPU = dict(kh=8, h=32, e=128, page=16, dtype=jnp.bfloat16, part=512, block_kv=None)


@pytest.mark.gpu
def test_gpu_matches_reference_and_chunk_and_decode_invariance():
    length = 1100  # three partitions of 512, not a page or partition multiple
    w = make_world(10, [length, 300], **GPU)
    whole, rows = build_batch(w, [(0, 0, length)], t_pad=1152, s_pad=2)
    ref_out = attend(w, whole, structure="looped")[rows[0]]
    assert_bits_equal(attend(w, whole, structure="split")[rows[0]], ref_out, "split vs looped")
    ref = np.asarray(reference(*whole, scale=w.e**-0.5).astype(jnp.float32))
    err = np.abs(ref_out - ref[rows[0]]).max() / np.abs(ref[rows[0]]).max()
    assert err < 2e-2, err
    for chunk, structure in ((7, "split"), (64, "looped"), (256, "split")):
        out = run_chunked(w, 0, length, chunk, t_pad=256, structure=structure)
        assert_bits_equal(out, ref_out, f"chunk={chunk} {structure}")
    for p in range(length - 40, length):  # decode, next to another decoding sequence
        args, r = build_batch(w, [(1, 299, 1), (0, p, 1)], t_pad=8, s_pad=4, junk_seed=p)
        assert_bits_equal(attend(w, args)[r[1]], ref_out[p : p + 1], f"decode p={p}")


@pytest.mark.gpu
def test_gpu_batch_pages_and_padding_invariance():
    w = make_world(11, [900, 600, 40, 1], **GPU)
    alone, r0 = build_batch(w, [(0, 300, 600)], t_pad=1024, s_pad=4)
    ref = attend(w, alone)[r0[0]]
    perm = np.random.default_rng(1).permutation(w.num_pages)
    cases = [
        dict(entries=[(1, 0, 600), (0, 300, 600)], t_pad=1536, s_pad=4),
        dict(entries=[(2, 39, 1), (0, 300, 600), (3, 0, 1)], t_pad=640, s_pad=8, page_perm=perm),
        dict(entries=[(0, 300, 600)], t_pad=2048, s_pad=16, pmax=128),
    ]
    for c in cases:
        entries = c.pop("entries")
        args, rows = build_batch(w, entries, junk_seed=7, **c)
        i = [e[0] for e in entries].index(0)
        for structure in ("split", "looped"):
            out = attend(w, args, structure=structure)[rows[i]]
            assert_bits_equal(out, ref, f"{entries} {c} {structure}")


@pytest.mark.gpu
def test_gpu_mqa_prefill_split_looped_and_decode_agree():
    w = make_world(13, [1100, 70], **{**GPU, "kh": 1})
    whole, rows = build_batch(w, [(0, 0, 1100)], t_pad=1152, s_pad=2)
    ref_out = attend(w, whole, structure="looped")[rows[0]]
    assert_bits_equal(attend(w, whole, structure="split")[rows[0]], ref_out, "split vs looped")
    for p in (0, 511, 512, 1099):
        args, r = build_batch(w, [(0, p, 1), (1, 69, 1)], t_pad=4, s_pad=2, junk_seed=p)
        assert_bits_equal(attend(w, args)[r[0]], ref_out[p : p + 1], f"decode p={p}")


@pytest.mark.gpu
def test_gpu_negative_control_plain_xla_attention_differs():
    """Plain XLA attention: chunked vs whole prefill and batch composition (records the result)."""
    w = make_world(12, [1100], **GPU)
    whole = run_chunked(w, 0, 1100, 1100, t_pad=None, fn=paged_attention_xla)
    diffs = {c: int((run_chunked(w, 0, 1100, c, t_pad=None, fn=paged_attention_xla) != whole)
                    .sum()) for c in (64, 256)}  # fmt: skip
    print("XLA attention differing elements by chunk size:", diffs, "on", jax.devices()[0])
    if not any(diffs.values()):  # then the chunk-dependent variant must show the difference
        whole = run_chunked(w, 0, 1100, 1100, t_pad=None, fn=chunk_dependent_attention)
        diffs = {c: int((run_chunked(w, 0, 1100, c, t_pad=None, fn=chunk_dependent_attention)
                         != whole).sum()) for c in (8, 256)}  # fmt: skip
    assert any(diffs.values()), f"no chunk size changed any element ({diffs})"


def test_auto_structure_caps_the_split_partials():
    """"auto" runs split-KV for few programs whose partials fit the cap, looped otherwise (never
    a bit). The Llama-3-8B cases measured on an H200 (forward temporaries at 2,052 pages): a
    2048-token step beside 256 sequences held 12.26 GiB of split partials; batch-1 decode and a
    32-sequence decode at 32k stay split."""
    from pallas_kernels.paged_attention_kernels import DEFAULT_CONFIG
    from pallas_kernels.paged_attention_pallas import (
        SPLIT_PARTIALS_MAX_BYTES,
        auto_structure,
        split_partials_bytes,
    )

    def pick(nt: int, parts: int) -> str:
        return auto_structure(nt, 8, parts, 64, 128, DEFAULT_CONFIG)

    assert split_partials_bytes(384, 8, 129, 64, 128) / 2**30 > 12  # T 2048 + S 256, 2,052 pages
    assert pick(384, 129) == "looped" and pick(288, 129) == "looped"
    assert pick(17, 9) == "split" and pick(17, 129) == "split" and pick(34, 129) == "split"
    assert pick(768, 1) == "looped"  # many programs: looped whatever the partials
    assert split_partials_bytes(272, 8, 33, 64, 128) <= SPLIT_PARTIALS_MAX_BYTES  # B 256, 8k
