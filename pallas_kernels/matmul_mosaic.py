"""Hopper (sm_90) Mosaic GPU versions of `matmul` (BIO) and `tree_matmul` (TBIK).

Kernel: persistent, warp-specialised (one TMA producer warpgroup, two wgmma consumer warpgroups),
a TMA -> SMEM pipeline over K as deep as SMEM allows (4-6 stages), f32 wgmma accumulators in
registers, tiled epilogue through SMEM and TMA stores. Written after jax's
`ops/gpu/hopper_matmul_mgpu.py` (same pipeline/epilogue API), without clusters.

Reduction plan. The K blocking (K=16 wgmma instructions, in increasing K, into an f32
accumulator) is a function of K only; the CTA shape is a function of N and, for decode, of whether
M <= 64 (`mosaic_config`), which moves work between CTAs but never changes an element's
arithmetic; M is zero padded to the CTA rows. A pipeline step feeds 64 columns of K (128 on the
decode CTAs: the same instructions in the same order, two steps' worth per barrier round trip)
into an f32 register accumulator.
Which SM computes a tile (the persistent schedule) varies with M, the arithmetic of a tile does not,
so row i is bitwise the same for any M.
- matmul (BIO): CTA 128 x 256 when N % 256 == 0, else 128 x 128 (N % 128 == 0 required),
  64 x 64 with one consumer warpgroup when M <= 64 (`decode_config`); one sequential K range =
  all of K per output tile.
- tree_matmul (TBIK, `tree_plan` leaves of k_first tiles): CTA 128x128, warpgroups stacked along M
  (64x128 f32 accumulator each). A work item is (leaf group, m tile, n tile); a group of `subtree`
  consecutive leaves is reduced in registers: each leaf accumulates its k_first steps sequentially
  from zero; at a leaf's end a binary counter pushes it into (or combines it with, lower K on the
  left) log2(subtree) register partials -- exactly the perfect-tree additions of the portable
  kernel. With subtree == num_leaves the whole tree stays in registers and the epilogue casts.
  Otherwise the num_leaves / subtree group results (f32) are added pairwise by one fused XLA
  element-wise pass that also casts. `tree_strategy` (tree_mosaic.py, with the tree's entry
  points) picks subtree from (M, N): whole tree when
  the whole-tree work items fill the SMs, groups of 4 leaves otherwise (split-K parallelism for
  decode). This is not a reduction-order choice: all strategies perform the same f32 additions in
  the same order, and a GPU test checks they give identical bits.
Only 16-bit inputs are supported here (f32 falls back to the portable kernel).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.decode_tiles import DEFAULT_TILES, DecodeTiles

BLOCK_M = 128
BLOCK_K = 64


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Tiles of the Mosaic kernel: a function of (N, output dtype, kernel kind) only."""

    tile_m: int  # rows per warpgroup
    tile_n: int  # columns per warpgroup
    tile_k: int
    max_concurrent_steps: int
    wg_split: str = "N"  # the consumer warpgroups sit side by side along "N" or "M"
    num_wgs: int = 2  # consumer warpgroups per CTA (1: a 64-wide decode CTA, see decode_config)
    subtree: int = 1  # leaves combined in registers per work item (1: each leaf is a work item)
    epi_tile_m: int = 64
    epi_tile_n: int = 64

    @property
    def cta_m(self) -> int:
        return self.tile_m * (self.num_wgs if self.wg_split == "M" else 1)

    @property
    def cta_n(self) -> int:
        return self.tile_n * (self.num_wgs if self.wg_split == "N" else 1)


def supports(k: int, n: int, dtype, tree: bool = False) -> bool:
    """Whether the Mosaic kernel handles a (K, N) weight of `dtype` (a function of K, N only)."""
    del tree  # the tree plan of a 16-bit K that is a multiple of 64 always fits
    return jnp.dtype(dtype).itemsize == 2 and k % BLOCK_K == 0 and n % 128 == 0


