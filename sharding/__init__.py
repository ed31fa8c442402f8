"""Tensor parallelism: a 1-D 'tp' mesh, partition specs for every weight
and the paged KV cache, the model step under `shard_map`, and the pairwise tree all-reduce that
makes TP = 1, 2, 4, 8 bitwise identical in "tp" mode.

Modules: `mesh` (mesh, shard_map shim), `specs` (layouts, padding, kv-head replication),
`tree_allreduce` (the collective + numpy reference), `tp` (sharded step/score, `make_tp_runtime`).
Nothing is imported here, so `import sharding` stays cheap.
"""
