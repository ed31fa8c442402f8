"""The reduction plan: every decision the bits depend on, made once from (model config, invariance,
tp, dtype).

A newcomer's map: `invariance` and `tp` enter here and nowhere else is validated or branched on for
them outside the kernels' dispatch in jdet/ops.py.
- which runtime: `Plan.sharded` — the `shard_map` step (sharding/tp.py) for tp > 1, and in "tp"
  mode at tp = 1 too (the padded FFN below is what makes TP=1 and TP=N reduce down_proj in the same
  tree); the plain jitted step (jdet/step.py) otherwise. Both run the same step body.
- which kernel per op: `Plan.ops()` (jdet/ops.py: BIO matmul, tree matmul, fixed-partition paged
  attention, invariant norms and log_softmax, or XLA in "none") and `row_partial_kernel` (the
  row-parallel projection's per-device partial under TP; sharding only combines the partials).
- the weight layout: `pad_params` (FFN width to a multiple of the tree kernel's block_k x MAX_TP for
  every TP size; vocabulary to 128 x MAX_TP), `prepare_params` (+ kv heads replicated when
  tp > kv heads, + q|k|v and gate|up fused where the kernel makes that exact).
- the attention partition (`attn_partition`) and the fields `system_fingerprint` hashes
  (`Plan.kernel_plan`).
- which kernel backend: `backend()` / `Plan.backend` (Pallas on a GPU, `xla_fixed` on a CPU,
  interpret mode for the kernel tests: pallas_kernels/_platform.py `Backend`). Every other module
  asks it (a property such as `backend().cpu`) rather than probing the platform itself;
  tests/test_layers.py keeps it so.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jdet.config import ModelConfig
from jdet.ops import Ops, check_mode
from jdet.tp_layout import (
    MAX_TP,
    check_heads,
    check_tp_size,
    check_tree_shards,
    expand_kv_heads,
    ffn_padded,
)
from pallas_kernels import _platform
from pallas_kernels._platform import Backend
from pallas_kernels.matmul import matmul
from pallas_kernels.tree_matmul import tree_matmul_partial_parts, tree_plan
from pallas_kernels.xla_fixed import block_weight

VOCAB_MULTIPLE = 128 * MAX_TP  # lane-aligned vocab shards for every TP size


def backend() -> Backend:
    """The kernel backend this process runs (pallas_kernels/_platform.py `Backend`): the one
    place jdet, sharding and serving learn whether they run on a CPU or a GPU, with which
    kernels. Read when called (JDET_PALLAS_INTERPRET may change it between traces)."""
    return _platform.backend()


def cpu_devices(devices: Any) -> bool:
    """Whether every device of `devices` (e.g. a mesh's `devices.flat`) is a CPU device: where
    host-side numpy beats a compiled program for laying out arrays (sharding/tp.py)."""
    return all(d.platform == "cpu" for d in devices)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The reduction plan of one engine (module docstring). Validated at construction."""

    cfg: ModelConfig
    invariance: str = "tp"
    tp: int = 1
    # KV partition of the invariant paged attention, in tokens (jdet/ops.py says why 256)
    attn_partition: int = Ops.attn_partition

    def __post_init__(self) -> None:
        check_mode(self.invariance)
        check_tp_size(self.tp)
        check_heads(self.cfg, self.tp)

    @property
    def backend(self) -> Backend:
        """The kernel backend the plan's kernels run on (module function `backend`)."""
        return backend()

    @property
    def sharded(self) -> bool:
        """Run the `shard_map` step: for tp > 1, and in "tp" mode at tp = 1 as well (the padded
        weights reduce down_proj in the tree every TP size reduces it in)."""
        return self.tp > 1 or self.invariance == "tp"

    def ops(self) -> Ops:
        """The unsharded step's Ops (sharding/tp.py `make_tp_ops` adds the cross-device part)."""
        return Ops(invariance=self.invariance, attn_partition=self.attn_partition)

    def prepare_params(self, params: dict, **kw: Any) -> dict:
        """The weights as this plan's runtime takes them (identity for the unsharded step)."""
        if not self.sharded:
            return params
        self.check_tree_shards(jax.tree_util.tree_leaves(params)[0].dtype)
        return prepare_params(params, self.cfg, self.tp, blocked=self.blocked, **kw)

    def check_tree_shards(self, dtype: Any) -> None:
        """jdet/tp_layout.py `check_tree_shards` in "tp" mode (the others reduce each shard
        sequentially): fail at construction, not when the first step is traced."""
        if self.invariance == "tp":
            check_tree_shards(self.cfg, self.tp, dtype)

    @property
    def blocked(self) -> bool:
        """Whether the matmul weights come cut into their dots' blocks (jdet/plan.py
        `matmul_weights`): "tp" mode on one device (on a CPU; a no-op elsewhere)."""
        return self.invariance == "tp" and self.tp == 1

    def kernel_plan(self, page_size: int) -> dict:
        """The plan's part of `system_fingerprint` (jdet/fingerprint.py)."""
        plan: dict = {
            "page_size": page_size,
            "attn_partition": self.attn_partition,
            "tp": self.tp if self.invariance != "tp" else "any",
        }
        if self.sharded and self.backend.xla_fixed:
            plan["matmul_weights"] = "float32"  # `matmul_weights`: other CPU bits than bf16
        return plan


def row_partial_kernel(invariance: str, num_shards: int) -> Callable:
    """The f32 partial of a row-parallel projection (o_proj, down_proj) over one device's
    contiguous shard of the input width I, as leaf groups [G, T, N] whose `combine_tree` is the
    partial (`Ops.row_partial`): the exact subtree of the tree matmul in "tp", in the groups
    the Hopper kernel leaves it in (its upper levels, and these groups' sum, are the tree
    all-reduce's); a BIO matmul in "batch", an XLA dot in "none" (G = 1, combined by psum)."""
    check_mode(invariance)
    n = num_shards
    if invariance == "tp":
        def row_partial(x: jax.Array, w: jax.Array) -> jax.Array:
            # Every shard's subtree has the same shape, so the kernel needs no device index.
            return tree_matmul_partial_parts(x, w, k_total=w.shape[0] * n, num_shards=n)

    elif invariance == "batch":
        def row_partial(x: jax.Array, w: jax.Array) -> jax.Array:
            return matmul(x, w, out_dtype=jnp.float32)[None]

    else:

        def row_partial(x: jax.Array, w: jax.Array) -> jax.Array:
            return jnp.dot(x, w, preferred_element_type=jnp.float32)[None]

    return row_partial


# -- the weight layout ----------------------------------------------------------------------------
def tree_block_k(k_total: int, dtype: Any) -> int:
    """The tree kernel's tile of down_proj's input width I = F (a function of I and dtype, never
    of TP)."""
    return tree_plan(k_total, jnp.dtype(dtype)).block_k


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pad_params(
    params: dict,
    cfg: ModelConfig,
    *,
    ffn_multiple: int | None = None,
    vocab_multiple: int = VOCAB_MULTIPLE,
    release: Callable[[Any], None] | None = None,
) -> dict:
    """Zero-pad FFN width and vocabulary (and untie lm_head) so every TP size <= MAX_TP splits them.

    Why once, for every TP size: zero FFN columns are exact (silu(0) * 0 = 0 feeds zero rows of
    w_down) and zero lm_head columns give logits that the TP step slices away, but padding changes
    the tile count of down_proj's input width F, and with it the shape of the tree that reduces
    it; so F is padded to a multiple of `block_k * MAX_TP` for all TP sizes, TP=1 included: every
    TP size then reduces the same padded F in the same tree, and shard r of n is a whole subtree.
    Idempotent, and independent of the TP size. Returns a new dict; `params` is not modified,
    though `release` (`releaser`) may free each of its arrays once its padded copy exists.
    """
    release = release or _keep
    out = dict(params)
    layers = dict(params["layers"])
    # (gate, up, down) of the dense MLP, and of the experts (each expert's F padded alike): a
    # mixture-of-experts model may have either or both (jdet/moe.py)
    for gate, up, down in (("w_gate", "w_up", "w_down"),
                           ("expert_gate", "expert_up", "expert_down")):  # fmt: skip
        if gate not in layers:
            continue
        F = layers[gate].shape[-1]
        F_pad = _round_up(F, ffn_multiple) if ffn_multiple else ffn_padded(F, layers[down].dtype)
        if F_pad != F:
            lead = ((0, 0),) * (layers[gate].ndim - 2)
            pf = F_pad - F
            for name, w in ((gate, ((0, 0), (0, pf))), (up, ((0, 0), (0, pf))),
                            (down, ((0, pf), (0, 0)))):  # fmt: skip
                old = layers[name]
                layers[name] = _pad(old, (*lead, *w))
                release(old)  # one weight at a time: at most one extra padded weight alive
    out["layers"] = layers
    lm = _transposed(params["embed"]) if cfg.tie_word_embeddings else params["lm_head"]
    V = lm.shape[-1]
    V_pad = _round_up(V, vocab_multiple)
    out["lm_head"] = _pad(lm, ((0, 0), (0, V_pad - V))) if V_pad != V else lm
    if out["lm_head"] is not lm and not cfg.tie_word_embeddings:
        release(lm)
    return out


def _keep(x: Any) -> None:
    """The `release` that frees nothing (the caller keeps its weights)."""


def releaser(params: dict, donate: bool) -> Callable[[Any], None]:
    """`release(x)`: with `donate`, delete x if it is one of `params`' device arrays (the caller
    gave the engine its weights); a no-op otherwise. Why: the plan's layout (padding, fused
    projections, f32 CPU copies, TP shards) is a second copy of most weights, and a model near
    the device's size (an MoE of 61 GB on a 141 GB GPU) does not fit twice. Each step of
    `prepare_params` releases a weight as soon as its replacement exists, so the peak is the
    model plus one weight's new copy. Arrays that alias a kept buffer are never passed here."""
    if not donate:
        return _keep
    own = {id(x) for x in jax.tree_util.tree_leaves(params)
           if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)}  # fmt: skip

    def release(x: Any) -> None:
        if id(x) in own and not x.is_deleted():
            x.delete()

    return release


