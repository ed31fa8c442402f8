"""How the Hopper (Mosaic GPU) matmul kernels spread a product of few rows (decode) over CTAs.

`DecodeTiles` is data passed down to `matmul`, `tree_matmul`, `tree_matmul_parts` and
`swiglu.matmul_swiglu` (jdet's `Ops.decode_tiles` carries one; benchmarks build others to measure
them). No field changes an output element's arithmetic: every choice runs the same K=16 wgmma
instructions in the same order into one f32 accumulator, and only moves rows and columns between
CTAs or groups the instructions into fewer pipeline steps (the reduction plan is in
matmul_mosaic.py's docstring; tests/pallas_kernels/test_matmul.py compares every combination
with the 128-row plan on the GPU). Kept apart from matmul_mosaic.py, which imports Mosaic GPU
(Hopper only), so that the model's Ops can hold one anywhere.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class DecodeTiles:
    # M <= 64 runs on 64-row CTAs (False: the 128-row plan at every M, which spends most of a
    # decode CTA's tensor-core time on zero rows)
    small_m: bool = True
    # columns of a decode CTA: 64 (one consumer warpgroup), or 128 (two side by side, half the
    # CTAs); 64 gives a narrow projection more CTAs to stream its weight with
    cta_n: int = 64
    # K columns per pipeline step of a decode CTA (64: twice the producer/consumer round trips)
    tile_k: int = 128


DEFAULT_TILES = DecodeTiles()
