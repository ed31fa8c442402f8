"""The paged attention's load and launch settings (`AttentionConfig`) keep the bits of the default.

Settings: pallas_kernels/paged_attention_kernels.py `AttentionConfig` (kv_gather_2d, pages_ahead,
static_blocks, split_stages, ...), passed to `paged_attention` as `config` (jdet: `Ops.attn_config`;
`benchmarks/decode_bench.py --variants` builds others). None changes a summed value or a
summation order of the reduction plan; the defaults (the three load paths on, 3 stages) were made
so without a fingerprint change, which holds only while the all-off kernel of before
(`old_kernel`) gives the same bits.

CPU (interpret mode, conftest): the new load paths (2-D gathers, page indices ahead, a static
block loop with masked past-the-end blocks) and the all-off
loads, in the split and looped layouts and on a stacked cache, equal the default bitwise on a
ragged batch whose last partitions are partial; controls (wrong slots, wrong pages, NaN
past-the-end fill) show the comparison sees those paths. The
settings also pass the Pallas Triton lowering at the Llama-3-8B decode shape (exported for 'cuda').
`gpu`: each setting compiled, at the 8B decode shape (batch 1 at 1k context, the model's direct
output, and a ragged batch of 4) and at a 512-token prefill chunk (split and looped), against
the default; control: another block_kv (a different plan) changes the bits at the same inputs.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention_kernels as kern
from pallas_kernels.paged_attention import AttentionConfig, paged_attention
from tests.pallas_kernels.test_paged_attention import assert_bits_equal, build_batch, make_world
from tests.pallas_kernels.triton_export import triton_calls_at_8b_decode

# The defaults (the three load paths on, 3 split stages) against these: the all-off loads and
# each path alone (checked on the CPU too) ...
OFF = AttentionConfig(kv_gather_2d=False, pages_ahead=False, static_blocks=False)
LOAD_CONFIGS = {
    "off": OFF,
    "gather2d_only": AttentionConfig(kv_gather_2d=True, pages_ahead=False, static_blocks=False),
    "ahead_static_only": AttentionConfig(kv_gather_2d=False, pages_ahead=True, static_blocks=True),
}
# ... and the launch parameters (interpret mode ignores them: GPU only). old_kernel: the kernel
# before the load paths (all off, 2 stages), whose bits the defaults must keep.
LAUNCH_CONFIGS = {
    "old_kernel": AttentionConfig(kv_gather_2d=False, pages_ahead=False, static_blocks=False,
                                  split_stages=2),
    "stages2": AttentionConfig(split_stages=2),
    "stages4": AttentionConfig(split_stages=4),
}
DEFAULT = AttentionConfig()


# --------------------------------------------------------------------------------------------
# CPU (interpret mode)

# Ragged (partition 32, block_kv 16): seq 0's last partition holds 8 of 32 positions, seq 1's
# 13, so a static loop runs blocks past the tile's end; a prefill chunk of 19 tokens (two query
# tiles), a decode and padding tokens in one step.
_ENTRIES = [(0, 21, 19), (1, 12, 1)]


def _world():
    return make_world(7, [40, 13], kh=1, h=4, e=128, dtype=jnp.bfloat16)


def _run(w, args, structure: str, layer: bool = False,
         config: AttentionConfig = DEFAULT) -> np.ndarray:  # fmt: skip
    q, k, v, *rest = args
    kw = {}
    if layer:  # the stacked cache [L, K, P, B, E], read at layer 1 in place (other layer: junk)
        junk = jnp.asarray(np.random.default_rng(5).normal(size=k.shape), k.dtype)
        k, v = jnp.stack([junk, k]), jnp.stack([junk, v])
        kw["layer"] = jnp.int32(1)
    out = paged_attention(q, k, v, *rest, scale=w.e**-0.5, partition_size=w.part,
                          block_kv=w.block_kv, structure=structure, config=config,
                          **kw)  # fmt: skip
    return np.asarray(out.astype(jnp.float32))


@functools.cache
def _default(structure: str, layer: bool = False):
    """(world, args, the default setting's output): computed once per layout for the module."""
    w = _world()
    args, _ = build_batch(w, _ENTRIES, t_pad=24, s_pad=3)
    return w, args, _run(w, args, structure, layer)


# The default runs all three load paths (the 2-D loads masked past the tile's end); against it,
# together, every other path once (each interpret-mode compile costs ~5 CPU s): the old loads
# (off); the 2-D gather with per-token page loads (gather2d_only); page indices ahead and a
# static loop with [pages, slot, E] loads (ahead_static_only).
@pytest.mark.parametrize("name", list(LOAD_CONFIGS))
def test_load_paths_keep_the_split_layouts_bits(name):
    w, args, want = _default("split")
    assert want[:20].any() and not want[20:].any()  # padding tokens: zeros
    assert_bits_equal(_run(w, args, "split", config=LOAD_CONFIGS[name]), want, name)


def test_all_off_loads_keep_the_looped_layouts_bits_on_a_stacked_cache():
    """The looped layout (prefill) reading the stacked cache's page pool (_PagePool's 2-D and
    masked loads, the default) = the all-off loads."""
    w, args, want = _default("looped", True)
    got = _run(w, args, "looped", True, config=LOAD_CONFIGS["off"])
    assert_bits_equal(got, want, "looped, stacked")


@pytest.mark.parametrize(
    "setting, patch",
    [
        # (the config a control runs with: the defaults, or as named)
        # 2-D gather reading each token's neighbouring slot
        (DEFAULT, ("_token_slots", lambda bk, ps: (jnp.arange(bk)[:, None] + 1) % ps)),
        # pages picked ahead for the next block (the last block wraps to the first)
        (AttentionConfig(kv_gather_2d=False), ("_block_page_index", None)),
        # blocks past the tile's end read NaN instead of zeros: they run, and count
        (DEFAULT, ("_PAST_END_FILL", float("nan"))),
    ],
)
def test_control_a_wrong_load_path_changes_the_bits(monkeypatch, setting, patch):
    w, args, want = _default("split")
    attr, new = patch
    if attr == "_block_page_index":
        orig = kern._block_page_index

        def new(plan, per_token):
            idx = orig(plan, per_token)
            return jnp.roll(idx, -1, axis=0)

    monkeypatch.setattr(kern, attr, new)
    jax.clear_caches()  # the patched kernel is traced afresh (jit keys by its static arguments)
    try:
        got = _run(w, args, "split", config=setting)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert not np.array_equal(got, want), attr


def test_load_paths_lower_to_triton_at_the_8b_decode_shape(monkeypatch):
    """Every load path and the launch settings pass the Pallas Triton lowering (split + merge at
    the Llama-3-8B decode shape, stacked cache; exported for 'cuda' on the CPU, ptxas not run)."""
    for setting in (DEFAULT, LOAD_CONFIGS["off"], LOAD_CONFIGS["ahead_static_only"]):

        def attend(q, kc, vc, pt, cl, qs, pos, layer, meta, setting=setting):
            return paged_attention(q, kc, vc, pt, cl, qs, pos, scale=0.1, partition_size=256,
                                   layer=layer, meta=meta, out_rows=64, structure="split",
                                   direct_out=True, backend="pallas",
                                   config=setting)  # fmt: skip

        calls = triton_calls_at_8b_decode(monkeypatch, attend)
        assert len(calls) == 2, setting


# --------------------------------------------------------------------------------------------
# GPU: each setting compiled, at realistic shapes


def _gpu_case(case: str):
    """(fn() -> output bits) at a realistic shape: the 8B attention (8 kv heads, G = 4, E = 128,
    page 16, partition 256, bf16, stacked 2-layer cache read at layer 1)."""
    rng = np.random.default_rng(11)
    kh, g, e, page, ps = 8, 4, 128, 16, 256
    if case == "decode_b1":
        lens, tokens, pmax = [1024], [1], 128  # decode_bench's page-table width at ctx 1024
    elif case == "decode_ragged":
        lens, tokens, pmax = [1000, 37, 513, 256], [1, 1, 1, 1], 64
    else:  # a 512-token prefill chunk at positions 512..1023
        lens, tokens, pmax = [1024], [512], 64
    need = [-(-n // page) for n in lens]
    num_pages = sum(need) + 8
    perm = rng.permutation(num_pages).astype(np.int32)
    pt = np.zeros((len(lens), pmax), np.int32)
    c = 0
    for i, n in enumerate(need):
        pt[i, :n] = perm[c : c + n]
        c += n
    t = sum(tokens)
    qs = np.concatenate([[0], np.cumsum(tokens)]).astype(np.int32)
    pos = np.concatenate([np.arange(n - k, n) for n, k in zip(lens, tokens, strict=True)])
    pos = pos.astype(np.int32)
    kv = rng.normal(size=(2, 2, kh, num_pages, page, e)).astype(np.float32)
    k, v = (jnp.asarray(x, jnp.bfloat16) for x in kv)
    q = jnp.asarray(rng.normal(size=(t, kh * g, e)), jnp.bfloat16)
    b = [jnp.asarray(x) for x in (pt, np.asarray(lens, np.int32), qs, pos)]
    structure = "looped" if case == "prefill_looped" else "split"

    def fn(**kw):
        out = paged_attention(q, k, v, *b, scale=e**-0.5, partition_size=ps,
                              layer=jnp.int32(1), structure=structure,
                              out_rows=64 if case == "decode_b1" else None,
                              direct_out=case == "decode_b1", **kw)  # fmt: skip
        return np.asarray(out).view(np.uint16)

    return fn


GPU_CASES = ["decode_b1", "decode_ragged", "prefill_split", "prefill_looped"]


@functools.cache
def _gpu_default(case: str) -> np.ndarray:
    return _gpu_case(case)()


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("name", [*LOAD_CONFIGS, *LAUNCH_CONFIGS])
def test_gpu_setting_keeps_the_default_bits(case, name):
    want = _gpu_default(case)
    got = _gpu_case(case)(config={**LOAD_CONFIGS, **LAUNCH_CONFIGS}[name])
    assert np.array_equal(got, want), f"{name} changes the bits at {case}"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_control_another_block_kv_changes_the_bits(case):
    got = _gpu_case(case)(block_kv=32)
    assert not np.array_equal(got, _gpu_default(case))
