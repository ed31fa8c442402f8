"""The TBIK tree's combination order, shared by every backend (no kernel, no imports).

`combine_tree` sums a power-of-two list pairwise: (0+1), (2+3), ..., then up, lower index on the
left. tree_matmul combines its leaves in this order, the Mosaic kernel its leaf groups, and
tree_matmul_partial's shard results combined this way reproduce tree_matmul's f32 result bitwise
(sharding's tree all-reduce performs the same additions). Its own module so that the Mosaic and
Pallas matmul modules can both use it without importing each other.
"""

from __future__ import annotations


def combine_tree(leaves: list) -> object:
    """Sum a power-of-two list pairwise: (0+1), (2+3), ... then up, lower index on the left.

    The same combination turns tree_matmul_partial's shard results into tree_matmul's result.
    """
    if len(leaves) & (len(leaves) - 1) or not leaves:
        raise ValueError(f"combine_tree needs a power-of-two count of parts, got {len(leaves)}")
    level = list(leaves)
    while len(level) > 1:
        level = [level[i] + level[i + 1] for i in range(0, len(level), 2)]
    return level[0]
