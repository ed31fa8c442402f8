"""Split (decode) paged attention on Hopper as Mosaic GPU kernels: the other layout of the Mosaic
kernel family of pallas_kernels/paged_attention_mosaic.py (docstring there: the plan), for steps
with few long sequences, where the looped kernel's (tile, KV head) grid cannot fill the GPU
(docs/PREFILL_ATTENTION.md, "Decode runs the same code"). `Ops` runs it under
JDET_ATTENTION=mosaic (pallas_kernels/_platform.py) for the steps `auto_structure` splits.

Reduction plan: the looped kernel's, by construction, not by a second copy of it:
- `split_tiles`: grid (KV head, query tile, partition j); a producer warpgroup streams the
  partition's KV blocks through the same ring (`produce`), one consumer warpgroup (64 rows, one
  wgmma M) runs the one partition body (`partition_body`: the same block loop, masks and
  stopping rule) from the sentinel and writes partition j's (m, l, acc) in f32 (exact).
  Partitions at or past the tile's last needed one (`n_parts`) are neither computed nor read.
- `merge_tiles`: grid (KV head, query tile); a producer streams partitions 0 .. n_parts-1 (f32
  m, l, acc) into a ring, the consumer loads them into the layouts the looped kernel's fold
  holds them in (WGMMA, and its row reduction for m and l) and folds them in increasing j with
  the one `merge`, from the sentinel, then `finish` (A / L): the looped kernel's fold and
  epilogue, the same expressions on the same layouts.
So a row's bits do not depend on the layout: tests/pallas_kernels/test_paged_attention_mosaic*
check looped == split, one-shot == chunks == decodes, and controls that must differ.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.paged_attention_kernels import ROWS
from pallas_kernels.paged_attention_mosaic_body import (
    _LOG2E,
    _interpret_params,
    _load,
    _load_lim,
    _sentinel,
    _Static,
    compute_registers,
    finish,
    merge,
    partition_body,
    produce,
    stream,
)
from pallas_kernels.paged_attention_pallas import SPLIT_PARTIALS_MAX_BYTES, split_partials_bytes

# structure="auto" splits only a step of at most SPLIT_MAX_TOKENS tokens (the engine's smallest
# bucket: decodes of up to 16 sequences) whose partials fit SPLIT_PARTIALS_MAX_BYTES; every other
# step runs looped. Why (benchmarks/attention_steps.py on an H200; BENCHMARKS.md, "Prefill"):
# the split layout wins only for a few long decodes; from 32 sequences and for prompt chunks the
# looped launch is faster, as its partials never leave the SM.
SPLIT_MAX_TOKENS = 16


def auto_structure(t: int, page_table_shape: tuple, kh: int, gp: int, e: int, page: int,
                   partition_size: int) -> str:  # fmt: skip
    """"split" or "looped" from static shapes alone: T tokens, S sequences x Pmax pages, the
    split layout's 64-row tiles. Never a bit: both layouts run one partition body and one merge
    order."""
    s, pmax = page_table_shape
    nt = -(-t // max(1, ROWS // gp)) + s
    num_parts = max(1, -(-(pmax * page) // partition_size))
    small = split_partials_bytes(nt, kh, num_parts, ROWS, e) <= SPLIT_PARTIALS_MAX_BYTES
    return "split" if t <= SPLIT_MAX_TOKENS and small else "looped"


def _transforms(dtype):
    """SMEM tiling + 128-byte swizzle of a [rows, E] operand (what wgmma and TMA want)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    minor = 128 // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(128))


