"""Tensor-parallel step and score: jdet's one step body (jdet/step.py `step_body`/`score_body`)
under `shard_map` over the 'tp' axis, with the plan's TP Ops. This module holds meshes, partition
specs and the cross-device combines; the kernels are the plan's (jdet/plan.py).

Per device: column-parallel projections produce its heads / FFN columns / vocab columns with the
ordinary (BIO) matmul; each output column is reduced whole over its input width I, so its bits
do not depend on TP as long as the kernel's tile along N does not change with the shard width
(true when every shard is >= 128 columns, as with head_dim 128 models; narrower shards get a
narrower block_n, which on CPU changes the bits of the tile's dot).
The two row-parallel projections (o_proj, down_proj) each produce an f32 partial over the device's
contiguous shard of the input width I, combined across devices before the cast:
  "tp"    partial = `tree_matmul_partial` (the exact subtree of shard r) and combine =
          `tree_allreduce` (the upper levels of the same tree): bitwise the TP=1 tree_matmul.
  "batch" partial = BIO matmul (sequential over I), combine = `lax.psum`: faster, not TP-invariant.
  "none"  partial = XLA dot and combine = `lax.psum`: the baseline.
Logits: each device computes its vocab columns; `all_gather` over vocab is a copy (exact), the
padded columns are sliced off, and then every device runs the same sampling / log_softmax on the
same full logits, so all outputs are replicated and identical.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jdet.batch import StepBatch
from jdet.config import ModelConfig
from jdet.kv_cache import make_halves, storage_dtype
from jdet.ops import Ops
from jdet.plan import (
    Plan,
    cpu_devices,
    fuse_default,
    prepare_params,
    releaser,
    row_partial_kernel,
    shares_buffer,
)
from jdet.sampling import SampleOut, SamplingInputs
from jdet.step import jit_step, logits_body, score_body, step_body
from jdet.tp_layout import check_heads, kv_heads_in_cache
from sharding.mesh import TP_AXIS, make_tp_mesh, shard_map, tp_size
from sharding.specs import kv_partition_specs, named, param_partition_specs
from sharding.tree_allreduce import ALGORITHMS, psum_parts, tree_allreduce_parts


def make_tp_ops(ops_mode: str, num_shards: int, allreduce: str = "auto", **ops_kw: Any) -> Ops:
    """The per-device Ops of a TP shard (valid inside shard_map over TP_AXIS): the plan's
    row-parallel partial (jdet/plan.py `row_partial_kernel`) and the cross-device combine, the
    tree all-reduce in "tp" (`allreduce`: its schedule, sharding/tree_allreduce.py ALGORITHMS;
    every one gives the same bits) and psum otherwise. `ops_kw` sets the other Ops fields
    (attn_partition) for benchmarks; the layout fields default to that of `shard_params`'
    weights (lm_head untied; q|k|v and gate|up fused where `fuse_default()`)."""
    row_partial = row_partial_kernel(ops_mode, num_shards)  # validates the mode
    if allreduce not in ALGORITHMS:
        raise ValueError(f"allreduce must be one of {ALGORITHMS}, got {allreduce!r}")
    if ops_mode == "tp":
        row_reduce = functools.partial(tree_allreduce_parts, axis_name=TP_AXIS,
                                       algorithm=allreduce)  # fmt: skip
    else:
        row_reduce = functools.partial(psum_parts, axis_name=TP_AXIS)

    # the residual stream padded as the Hopper matmuls want it (Ops.pad_rows): in "tp" the
    # all-reduce skips the padding rows, psum would send them
    ops_kw.setdefault("pad_rows", num_shards == 1 or ops_mode == "tp")
    ops_kw.setdefault("row_shards", num_shards)  # the experts' down_proj subtree (jdet/moe.py)
    # one shard: the cross-device combine is the identity, so o_proj's partial may be combined,
    # added and normalised in one kernel (Ops.residual_norm); across shards it may not
    ops_kw.setdefault("fuse_residual_norm", num_shards == 1)
    ops_kw.setdefault("fused", fuse_default())  # as prepare_params(fuse=None) lays them out
    ops_kw.setdefault("untied", True)  # pad_params always holds a padded lm_head
    return Ops(invariance=ops_mode, row_partial=row_partial, row_reduce=row_reduce, **ops_kw)


def shard_params(
    params: dict,
    cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    *,
    ffn_multiple: int | None = None,
    fuse: bool | None = None,
    blocked: bool = False,
    donate: bool = False,
) -> dict:
    """Pad, replicate kv heads as the mesh needs, fuse, hold the matmul weights as the kernels
    take them (jdet/plan.py `prepare_params`; `blocked`: Plan.blocked), and place every weight
    by its partition spec. `donate`: the caller's arrays are freed as their replacements are
    made (jdet/plan.py `releaser`), so the weights are never held twice; the caller's params
    must not be used afterwards."""
    p = prepare_params(params, cfg, tp_size(mesh), ffn_multiple=ffn_multiple, fuse=fuse,
                       blocked=blocked, donate=donate)  # fmt: skip
    if tp_size(mesh) > 1 and cpu_devices(mesh.devices.flat):
        # Split on the host: placing a jax.Array on a split sharding compiles one slicing
        # program per weight shape and spec (JAX's `_multi_slice`: 22 compiles for TP 2/4/8 of
        # the tiny test model); from numpy the shards are host slices of the same bytes.
        p = jax.tree.map(np.asarray, p)
    placed = jax.device_put(p, named(mesh, param_partition_specs(p, cfg)))
    if donate:  # the caller's arrays the layout kept, now copied onto the mesh's shards
        release = releaser(params, donate)
        new = {id(x) for x in jax.tree_util.tree_leaves(placed)}
        for old in jax.tree_util.tree_leaves(params):
            if id(old) not in new and not _aliased(old, placed):
                release(old)
    return placed


def _aliased(old: Any, placed: dict) -> bool:
    """Whether any placed weight holds `old`'s buffer (jdet/plan.py `shares_buffer`)."""
    if not isinstance(old, jax.Array) or old.is_deleted():
        return True
    return any(shares_buffer(old, x) for x in jax.tree_util.tree_leaves(placed))


