"""The grouped matmul's row layout (pallas_kernels/grouped_matmul.py): which tile and slot each
row of a step takes, integer arithmetic only.

R rows with group ids (a mixture-of-experts layer's (token, slot) rows and their experts) are
cut into tiles of `block_m` slots, every tile holding rows of one group:
- `group_tiles`: rows sorted by (group, row), each group's rows starting on a tile boundary;
  at most ceil(R / block_m) + min(G, R) tiles hold rows, and they lead (`live_first`). Computed
  by comparisons up to COMPARE_MAX_ROWS rows (a few fused reductions: a row's rank in its group
  is the number of earlier rows of that group, a slot finds its row by comparing every row's
  slot), by a sort beyond: on a GPU the sort and its four scatters are each a launch of their
  own in every layer, the comparisons two or three fused reductions. The same integers either
  way (tests/pallas_kernels/test_grouped_matmul.py).
- `row_tiles`: row r alone in tile r; a few element-wise ops. A group serving several rows
  then has a tile (and a read of its weight) per row, so it pays only for so few rows that two
  seldom share a group (grouped_matmul.py `layout`).
A row whose id is G (or more) is left out: no slot, no tile, a zero output row (a step's
padding tokens). Neither layout nor a row's place in it changes the row's bits (the kernels'
rows are independent); only which tiles run follows the rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

# `group_tiles` by comparisons up to this many rows (decode and small prefill chunks); a sort
# beyond, where the [slots, rows] comparison would outgrow the sort it replaces.
COMPARE_MAX_ROWS = 512


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["slot_row", "row_slot", "tile_group", "group_sizes"],
    meta_fields=["block_m", "live_first"],
)
@dataclasses.dataclass(frozen=True)
class GroupedTiles:
    """Where every row sits in a grouped layout of P = num_tiles * block_m slots.

    slot_row [P]: the row held by each slot (R, one past the last row, for an empty slot);
    row_slot [R]: each row's slot (P for a row left out); tile_group [num_tiles]: each tile's
    group, -1 for a tile that holds no row (it does not run); group_sizes [G]: slots of each
    group (its row count padded to block_m: `lax.ragged_dot`'s group sizes over a sorted
    layout). live_first: the tiles that hold rows lead (`group_tiles`; the CPU path needs it),
    not so in `row_tiles`."""

    slot_row: jax.Array
    row_slot: jax.Array
    tile_group: jax.Array
    group_sizes: jax.Array
    block_m: int
    live_first: bool = True

    @property
    def num_slots(self) -> int:
        return self.slot_row.shape[0]

    @property
    def num_rows(self) -> int:
        return self.row_slot.shape[0]


def num_tiles(rows: int, groups: int, block_m: int) -> int:
    """Tiles of the layout: enough for any grouping of `rows` rows (each group wastes < 1)."""
    return -(-rows // block_m) + min(groups, rows)


def group_tiles(group_ids: jax.Array, num_groups: int, block_m: int) -> GroupedTiles:
    """The grouped layout of rows with `group_ids` [R] (int): rows sorted by (group, row index),
    each group's rows starting on a tile boundary. A row whose id is num_groups (or more) is
    left out (no slot, a zero output row: e.g. a step's padding rows, which then take no tile).
    Integer arithmetic only: by comparisons up to COMPARE_MAX_ROWS rows, by a sort beyond (the
    same layout)."""
    ids = jnp.minimum(group_ids.astype(jnp.int32), num_groups)
    if ids.shape[0] <= COMPARE_MAX_ROWS:
        return _layout_by_comparison(ids, num_groups, block_m)
    return _layout_by_sort(ids, num_groups, block_m)


def _tile_group(ends: jax.Array, nt: int, block_m: int) -> jax.Array:
    """Each tile's group from the groups' end slots (-1 past the last group's)."""
    tile_start = jnp.arange(nt, dtype=jnp.int32) * block_m
    # compare_all: one element-wise comparison [tiles, groups], no loop (the default binary
    # search is a loop, which a GPU runs as host-driven iterations in every layer)
    tg = jnp.searchsorted(ends, tile_start, side="right", method="compare_all").astype(jnp.int32)
    return jnp.where(tile_start < ends[-1], tg, -1)


def _layout_by_sort(ids: jax.Array, num_groups: int, block_m: int) -> GroupedTiles:
    r = ids.shape[0]
    nt = num_tiles(r, num_groups, block_m)
    p = nt * block_m
    order = jnp.argsort(ids * r + jnp.arange(r, dtype=jnp.int32))  # unique keys: one order
    counts = jnp.zeros(num_groups + 1, jnp.int32).at[ids].add(1)[:num_groups]
    padded = (counts + block_m - 1) // block_m * block_m
    start = jnp.append(jnp.cumsum(padded) - padded, p)  # first slot of each group; P: left out
    first = jnp.append(jnp.cumsum(counts) - counts, 0)  # first sorted position of each group
    sorted_ids = ids[order]
    rank = jnp.arange(r, dtype=jnp.int32) - first[sorted_ids]
    dest = jnp.where(sorted_ids < num_groups, start[sorted_ids] + rank, p)  # slot of sorted row
    slot_row = jnp.full(p, r, jnp.int32).at[dest].set(order.astype(jnp.int32), mode="drop")
    row_slot = jnp.zeros(r, jnp.int32).at[order].set(dest)
    tile_group = _tile_group(start[:num_groups] + padded, nt, block_m)
    return GroupedTiles(slot_row, row_slot, tile_group, padded, block_m)


def _layout_by_comparison(ids: jax.Array, num_groups: int, block_m: int) -> GroupedTiles:
    """`_layout_by_sort`'s layout without a sort or a scatter: a row's rank in its group is the
    number of earlier rows of that group ([R, R] comparison), the slot of each row follows, and
    each slot finds its row by an [P, R] comparison."""
    r = ids.shape[0]
    nt = num_tiles(r, num_groups, block_m)
    p = nt * block_m
    i32 = jnp.int32
    row = jnp.arange(r, dtype=i32)
    counts = jnp.sum(ids[:, None] == jnp.arange(num_groups, dtype=i32)[None, :], axis=0,
                     dtype=i32)  # fmt: skip
    rank = jnp.sum((ids[None, :] == ids[:, None]) & (row[None, :] < row[:, None]), axis=1,
                   dtype=i32)  # fmt: skip
    padded = (counts + block_m - 1) // block_m * block_m
    start = jnp.cumsum(padded) - padded
    live = ids < num_groups
    row_slot = jnp.where(live, start[jnp.minimum(ids, num_groups - 1)] + rank, p)
    hit = row_slot[None, :] == jnp.arange(p, dtype=i32)[:, None]  # [P, R]: at most one per slot
    slot_row = jnp.sum(jnp.where(hit, row[None, :] - r, 0), axis=1, dtype=i32) + r
    tile_group = _tile_group(start + padded, nt, block_m)
    return GroupedTiles(slot_row, row_slot.astype(i32), tile_group, padded, block_m)


def row_tiles(group_ids: jax.Array, num_groups: int, block_m: int) -> GroupedTiles:
    """One tile per row: row r alone in slot 0 of tile r (a row left out: tile r is empty).
    A group serving several rows has a tile for each (its weight read once per row), so this
    layout pays only where rows seldom share a group (`layout`). Not for the CPU path, whose
    loop runs the leading tiles (`live_first` is False)."""
    ids = jnp.minimum(group_ids.astype(jnp.int32), num_groups)
    r = ids.shape[0]
    p = r * block_m
    live = ids < num_groups
    slot = jnp.arange(p, dtype=jnp.int32)
    owner = slot // block_m
    slot_row = jnp.where((slot % block_m == 0) & live[owner], owner, r)
    row_slot = jnp.where(live, jnp.arange(r, dtype=jnp.int32) * block_m, p)
    tile_group = jnp.where(live, ids, -1)
    counts = jnp.sum(ids[:, None] == jnp.arange(num_groups, dtype=jnp.int32)[None, :], axis=0,
                     dtype=jnp.int32)  # fmt: skip
    return GroupedTiles(slot_row, row_slot, tile_group, counts * block_m, block_m, False)


def gather_rows(x: jax.Array, tiles: GroupedTiles, per_src: int = 1) -> jax.Array:
    """The rows (row r: x[r // per_src]) in the layout's slot order [P, K]; empty slots hold
    zero rows."""
    xp = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
    r = tiles.num_rows
    return xp[jnp.where(tiles.slot_row < r, tiles.slot_row // per_src, x.shape[0])]


def scatter_rows(y: jax.Array, tiles: GroupedTiles) -> jax.Array:
    """The grouped layout's [P, N] back in row order [R, N] (zeros for rows left out)."""
    return jnp.take(y, tiles.row_slot, axis=0, mode="fill", fill_value=0)


def row_groups(tiles: GroupedTiles) -> jax.Array:
    """Each row's group [R] (num_groups-free: -1 for a row left out)."""
    p = tiles.num_slots
    tg = tiles.tile_group[jnp.minimum(tiles.row_slot, p - 1) // tiles.block_m]
    return jnp.where(tiles.row_slot < p, tg, -1)