def shares_buffer(old: Any, new: Any) -> bool:
    """Whether `new` (a placed copy of `old`) holds `old`'s own device buffer: jax.device_put
    onto an equivalent placement aliases instead of copying, and deleting `old` would then
    delete `new`'s data too."""
    if not isinstance(old, jax.Array) or not isinstance(new, jax.Array):
        return False
    ptrs = {s.data.unsafe_buffer_pointer() for s in old.addressable_shards}
    return any(s.data.unsafe_buffer_pointer() in ptrs for s in new.addressable_shards)


def _on_host(x: Any) -> bool:
    """A concrete array on one CPU device: padded/transposed by numpy here, because a jnp op on
    a concrete array compiles a program per shape (w_gate/w_up, w_down and the tied lm_head's
    transpose: more of a cold `jdet generate` than the copies take). GPU arrays and
    tracers stay in XLA (no device -> host round trip of a large model)."""
    if isinstance(x, np.ndarray):
        return True
    if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
    devices = x.sharding.device_set
    return len(devices) == 1 and cpu_devices(devices)


def _placed_like(y: np.ndarray, x: Any) -> jax.Array:
    """`y` as a jax array placed as `x` was (committed to its device, or not)."""
    committed = isinstance(x, jax.Array) and x.committed
    return jax.device_put(y, x.sharding) if committed else jax.device_put(y)