def init_tp_kv_cache(
    cfg: ModelConfig,
    mesh: jax.sharding.Mesh,
    num_pages: int,
    page_size: int,
    dtype: Any = jnp.bfloat16,
) -> dict:
    """A KV cache `[L, K', P, B, E]` split over kv heads (K' = max(K, tp): replicated heads)."""
    k = kv_heads_in_cache(cfg, tp_size(mesh))
    sharding = NamedSharding(mesh, P(None, TP_AXIS))
    shape = (cfg.num_layers, k, num_pages, page_size, cfg.head_dim)
    dt = storage_dtype(dtype)
    if cpu_devices(mesh.devices.flat):
        # Zeros made by numpy and placed: the jitted maker below compiles a program (a cost in
        # every cold `jdet generate`); the same zeros, the same placement.
        return {n: jax.device_put(np.zeros(shape, dt), sharding) for n in ("k", "v")}
    return make_halves(_zeros_maker(shape, dt, sharding))


@functools.cache
def _zeros_maker(shape: tuple, dtype: Any, sharding: NamedSharding) -> Callable[[], jax.Array]:
    """One jitted program making one zeroed half of the pool in place on the mesh (cached, so
    the tries of a pool's sizing compile it once per size)."""
    return jax.jit(functools.partial(jnp.zeros, shape, dtype), out_shardings=sharding)


def _gather_vocab(logits: jax.Array) -> jax.Array:
    """Each device's vocab columns [N, V_pad / tp] -> the full [N, V_pad] on every device."""
    return lax.all_gather(logits, TP_AXIS, axis=1, tiled=True)


def _wrap(
    cfg: ModelConfig, mesh: jax.sharding.Mesh, params: dict, kv: dict, body: Callable, n_rest: int
) -> Callable:
    in_specs = (param_partition_specs(params, cfg), kv_partition_specs(kv), P()) + (P(),) * n_rest
    return shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=(kv_partition_specs(kv), P()))