SMEM_BUDGET = 224 * 1024  # of the 227 KiB an H100 block may use; the rest is barriers


def _stages(cta_m: int, cta_n: int, tile_m: int, tile_n: int, out_dtype, wgs: int = 2,
            tile_k: int = BLOCK_K) -> int:  # fmt: skip
    """Pipeline depth that fills SMEM: bf16 A and B tiles per stage + the epilogue buffers."""
    stage = (cta_m * tile_k + tile_k * cta_n) * 2
    slots = min(2, (tile_m * tile_n) // (64 * 64))
    epilogue = wgs * slots * 64 * 64 * jnp.dtype(out_dtype).itemsize
    return int(min(6, (SMEM_BUDGET - epilogue) // stage))


SMALL_M_ROWS = 64  # M at or below this runs on 64-row CTAs (see mosaic_config)


def decode_rows(m: int, tiles: DecodeTiles = DEFAULT_TILES) -> bool:
    """Whether an M-row product runs on the 64-row decode CTAs (BIO and tree alike)."""
    return tiles.small_m and m <= SMALL_M_ROWS


def decode_config(out_dtype, subtree: int = 1, cta_n: int | None = None,
                  tile_k: int | None = None,
                  tiles: DecodeTiles = DEFAULT_TILES) -> MosaicConfig:  # fmt: skip
    """CTA 64 x cta_n (default `tiles.cta_n`), tile_k (`tiles.tile_k`) columns of K per
    pipeline step; benchmarks/tile_probe.py passes other values to compare them.

    One consumer warpgroup at 64 columns, two side by side at 128: a 64 x 64 accumulator either
    way, the same wgmma instructions per element; only the CTA count (and so the SMs streaming
    weights) changes. 128-wide K steps halve the producer/consumer barrier round trips per CTA;
    the instructions and their order stay those of two 64-wide steps. 64 x 64 CTAs with 128-wide
    K steps are faster than 64 x 128 with 64-wide K at batch 1 on an H100
    (benchmarks/tile_probe.py; BENCHMARKS.md, Kernels): the q|k|v product
    (N = 6144) gets 96 CTAs on 132 SMs instead of 48. tests/pallas_kernels/test_matmul.py checks
    every combination against the 128-row plan on the GPU."""
    wgs = (cta_n or tiles.cta_n) // 64
    tile_k = tile_k or tiles.tile_k
    steps = _stages(64, 64 * wgs, 64, 64, out_dtype, wgs, tile_k)
    return MosaicConfig(tile_m=64, tile_n=64, tile_k=tile_k, max_concurrent_steps=steps,
                        wg_split="N", num_wgs=wgs, subtree=subtree)  # fmt: skip


def mosaic_config(
    n: int, out_dtype, cta_n: int | None = None, m: int | None = None,
    tiles: DecodeTiles = DEFAULT_TILES,
) -> MosaicConfig:  # fmt: skip
    """BIO tile plan for an N-wide output.

    CTA 128 x cta_n with the two warpgroups side by side along N; cta_n = 256 when N % 256 == 0
    (else 128), `cta_n` overrides it for tuning. Stages fill SMEM (4 at 256, 6 at 128).

    Decode (M <= SMALL_M_ROWS): a CTA of 64 rows, 128 columns (one m64 wgmma per warpgroup per
    K step instead of two, twice the CTAs along N). This is the one place M enters, and it cannot
    change a bit: the arithmetic of an output element is the same wgmma k-steps over the same
    64-wide K blocks into an f32 accumulator, whichever CTA shape holds it -- only how many rows
    and columns one CTA computes at once changes. The GPU tests check rows against the 128-row
    plan at every M (tests/pallas_kernels/test_matmul.py) and benchmarks/tile_probe.py checks
    every candidate shape. A 128-row CTA at M = 16 spends 7/8 of its tensor-core time on zero
    rows; with 24 CTAs for N = 6144 that, not HBM, bounded the decode matmul.
    """
    if m is not None and decode_rows(m, tiles) and cta_n is None:
        return decode_config(out_dtype, tiles=tiles)
    if cta_n is None:
        cta_n = 256 if n % 256 == 0 else 128
    tile_n = cta_n // 2
    steps = _stages(BLOCK_M, cta_n, BLOCK_M, tile_n, out_dtype)
    return MosaicConfig(tile_m=BLOCK_M, tile_n=tile_n, tile_k=BLOCK_K, max_concurrent_steps=steps)


# Tree kernel: CTA 128 x tile_n, each consumer warpgroup a 64 x tile_n f32 accumulator plus
# log2(subtree) register partials (64 registers each at tile_n = 128).
TREE_SUBTREE = 2
TREE_TILE_N = 128


def tree_config(
    subtree: int = TREE_SUBTREE,
    tile_n: int = TREE_TILE_N,
    out_dtype=jnp.float32,
    wide=False,
    small=False,
    tiles: DecodeTiles = DEFAULT_TILES,
) -> MosaicConfig:
    """Tile plan of the tree kernel (N % 128 == 0 is all it needs).

    Narrow: CTA 128 x tile_n, warpgroups stacked along M (64 x tile_n accumulators). Wide: CTA
    128 x 2*tile_n like the BIO kernel, warpgroups side by side along N (128 x tile_n accumulators,
    the register partials then spill between leaf ends). Small (decode, M <= 64): `decode_config`,
    CTA 64 x 128 whatever tile_n, so no warpgroup works on zero rows.
    """
    if small:
        return decode_config(out_dtype, subtree, tiles=tiles)
    if wide:
        return MosaicConfig(
            tile_m=128,
            tile_n=tile_n,
            tile_k=BLOCK_K,
            max_concurrent_steps=_stages(128, 2 * tile_n, 128, tile_n, out_dtype),
            wg_split="N",
            subtree=subtree,
        )
    return MosaicConfig(
        tile_m=64,
        tile_n=tile_n,
        tile_k=BLOCK_K,
        max_concurrent_steps=_stages(128, tile_n, 64, tile_n, out_dtype),
        wg_split="M",
        subtree=subtree,
    )


def _num_sms() -> int:
    return jax.devices()[0].core_count


def _kernel(a_gmem, b_gmem, out_gmem, *, cfg: MosaicConfig, num_leaves: int, m_rows: int,
            swiglu: bool = False):  # fmt: skip
    """Work item = (leaf group g, m tile, n tile); group g covers cfg.subtree leaves.

    `swiglu` (BIO only, pallas_kernels/swiglu.py): b is [K, 2N] = [gate | up]; a work item
    accumulates gate's and up's columns of its n tile side by side (two accumulators, the same
    wgmma steps each) and the epilogue writes silu(gate) * up (module `swiglu_epilogue`)."""
    dtype = a_gmem.dtype
    out_dtype = out_gmem.dtype
    k = a_gmem.shape[1]
    n = b_gmem.shape[1] // (2 if swiglu else 1)
    leaf_k = k // num_leaves
    sub = cfg.subtree
    num_groups = num_leaves // sub
    tile_m, tile_n, tile_k = cfg.tile_m, cfg.tile_n, cfg.tile_k
    cta_m, cta_n = cfg.cta_m, cfg.cta_n
    m_iters = m_rows // cta_m
    n_iters = n // cta_n
    k_first = leaf_k // tile_k  # K steps per leaf
    k_iters = sub * k_first

    swizzle = plgpu.find_swizzle(tile_k * jnp.dtype(dtype).itemsize * 8)
    swizzle_elems = swizzle // jnp.dtype(dtype).itemsize
    transforms = (plgpu.TilingTransform((8, swizzle_elems)), plgpu.SwizzleTransform(swizzle))
    epi_m, epi_n = cfg.epi_tile_m, cfg.epi_tile_n
    num_out_slots = min(2, (tile_m * tile_n) // (epi_m * epi_n))
    out_swizzle = plgpu.find_swizzle(epi_n * jnp.dtype(out_dtype).itemsize * 8)
    out_swizzle_elems = out_swizzle // jnp.dtype(out_dtype).itemsize
    out_transforms = (
        plgpu.TilingTransform((8, out_swizzle_elems)),
        plgpu.SwizzleTransform(out_swizzle),
    )

    b_spec = plgpu.BlockSpec(
        (tile_k, cta_n), lambda kk: (kk, 0), transforms=transforms, memory_space=plgpu.SMEM
    )

    def get_pipeline(pipeline_body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            pipeline_body,
            grid=(k_iters,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec(
                    (cta_m, tile_k),
                    lambda kk: (0, kk),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                ),
                b_spec,
                *([b_spec] if swiglu else []),
            ],
            wg_axis="wg",
            num_compute_wgs=cfg.num_wgs,
            max_concurrent_steps=cfg.max_concurrent_steps,
            compute_context=compute_context,
        )

    ignore = lambda *_, **__: None  # noqa: E731 - allocation query only

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            a_gmem, *((b_gmem, b_gmem) if swiglu else (b_gmem,))
        ),
        out_smem=plgpu.SMEM(
            (cfg.num_wgs, num_out_slots, epi_m, epi_n), out_dtype, transforms=out_transforms
        ),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
        wg_idx = lax.axis_index("wg")
        if cfg.wg_split == "M":
            wg_m, wg_n = pl.ds(wg_idx * tile_m, tile_m), slice(None)
        else:
            wg_m, wg_n = slice(None), pl.ds(wg_idx * tile_n, tile_n)

        @plgpu.nd_loop((num_groups * m_iters * n_iters,), collective_axes="cluster_grid")
        def _work_loop(loop_info):
            (lin_idx,) = loop_info.index
            group = lin_idx // (m_iters * n_iters)
            mn = lin_idx % (m_iters * n_iters)
            m_idx, n_idx = plgpu.planar_snake(mn, (m_iters, n_iters), 1, 8)
            m_slice = pl.ds(m_idx * cta_m, cta_m)
            n_slice = pl.ds(n_idx * cta_n, cta_n)
            k_slice = pl.ds(group * sub * leaf_k, sub * leaf_k)
            out_rows = pl.ds(group * m_rows + m_idx * cta_m, cta_m)

            def compute_context(eval_pipeline):
                depth = sub.bit_length() - 1  # live partials of a perfect tree of `sub` leaves
                scoped = {f"s{i}": plgpu.ACC((tile_m, tile_n), jnp.float32) for i in range(depth)}
                if swiglu:  # up's accumulator (depth is 0: BIO)
                    scoped["up"] = plgpu.ACC((tile_m, tile_n), jnp.float32)

                @functools.partial(
                    pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32), **scoped
                )
                def _acc_scope(acc_ref, **stack):
                    stack_refs = [stack[f"s{i}"] for i in range(depth)]
                    if swiglu:
                        eval_pipeline((acc_ref, stack["up"]))
                        out = swiglu_epilogue(acc_ref[...], stack["up"][...], out_dtype)
                    else:
                        eval_pipeline((acc_ref, *stack_refs))
                        # The last leaf is in acc; all counter bits are set: fold the stack in.
                        node = acc_ref[...]
                        for ref in stack_refs:
                            node = ref[...] + node
                        out = node.astype(out_dtype)
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    for mi in range(tile_m // epi_m):
                        for ni in range(tile_n // epi_n):
                            em = slice(mi * epi_m, (mi + 1) * epi_m)
                            en = slice(ni * epi_n, (ni + 1) * epi_n)
                            slot = (mi * (tile_n // epi_n) + ni) % 2
                            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
                            out_smem[wg_idx, slot] = out[em, en]
                            plgpu.commit_smem()
                            plgpu.copy_smem_to_gmem(
                                out_smem.at[wg_idx, slot],
                                out_gmem.at[out_rows, n_slice].at[wg_m, wg_n].at[em, en],
                            )

            def mma_body(idxs, a_smem, b_smem, *rest):
                *up_smem, carry = rest
                acc_ref, *stack_refs = carry
                plgpu.wgmma(acc_ref, a_smem.at[wg_m], b_smem.at[:, wg_n])
                if swiglu:
                    plgpu.wgmma(stack_refs[0], a_smem.at[wg_m], up_smem[0].at[:, wg_n])
                plgpu.wgmma_wait(0)
                if sub > 1:
                    (kk,) = idxs
                    leaf_end = (kk + 1) % k_first == 0
                    leaf = kk // k_first
                    for j in range(sub - 1):  # leaf sub-1 stays in acc for the epilogue

                        @pl.when(leaf_end & (leaf == j))
                        def _push(j=j):
                            node = acc_ref[...]
                            level = 0
                            while (j >> level) & 1:  # binary counter: combine, lower K left
                                node = stack_refs[level][...] + node
                                level += 1
                            stack_refs[level][...] = node
                            acc_ref[...] = jnp.zeros((tile_m, tile_n), jnp.float32)

                return carry

            up = (b_gmem.at[k_slice, pl.ds(n + n_idx * cta_n, cta_n)],) if swiglu else ()
            get_pipeline(mma_body, compute_context)(
                a_gmem.at[m_slice, k_slice],
                b_gmem.at[k_slice, n_slice],
                *up,
                allocations=pipeline_allocs,
            )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def swiglu_epilogue(gate: jax.Array, up: jax.Array, out_dtype) -> jax.Array:
    """silu(g) * u with g, u the f32 accumulators rounded to out_dtype first (what the unfused
    path's bf16 gate|up product holds), in f32, rounded once: jdet/model.py's expression, with
    the sigmoid written as 1 / (1 + exp(-g)) (Mosaic's own lowering of the logistic)."""
    g = gate.astype(out_dtype).astype(jnp.float32)
    u = up.astype(out_dtype).astype(jnp.float32)
    return (g * (1.0 / (1.0 + jnp.exp(-g))) * u).astype(out_dtype)


@functools.partial(jax.jit, static_argnames=("out_dtype", "num_leaves", "cfg", "swiglu"))
def _leaf_products(a: jax.Array, b: jax.Array, out_dtype, num_leaves: int, cfg: MosaicConfig,
                   swiglu: bool = False):  # fmt: skip
    """[num_leaves / cfg.subtree, Mp, N] subtree products, Mp = M padded to the CTA rows (N:
    half of b's columns with `swiglu`)."""
    m, k = a.shape
    n = b.shape[1] // (2 if swiglu else 1)
    if (k // num_leaves) % cfg.tile_k:  # a leaf must be whole pipeline steps: 64-wide steps
        cfg = dataclasses.replace(cfg, tile_k=BLOCK_K)
    pad = -m % cfg.cta_m
    if pad:
        a = jnp.pad(a, ((0, pad), (0, 0)))
    mp = m + pad
    groups = num_leaves // cfg.subtree
    f = plgpu.kernel(
        functools.partial(_kernel, cfg=cfg, num_leaves=num_leaves, m_rows=mp, swiglu=swiglu),
        out_type=jax.ShapeDtypeStruct((groups * mp, n), out_dtype),
        grid=(_num_sms(),),
        grid_names=("cluster_grid",),
        cluster=(1,),
        cluster_names=("cluster",),
        num_threads=cfg.num_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return f(a, b).reshape(groups, mp, n)


def matmul(a: jax.Array, b: jax.Array, out_dtype, cta_n: int | None = None,
           tiles: DecodeTiles = DEFAULT_TILES) -> jax.Array:  # fmt: skip
    """BIO matmul on Hopper: one sequential K range per output tile."""
    m = a.shape[0]
    cfg = mosaic_config(b.shape[1], jnp.dtype(out_dtype), cta_n, m=m, tiles=tiles)
    return _leaf_products(a, b, jnp.dtype(out_dtype), 1, cfg)[0, :m]