def _pad(x: Any, widths: tuple[tuple[int, int], ...]) -> Any:
    """jnp.pad with zeros (on the host for a CPU array: `_on_host`; the same values)."""
    if _on_host(x):
        return _placed_like(np.pad(np.asarray(x), widths), x)
    return jnp.pad(x, widths)


def _transposed(x: Any) -> Any:
    """x.T (on the host for a CPU array: `_on_host`)."""
    if _on_host(x):
        return _placed_like(np.ascontiguousarray(np.asarray(x).T), x)
    return x.T


def fuse_projections(params: dict, tp: int, release: Callable[[Any], None] | None = None) -> dict:
    """One q|k|v weight (`wqkv`) and one gate|up weight (`w_gate_up`) per layer, laid out so that
    shard r of `tp` holds [q_r | k_r | v_r] and [gate_r | up_r]: two matmul launches per layer
    instead of five, and the narrow k/v projections (N = K*E, 8 CTAs at batch 1) ride on q's.

    Why the bits do not change: in the Hopper BIO kernel an output element's arithmetic is the
    same 64-wide steps over the input width into one f32 accumulator whatever N is and whichever
    CTA holds the column (pallas_kernels/matmul_mosaic.py), so column j of the fused product is
    bitwise column j of its part; tests/sharding/test_fused_gpu.py checks it. Only used where that
    holds (`fuse_default`): the portable kernel's N tile may follow N.
    """
    layers = dict(params["layers"])

    def cat(names: tuple[str, ...]) -> jax.Array:
        parts = [layers.pop(n) for n in names]
        lead = parts[0].shape[:-1]
        blocks = [w.reshape(*lead, tp, w.shape[-1] // tp) for w in parts]
        fused = jnp.concatenate(blocks, axis=-1)
        for w in parts:
            (release or _keep)(w)
        return fused.reshape(*lead, fused.shape[-2] * fused.shape[-1])

    layers["wqkv"] = cat(("wq", "wk", "wv"))
    if "w_gate" in layers:  # an all-expert MoE model has no dense MLP
        layers["w_gate_up"] = cat(("w_gate", "w_up"))
    return {**params, "layers": layers}


def fuse_default() -> bool:
    """Fuse the column-parallel projections on Hopper, where the Mosaic kernel makes it exact."""
    return backend().hopper


def prepare_params(
    params: dict,
    cfg: ModelConfig,
    tp: int,
    *,
    ffn_multiple: int | None = None,
    fuse: bool | None = None,
    blocked: bool = False,
    donate: bool = False,
) -> dict:
    """Host-side layout for `tp` devices: pad (TP-independent), replicate kv heads if needed,
    fuse q|k|v and gate|up (`fuse_projections`; default `fuse_default()`), and hold the matmul
    weights as the kernels take them (`matmul_weights`; `blocked`: "tp" mode at tp = 1 only).
    `donate`: free each of the caller's arrays once its replacement exists (`releaser`); the
    ones the layout keeps as they are stay shared with the result."""
    if blocked and tp != 1:
        raise ValueError(f"blocked weights are laid out for one device, not tp={tp}")
    check_heads(cfg, tp)
    release = releaser(params, donate)
    p = pad_params(params, cfg, ffn_multiple=ffn_multiple, release=release)
    p = expand_kv_heads(p, cfg, tp, release=release)
    p = fuse_projections(p, tp, release) if (fuse_default() if fuse is None else fuse) else p
    # not released here: the CPU's f32 copies may be numpy views of the weights until placed
    return matmul_weights(p, blocked=blocked, ffn=cfg.intermediate_size)


# Every [in, out] weight a matmul kernel reads (layer leaves are stacked on L): not norms,
# biases or the embedding (a row gather whose rows are the activations' dtype).
MATMUL_WEIGHTS = frozenset(
    {"wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down", "wqkv", "w_gate_up", "lm_head"}
)


ROW_PARALLEL = frozenset({"wo", "w_down"})  # reduced by the tree matmul in "tp" mode


# The FFN weights `pad_params` pads, and which of their extents (live_n: columns, live_k: rows)
# is the true FFN width: blocked, the zero blocks past it are not held (xla_blocked.block_weight).
FFN_LIVE = {"w_gate": "live_n", "w_up": "live_n", "w_down": "live_k"}


def matmul_weights(params: dict, *, blocked: bool = False, ffn: int | None = None) -> dict:
    """The matmul weights as the kernels here take them: on the xla_fixed CPU path float32
    copies of 16-bit weights (`_platform.matmul_weight_dtype`), made once here instead of by XLA
    in every step, and with `blocked` ("tp" mode on one device) cut into the blocks of their
    fixed-shape dots (`xla_fixed.BlockedWeight`: BIO blocks for the column weights, the tree's
    leaves for o_proj/down_proj), so no step copies a weight; blocked bf16 weights are held as
    their bits and widened to f32 in the step, a group of blocks at a time (half the bytes read;
    pallas_kernels/xla_blocked.py); with `ffn` (the unpadded FFN width) the FFN blocks wholly in
    `pad_params`' zero padding are not held and their dots not run (an exact zero takes each
    skipped leaf's place in the tree: 25 % of the embedded model's MLP work). Same dots, same
    bits as the unblocked f32 weights, which every TP size > 1 runs. Unchanged on a GPU."""
    blocked = blocked and backend().xla_fixed

    def conv(name: str, w: Any) -> Any:
        if name not in MATMUL_WEIGHTS:
            return w
        dtype = _platform.matmul_weight_dtype(w.dtype)
        if dtype == w.dtype and not blocked:
            return w
        if not isinstance(w, jax.core.Tracer):  # on the host: no XLA compile per weight
            w = np.asarray(w)
        if not blocked:
            return w.astype(dtype)
        # bf16 blocks are held as their bits and widened to `dtype` in the step (xla_blocked)
        compute = dtype if w.dtype == jnp.bfloat16 and dtype == jnp.float32 else None
        w = w if compute is not None else w.astype(dtype)
        k = w.shape[-2]
        live = {FFN_LIVE[name]: ffn} if ffn is not None and name in FFN_LIVE else {}
        if name in ROW_PARALLEL:  # the activations (bf16/f16/f32) promote to `dtype`
            tree = tree_plan(k, dtype)
            return block_weight(
                w, num_leaves=tree.num_leaves, leaf_k=tree.leaf_k, compute=compute, **live
            )
        return block_weight(w, num_leaves=1, leaf_k=k, compute=compute, **live)

    out = {k: conv(k, v) for k, v in params.items() if k != "layers"}
    out["layers"] = {k: conv(k, v) for k, v in params["layers"].items()}
    # back on the device (a transfer, not a compile), as the params came
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(x) if isinstance(x, np.ndarray) else x, out
    )