@functools.cache  # one compile cache per (config, mode, mesh): engines share it
def make_tp_step(
    cfg: ModelConfig, ops_mode: str, mesh: jax.sharding.Mesh, **ops_kw: Any
) -> Callable:
    """step(params, kv, batch, sampling) -> (kv, SampleOut), as jdet.step.make_step_fn, on `mesh`.

    `params` must come from `shard_params` (padded, kv heads replicated, placed) and `kv` from
    `init_tp_kv_cache`. `ops_kw`: make_tp_ops' keywords (`allreduce`, Ops fields).
    """
    check_heads(cfg, tp_size(mesh))
    ops = make_tp_ops(ops_mode, tp_size(mesh), **ops_kw)
    body = step_body(cfg, ops, _gather_vocab)

    @jit_step(ops)
    def step(
        params: dict, kv: dict, batch: StepBatch, sampling: SamplingInputs
    ) -> tuple[dict, SampleOut]:
        return _wrap(cfg, mesh, params, kv, body, 1)(params, kv, batch, sampling)

    return step


def tp_logits_body(
    cfg: ModelConfig, ops_mode: str, mesh: jax.sharding.Mesh, **ops_kw: Any
) -> tuple[Callable, Ops]:
    """make_tp_step's forward without the sampler, not jitted: ((params, kv, batch) -> (kv,
    f32 logits [N, V] replicated), its Ops). An engine jits it and runs the sampler apart
    (serving/engine/host_inputs.py `SplitStep`)."""
    check_heads(cfg, tp_size(mesh))
    ops = make_tp_ops(ops_mode, tp_size(mesh), **ops_kw)
    body = logits_body(cfg, ops, _gather_vocab)

    def forward(params: dict, kv: dict, batch: StepBatch) -> tuple[dict, jax.Array]:
        return _wrap(cfg, mesh, params, kv, body, 0)(params, kv, batch)

    return forward, ops


@functools.cache  # one compile cache per (config, mode, mesh): engines share it
def make_tp_score(
    cfg: ModelConfig, ops_mode: str, mesh: jax.sharding.Mesh, **ops_kw: Any
) -> Callable:
    """score(params, kv, batch, targets) -> (kv, f32[N]) as jdet.step.make_score_fn, on `mesh`.
    `ops_kw`: as make_tp_step."""
    check_heads(cfg, tp_size(mesh))
    ops = make_tp_ops(ops_mode, tp_size(mesh), **ops_kw)
    body = score_body(cfg, ops, _gather_vocab)

    @jit_step(ops, nested=True)
    def score(
        params: dict, kv: dict, batch: StepBatch, targets: jax.Array
    ) -> tuple[dict, jax.Array]:
        return _wrap(cfg, mesh, params, kv, body, 1)(params, kv, batch, targets)

    return score


@dataclasses.dataclass(frozen=True)
class TPRuntime:
    """Everything a caller (jdet.LLM, the engine) needs to run a model on `tp` devices.

    `step`/`score` have the signatures of jdet.step's make_step_fn/make_score_fn, and `init_kv`
    that of init_kv_cache minus cfg. Used for TP=1 too in "tp" mode (jdet/plan.py `Plan.sharded`):
    the padded FFN is what makes TP=1 and TP=N perform the same down_proj tree.
    """

    mesh: jax.sharding.Mesh
    params: dict
    step: Callable
    score: Callable
    init_kv: Callable


def make_tp_runtime(
    params: dict, cfg: ModelConfig, tp: int, invariance: str = "tp", donate: bool = False
) -> TPRuntime:
    """Mesh of the first `tp` devices, weights padded and placed, jitted step and score.
    `donate`: as `shard_params` (the caller's params are consumed)."""
    plan = Plan(cfg, invariance, tp)  # validates heads, mode and TP size
    plan.check_tree_shards(jax.tree_util.tree_leaves(params)[0].dtype)
    mesh = make_tp_mesh(tp)
    return TPRuntime(
        mesh=mesh,
        params=shard_params(params, cfg, mesh, blocked=plan.blocked, donate=donate),
        step=make_tp_step(cfg, invariance, mesh),
        score=make_tp_score(cfg, invariance, mesh),
        init_kv=functools.partial(init_tp_kv_cache, cfg, mesh),
    )