def _split_kernel(layer_ref, bounds_ref, pt_ref, lim_ref, q_ref, k_ref, v_ref, acc_ref, m_ref,
                  l_ref, scoped, *, st: _Static):  # fmt: skip
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (q_smem, lim_smem, k_smem, v_smem, acc_smem, m_smem, l_smem), bars, used = scoped
    k_full, v_full, q_bar = bars
    ring = (k_smem, v_smem, k_full, v_full, *used)
    kvh, tile, j = lax.axis_index("kvh"), lax.axis_index("tile"), lax.axis_index("part")
    wg = lax.axis_index("wg")
    my_blocks = st.blocks(bounds_ref[tile, 0, 0])
    live = j < lax.div(my_blocks + (st.nb - 1), jnp.int32(st.nb))  # the merge reads no others
    first = j * st.nb

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(compute_registers(1), action="increase")

        @pl.when(live)
        def _():
            plgpu.copy_gmem_to_smem(q_ref.at[tile, kvh], q_smem, q_bar.at[0])
            plgpu.copy_gmem_to_smem(lim_ref.at[tile], lim_smem, q_bar.at[0])
            plgpu.barrier_wait(q_bar.at[0])
            lim = _load_lim(lim_smem, st)
            m, lsum, acc = partition_body(j, first, my_blocks, bounds_ref[tile, 0, 1], q_smem,
                                          lim, ring, st)  # fmt: skip
            acc_smem[...] = acc
            m_smem[...] = m
            l_smem[...] = lsum
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(acc_smem, acc_ref.at[tile, kvh, j])
            plgpu.copy_smem_to_gmem(m_smem, m_ref.at[tile, kvh, j])
            plgpu.copy_smem_to_gmem(l_smem, l_ref.at[tile, kvh, j])
            plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        @pl.when(live)
        def _():
            base = (layer_ref[0] * st.kv_heads + kvh) * st.num_pages
            produce(first, jnp.minimum(my_blocks, first + st.nb), base,
                    lambda x: pt_ref[tile, x], k_ref, v_ref, ring, st)  # fmt: skip


