"""Launch choices of the grouped matmul's Pallas kernels (grouped_matmul.py, grouped_slots.py):
how a step's products are spread over programs, never what any output element computes.

A `Launch` leaves every element's reduction plan as it is (the module plan of grouped_matmul.py:
the leaves of block_k steps into an f32 accumulator, the tree over them, the MMA's block_m and
block_k):
- block_n: the output columns of one program, a divisor of the tile config's block_n (the
  weight stays padded to that). A narrower program runs the same K loop for each of its
  columns: the same [block_m, block_k] operand blocks in the same order, an MMA's columns being
  independent as its rows are. More programs for a step of few rows (a decode step's 8 experts
  x 6 column blocks fill 48 of 132 SMs).
- num_warps, num_stages: Triton's warps per program and software-pipeline depth (when loads are
  issued and how the MMA is split over warps, never an MMA's operands or their order).
- k_split (row-order kernel, tree plans): the plan's leaves run in k_split programs per (tile,
  column block), each program a whole subtree of num_leaves / k_split leaves (the binary
  counter over them, as in one program); their f32 results are combined by `combine_tree`
  after the launch: the additions the upper levels of the in-kernel counter perform, lower K on
  the left (why a TP shard's subtree combines to the whole tree). A power of two dividing the
  plan's leaves. For the down projection of a decode step, whose 6 live leaves of 2 block_k
  steps would otherwise run one after another in one program.
- order: "row" or "slot", which of the two kernels runs (the same bits: grouped_slots.py);
  None: slot order from SLOT_ORDER_MIN_ROWS rows. Slot order for a layout of few slots (8 rows
  in `row_tiles`: 512 slots) costs copies of a few MB and loads whole blocks of x.
The tests hold two launches to equal bits (tests/pallas_kernels/test_grouped_launch.py, in
interpret mode); benchmarks/moe_kernel_sweep.py times candidates on a GPU and checks each one's
bits against the default launch. `launch_for` picks a launch from static shapes only (the
step's row count, the number of weights, the plan's leaves): one compiled program per step
shape, never a choice that follows the data.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Launch:
    """None: the tile config's value (`matmul.tile_config`)."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    k_split: int = 1
    order: str | None = None


# Per kind of launch ("pair": gate|up; "tree": a TBIK down; "single": a BIO product), rules
# (rows_below, Launch): the first whose bound exceeds the step's row count applies; none: the
# tile config's launch. Set from benchmarks/moe_kernel_sweep.py's bit-equal timings on an H200
# (Qwen3-30B-A3B shape; BENCHMARKS.md, "Mixture of experts"): one token's 8 rows run slot
# order with 64 columns a program; the 16-token decode bucket's down projection its leaves in 4
# programs (gate|up's default stays fastest there); from 256 rows down runs 64 columns a program.
_FEW = Launch(order="slot", block_n=64)
DEFAULTS: dict[str, tuple[tuple[int, Launch], ...]] = {
    "pair": ((9, _FEW),),
    "tree": ((9, _FEW), (256, Launch(k_split=4)), (1 << 62, Launch(block_n=64))),
    "single": (),
}


def launch_for(rows: int, num_weights: int, num_leaves: int) -> Launch:
    """The launch for a step of `rows` rows (static) of `num_weights` weights and a plan of
    `num_leaves` leaves per program (a TP shard's own); k_split is capped at the leaves."""
    kind = "pair" if num_weights == 2 else "tree" if num_leaves > 1 else "single"
    for bound, launch in DEFAULTS[kind]:
        if rows < bound:
            return dataclasses.replace(launch, k_split=min(launch.k_split, num_leaves))
    return Launch()


def slot_order(launch: Launch, rows: int, min_rows: int) -> bool:
    """Whether the slot-order kernel runs: `launch.order`, else from `min_rows` rows."""
    if launch.order not in (None, "row", "slot"):
        raise ValueError(f"Launch.order must be 'row', 'slot' or None, got {launch.order!r}")
    if launch.order == "slot" and launch.k_split > 1:
        raise ValueError("k_split runs in the row-order kernel only (order='row' or None)")
    return launch.order == "slot" or launch.order is None and rows >= min_rows


def check(cfg, block_n: int | None, k_split: int, num_leaves: int) -> int:
    """The program's block_n (`cfg.block_n` by default); raises for a launch that would change
    the plan or the padding."""
    bn = block_n or cfg.block_n
    if cfg.block_n % bn or bn < 16:
        raise ValueError(f"block_n={bn} must divide the tile config's {cfg.block_n} (>= 16)")
    if k_split < 1 or k_split & (k_split - 1) or num_leaves % k_split:
        raise ValueError(f"k_split={k_split} must be a power of two dividing the plan's "
                         f"{num_leaves} leaves (each program a whole subtree)")  # fmt: skip
    return bn


def compiler_params(cfg, interpret: bool, num_warps: int | None, num_stages: int | None):
    """Triton's params (None in interpret mode)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as pltriton  # slow to import; not on a CPU

    return pltriton.CompilerParams(num_warps=num_warps or cfg.num_warps,
                                   num_stages=num_stages or cfg.num_stages)  # fmt: skip