def _merge_kernel(bounds_ref, acc_ref, m_ref, l_ref, o_ref, scoped, *, st: _Static,
                  reverse: bool):  # fmt: skip
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    (o_smem, acc_smem, m_smem, l_smem), (full,), (used,) = scoped
    rows, e = o_smem.shape
    kvh, tile, wg = lax.axis_index("kvh"), lax.axis_index("tile"), lax.axis_index("wg")
    n_parts = lax.div(st.blocks(bounds_ref[tile, 0, 0]) + (st.nb - 1), jnp.int32(st.nb))

    def part_of(i):  # the i-th partition folded: increasing j (decreasing: the tests' control)
        return n_parts - 1 - i if reverse else i

    @pl.when(wg == 0)
    def _consumer():
        plgpu.set_max_registers(compute_registers(1), action="increase")

        def fold(i, state):
            slot = lax.rem(i, jnp.int32(st.steps))
            plgpu.barrier_wait(full.at[slot])
            if st.interpret:
                part = (m_smem.at[slot][...], l_smem.at[slot][...], acc_smem.at[slot][...])
            else:
                vec = plgpu.Layout.WGMMA.reduce(1)
                part = (_load(plgpu, m_smem.at[slot], vec), _load(plgpu, l_smem.at[slot], vec),
                        _load(plgpu, acc_smem.at[slot], plgpu.Layout.WGMMA))  # fmt: skip
            plgpu.barrier_arrive(used.at[slot])
            return merge(state, part)

        state = lax.fori_loop(0, n_parts, fold, _sentinel(rows, e, st))
        o_smem[...] = finish(state).astype(o_smem.dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_ref.at[tile, kvh])
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
        plgpu.set_max_registers(40, action="decrease")

        def load(i, slot):
            j = part_of(i)
            plgpu.copy_gmem_to_smem(m_ref.at[tile, kvh, j], m_smem.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(l_ref.at[tile, kvh, j], l_smem.at[slot], full.at[slot])
            plgpu.copy_gmem_to_smem(acc_ref.at[tile, kvh, j], acc_smem.at[slot], full.at[slot])

        stream(jnp.int32(0), n_parts, load, (used,), st.steps)


def _launch(body, out_type, grid: dict, scoped: tuple, interpret, *args):
    """plgpu.kernel with a producer and one consumer warpgroup; `scoped` its run_scoped
    allocations (SMEM, then barriers, then the consumers' release barriers)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    def entry(*refs):
        pl.run_scoped(lambda *alloc: body(*refs, alloc), *scoped, collective_axes="wg")

    return plgpu.kernel(
        entry,
        out_type=out_type,
        grid=tuple(grid.values()),
        grid_names=tuple(grid),
        num_threads=2,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(approx_math=True),
        **({} if interpret is None else {"interpret": _interpret_params()}),
    )(*args)


def split_tiles(q_tiles, k_pool, v_pool, pt, lim, bounds, layer, *, scale: float,
                num_pages: int, kv_heads: int, block_kv: int = 64, partition_size: int = 512,
                steps: int = 2, mask_all: bool = False, interpret=None):  # fmt: skip
    """Partition j's (acc [NT, K, J, rows, E], m and l [NT, K, J, rows]) f32 of the query tiles
    [NT, K, rows, E] (`looped_tiles`' operands; bounds `tile_bounds(lim, 1)`). Entries of
    partitions past a tile's end are left unwritten: `merge_tiles` never reads them."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nt, kh, rows, e = q_tiles.shape
    page = k_pool.shape[1]
    if rows != ROWS or partition_size % block_kv or block_kv % page or block_kv % 64:
        raise ValueError(f"rows {rows} must be {ROWS}, block_kv ({block_kv}) a multiple of 64 "
                         f"and of the page ({page}) dividing partition_size ({partition_size})")
    steps = max(2, steps)
    j = pt.shape[1] * page // partition_size  # attention_meta pads pt to whole partitions
    st = _Static(block_kv, partition_size, page, steps, float(scale) * _LOG2E,
                 interpret is not None, mask_all, num_pages, kv_heads)  # fmt: skip
    dt, f32 = q_tiles.dtype, jnp.float32
    fills = block_kv // page
    scoped = (
        (plgpu.SMEM((ROWS, e), dt, transforms=_transforms(dt)), plgpu.SMEM((ROWS,), jnp.int32),
         plgpu.SMEM((steps, block_kv, e), dt, transforms=_transforms(dt)),
         plgpu.SMEM((steps, block_kv, e), dt, transforms=_transforms(dt)),
         plgpu.SMEM((ROWS, e), f32, transforms=_transforms(f32)), plgpu.SMEM((ROWS,), f32),
         plgpu.SMEM((ROWS,), f32)),
        (plgpu.Barrier(num_arrivals=fills, num_barriers=steps),
         plgpu.Barrier(num_arrivals=fills, num_barriers=steps),
         plgpu.Barrier(num_arrivals=2, num_barriers=1)),
        (plgpu.Barrier(num_arrivals=1, num_barriers=steps),) * 2,
    )  # fmt: skip
    out_type = (jax.ShapeDtypeStruct((nt, kh, j, rows, e), f32),
                jax.ShapeDtypeStruct((nt, kh, j, rows), f32),
                jax.ShapeDtypeStruct((nt, kh, j, rows), f32))  # fmt: skip
    body = functools.partial(_split_kernel, st=st)
    return _launch(body, out_type, {"kvh": kh, "tile": nt, "part": j}, scoped, interpret,
                   layer, bounds, pt, lim, q_tiles, k_pool, v_pool)  # fmt: skip


def merge_tiles(acc, m, lsum, bounds, *, dtype, block_kv: int, partition_size: int,
                steps: int = 2, reverse: bool = False, interpret=None) -> jax.Array:  # fmt: skip
    """Fold `split_tiles`' partials in increasing j (`reverse`: decreasing, a control):
    [NT, K, rows, E] of `dtype`, as `looped_tiles` returns."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    nt, kh, _, rows, e = acc.shape
    steps = max(2, steps)
    st = _Static(block_kv, partition_size, block_kv, steps, 1.0, interpret is not None)
    f32 = jnp.float32
    scoped = (
        (plgpu.SMEM((rows, e), dtype, transforms=_transforms(dtype)),
         plgpu.SMEM((steps, rows, e), f32, transforms=_transforms(f32)),
         plgpu.SMEM((steps, rows), f32), plgpu.SMEM((steps, rows), f32)),
        (plgpu.Barrier(num_arrivals=3, num_barriers=steps),),
        (plgpu.Barrier(num_arrivals=1, num_barriers=steps),),
    )  # fmt: skip
    body = functools.partial(_merge_kernel, st=st, reverse=reverse)
    return _launch(body, jax.ShapeDtypeStruct((nt, kh, rows, e), dtype),
                   {"kvh": kh, "tile": nt}, scoped, interpret, bounds, acc, m, lsum)  # fmt: skip
